"""MiniLM classifier through a TOML-defined pipeline: remove dropout → quantize → calibrate → lower int8 → export.

The pipeline file (examples/pipelines/int8.toml) is validated before anything runs; each transform's
numerical contract is checked after it runs on a batch of real reviews; the report is printed. The
checkpoint is then reloaded and :meth:`Pipeline.from_history` rebuilds the pipeline from it and replays
it on the original graph (outputs must match the checkpoint's within 1e-6).

    python -m fxforge.examples.pipeline_minilm [--out DIR] [--pipeline FILE] [--batch 8] [--length 64]

The classifier head is freshly initialised (no fine-tuning here), so this shows the mechanics and the
measured errors, not accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from fxforge import ForgeGraph  # noqa: E402
from fxforge.data import load_reviews  # noqa: E402
from fxforge.models.bert import minilm_for_sequence_classification, minilm_tokenizer  # noqa: E402
from fxforge.pipelines import Pipeline  # noqa: E402
from fxforge.pipelines.toml import load_toml  # noqa: E402

PIPELINE = Path(__file__).with_name("pipelines") / "int8.toml"


def _max_diff(a: object, b: object) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, default=PIPELINE, help="pipeline TOML file")
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--batch", type=int, default=8, help="reviews in the contract-check batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per review")
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = minilm_tokenizer()
    texts = [r.text for r in load_reviews("imdb")["test"][: args.batch]]
    batch = dict(tokenizer(texts, padding="max_length", truncation=True, max_length=args.length,
                           return_tensors="pt"))
    batch = {k: batch[k] for k in ("input_ids", "attention_mask")}
    model = minilm_for_sequence_classification().eval()
    t0 = time.perf_counter()
    mg = ForgeGraph(model, example_inputs=batch, hf_input_names=["input_ids", "attention_mask"])
    print(f"captured MiniLM ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{mg.frontend} frontend) in {time.perf_counter() - t0:.1f}s")

    tmp = None
    if args.out is None:
        tmp = tempfile.TemporaryDirectory()
        args.out = Path(tmp.name) / "minilm-int8.ckpt"
    doc = load_toml(args.pipeline)  # Pipeline.from_toml(path) when the file's export path is what you want
    for step in doc.get("steps", []):
        if isinstance(step, dict) and step.get("pass") == "export":
            step["args"] = {**step.get("args", {}), "path": str(args.out)}
    pipe = Pipeline.from_dict(doc, data=[batch])
    print(f"{pipe!r} (validated: names, args, order)")

    int8, report = pipe(mg)
    print(report)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    ref = mg(**batch)
    print(f"fp32 vs int8 logits on the batch: max abs diff {_max_diff(ref, int8(**batch)):.4g}")

    reloaded = ForgeGraph.from_checkpoint(args.out)
    replay = Pipeline.from_history(reloaded)
    again, _ = replay(mg, verify=False)
    diff = _max_diff(again(**batch), reloaded(**batch))
    print(f"checkpoint {args.out}: history {[r.name for r in reloaded.history]}")
    print(f"replayed {[s.name for s in replay.steps]} on the original graph: max abs diff vs checkpoint {diff:.3g}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if diff <= 1e-6 else 1


if __name__ == "__main__":
    raise SystemExit(main())
