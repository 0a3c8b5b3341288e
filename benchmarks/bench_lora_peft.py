"""fxforge LoRA vs PEFT on the same MiniLM classifier, targets and rank: training step time and merged weights.

    nohup .venv/bin/python -m fxforge.benchmarks.bench_lora_peft > /tmp/bench_lora_peft.log 2>&1 &

Both sides start from identical weights with identical adapters (ours copied into PEFT's), the same
trainable set (adapters on query/key/value/dense + the classifier head) and the same batch. A step is
forward + backward + AdamW step, in train mode (dropout on). Steps alternate ours/PEFT (which one goes
first alternates too) so machine noise hits both; the report is the median time ratio. Then ours is
fused and PEFT merged (``merge_and_unload``) from the same A and B, and the weights are compared.
Targets: step ratio <= 1.1; max |W_ours - W_peft| <= 1e-6.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.models.bert import minilm_for_sequence_classification  # noqa: E402
from fxforge.passes.transform.lora import lora_layers  # noqa: E402

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

TARGETS = ["query", "key", "value", "dense"]


def peft_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """PEFT LoRA layers by the path of the layer they wrap."""
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules()
            if isinstance(m, LoraLayer) and "default" in m.lora_A}


def _default_linear(adapters: nn.ModuleDict) -> nn.Linear:
    """The ``default`` adapter's linear in one of PEFT's ``lora_A`` / ``lora_B`` dicts."""
    linear = adapters["default"]
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"PEFT's default adapter is a {type(linear).__name__}, not an nn.Linear")
    return linear


def copy_adapters_into_peft(ours: ForgeGraph, peft_model: nn.Module) -> int:
    """Give PEFT exactly our A and B (and classifier); returns how many layers were copied."""
    theirs = peft_layers(peft_model)
    layers = lora_layers(ours.model)
    if sorted(theirs) != sorted(p for _, p, _ in layers):
        raise RuntimeError(f"target sets differ: {sorted(set(theirs) ^ {p for _, p, _ in layers})}")
    with torch.no_grad():
        for _, path, m in layers:
            if theirs[path].scaling["default"] != m.scaling:
                raise RuntimeError(f"{path}: scaling {theirs[path].scaling['default']} != {m.scaling}")
            _default_linear(theirs[path].lora_A).weight.copy_(m.lora_A)
            _default_linear(theirs[path].lora_B).weight.copy_(m.lora_B)
        head = peft_model.get_submodule("base_model.model.classifier.modules_to_save.default")
        head.load_state_dict(ours.model.get_submodule("classifier").state_dict())
    return len(layers)


def make_step(model: Callable[..., Any], params: list[nn.Parameter],
              inputs: dict[str, torch.Tensor]) -> Callable[[], float]:
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model

    ours = ForgeGraph(minilm_for_sequence_classification(num_labels=2, seed=0),
                      hf_input_names=["input_ids", "attention_mask", "labels"])
    ours, info = passes.insert_lora_adapter_transform_pass(ours, {
        "rank": args.rank, "alpha": args.alpha, "dropout": args.dropout, "targets": {"name": TARGETS},
        "trainable": {"name": "classifier"}})
    peft_model = get_peft_model(minilm_for_sequence_classification(num_labels=2, seed=0), LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=TARGETS,
        modules_to_save=["classifier"]))
    n = copy_adapters_into_peft(ours, peft_model)
    ours_trainable = sum(p.numel() for p in ours.model.parameters() if p.requires_grad)
    peft_trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    print(f"{n} adapted layers, rank {args.rank}; trainable parameters: fxforge {ours_trainable:,} "
          f"({info.trainable_percent:.2f}%), PEFT {peft_trainable:,}")

    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1000, 30000, (args.batch, args.seq), generator=gen),
              "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
              "labels": torch.randint(0, 2, (args.batch,), generator=gen)}
    ours.train()
    peft_model.train()
    step_ours = make_step(ours, [p for p in ours.model.parameters() if p.requires_grad], inputs)
    step_peft = make_step(peft_model, [p for p in peft_model.parameters() if p.requires_grad], inputs)
    timings = interleaved({"ours": step_ours, "peft": step_peft}, args.steps, warmup=3)  # allocator, AdamW state
    t_ours, t_peft = timings.times["ours"], timings.times["peft"]
    ratio, pair = timings.ratio("ours", "peft"), timings.pair_ratio("ours", "peft")
    print(f"train step (batch {args.batch} x {args.seq}, {torch.get_num_threads()} threads): "
          f"fxforge median {statistics.median(t_ours) * 1e3:.1f} ms, PEFT median "
          f"{statistics.median(t_peft) * 1e3:.1f} ms")
    print(f"RATIO step_time fxforge/PEFT = {ratio:.3f} (median of pairwise ratios {pair:.3f}; target <= 1.1)")

    # Same A and B (the trained ones) on both sides, then fuse / merge_and_unload.
    ours.eval()
    copy_adapters_into_peft(ours, peft_model)
    merged = peft_model.merge_and_unload()
    paths = [p for _, p, _ in lora_layers(ours.model)]
    ours, _ = passes.fuse_lora_weights_transform_pass(ours)
    diff = max((ours.model.get_submodule(p).weight - merged.get_submodule(p).weight).abs().max().item()
               for p in paths)
    bias = max((ours.model.get_submodule(p).bias - merged.get_submodule(p).bias).abs().max().item() for p in paths)
    merged.eval()
    with torch.no_grad():
        logits = (ours(**inputs).logits - merged(**inputs).logits).abs().max().item()
    print(f"merged weights: max |W_fxforge - W_peft| = {diff:.3e} over {len(paths)} layers (target <= 1e-6); "
          f"bias diff {bias:.1e}; logits diff after merge {logits:.2e}")
    ok = ratio <= 1.1 and diff <= 1e-6
    print("TARGETS MET" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
