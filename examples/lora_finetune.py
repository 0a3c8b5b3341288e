"""MASE tutorial 2, offline: fine-tune MiniLM on IMDb in full and with LoRA, then fuse the adapters.

    nohup .venv/bin/python -m fxforge.examples.lora_finetune > /tmp/lora_finetune.log 2>&1 &

Both runs start from the same pretrained MiniLM-L6 with the same fresh classifier head, are captured
with ForgeGraph and trained by the HF Trainer (``data.get_trainer``) on the same reviews, batch size,
epochs and schedule; only the trainable set and the learning rate differ (LoRA: rank-8 adapters on every
Linear but the head, which is fully trainable, as PEFT's ``modules_to_save``; lr 1e-3 vs 1e-4). Each run
is a separate process so its peak memory is its own. Reported: trainable parameters, held-out accuracy,
median train step time, peak RSS during training; then the LoRA graph is fused and its inference time
compared with the base graph's (interleaved repetitions, median). Targets: accuracy within 2 points of
full fine-tuning, trainable <= 2 %, fused inference within 3 % of the base.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.data import get_tokenized_dataset, get_trainer  # noqa: E402
from fxforge.models.bert import MINILM_NAME, minilm_for_sequence_classification  # noqa: E402
from fxforge.passes.lora_checkpoint import save_lora_adapters  # noqa: E402

HF_NAMES = ["input_ids", "attention_mask", "labels"]
LORA_ARGS: dict[str, Any] = {"rank": 8, "alpha": 16.0, "dropout": 0.1, "trainable": {"name": "classifier"}}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Sample the process's resident memory every few ms in a thread; ``peak - start`` = training's cost."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of every optimizer step (forward, backward, update; data loading excluded)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


@torch.no_grad()
def evaluate_accuracy(model: Any, dataset: Any, tokenizer: Any, batch_size: int = 64) -> float:
    """Accuracy of ``model`` (ForgeGraph or HF module returning ``.logits``; labels are passed) on a split."""
    correct = 0
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        labels = torch.tensor([it.pop("labels") for it in items])
        batch = tokenizer.pad(items, return_tensors="pt")
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).logits
        correct += int((logits.argmax(-1) == labels).sum())
    return correct / len(dataset)


def inference_times(graphs: dict[str, ForgeGraph], inputs: dict[str, torch.Tensor],
                    repeats: int) -> dict[str, list[float]]:
    """Interleaved eval forward times (order rotates every repetition) after two warm-ups each."""
    for g in graphs.values():
        g.eval()
    with torch.no_grad():
        return interleaved({k: functools.partial(g, **inputs) for k, g in graphs.items()}, repeats).times


def run_variant(mode: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train one variant ('full' or 'lora') and measure it; runs in its own process."""
    ds, tok = get_tokenized_dataset("imdb", checkpoint=MINILM_NAME, return_tokenizer=True,
                                    max_length=cfg["max_length"], limit=cfg["train"], test_limit=cfg["test"])
    mg = ForgeGraph(minilm_for_sequence_classification(num_labels=2, seed=0), hf_input_names=HF_NAMES)
    if mode == "lora":
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, LORA_ARGS)
    _, params = passes.report_trainable_parameters_analysis_pass(mg, {"show": False})
    timer = _step_timer()
    with tempfile.TemporaryDirectory() as out:
        trainer = get_trainer(mg.model, ds, tok, output_dir=out, num_train_epochs=cfg["epochs"],
                              learning_rate=cfg["lr_" + mode], per_device_train_batch_size=cfg["batch"],
                              per_device_eval_batch_size=64, seed=0,
                              training_args={"warmup_steps": 0.1, "eval_strategy": "no", "disable_tqdm": True,
                                             "logging_steps": 25})
        trainer.add_callback(timer)
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - t0
    mg.eval()
    result: dict[str, Any] = {
        "mode": mode, "trainable": params["trainable"], "total": params["total"],
        "trainable_percent": params["trainable_percent"], "accuracy": evaluate_accuracy(mg, ds["test"], tok),
        "step_s": statistics.median(timer.times[1:] or timer.times), "train_s": train_s,
        "steps": len(timer.times), "peak_mib": (mem.peak - mem.start) / 2**20, "rss_mib": mem.peak / 2**20}
    if mode == "lora":
        with tempfile.TemporaryDirectory() as tmp:
            path = save_lora_adapters(mg, Path(tmp) / "adapter")
            result["adapter_kib"] = sum(f.stat().st_size for f in path.iterdir()) / 1024
        mg, _ = passes.fuse_lora_weights_transform_pass(mg)
        result["fused_accuracy"] = evaluate_accuracy(mg, ds["test"], tok)
        base = ForgeGraph(minilm_for_sequence_classification(num_labels=2, seed=0), hf_input_names=HF_NAMES)
        batch = tok.pad([{"input_ids": ds["test"][i]["input_ids"]} for i in range(cfg["batch"])],
                        padding="max_length", max_length=cfg["max_length"], return_tensors="pt")
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "labels": torch.zeros(cfg["batch"], dtype=torch.long)}
        times = inference_times({"base": base, "fused": mg}, inputs, cfg["repeats"])
        result["infer_base_s"] = statistics.median(times["base"])
        result["infer_fused_s"] = statistics.median(times["fused"])
        result["infer_pair_ratio"] = statistics.median(f / b for f, b in zip(times["fused"], times["base"]))
    return result


def report(full: dict[str, Any], lora: dict[str, Any], cfg: dict[str, Any]) -> bool:
    """Print the comparison table and the target ratios; True when every target is met."""
    print(f"\nMiniLM-L6 on IMDb: {cfg['train']} train / {cfg['test']} test reviews, max_length {cfg['max_length']}, "
          f"{cfg['epochs']:g} epoch, batch {cfg['batch']}, {torch.get_num_threads()} torch threads")
    print(f"{'':6} {'trainable':>12} {'%':>7} {'accuracy':>9} {'step ms':>8} {'train s':>8} {'peak MiB':>9}")
    for r in (full, lora):
        print(f"{r['mode']:6} {r['trainable']:>12,} {r['trainable_percent']:>7.2f} {r['accuracy']:>9.4f} "
              f"{r['step_s'] * 1e3:>8.0f} {r['train_s']:>8.1f} {r['peak_mib']:>9.0f}")
    gap = 100 * (full["accuracy"] - lora["accuracy"])
    share = 100 * lora["trainable"] / full["trainable"]
    infer = lora["infer_fused_s"] / lora["infer_base_s"]
    print(f"LoRA adapters + head checkpoint: {lora['adapter_kib']:.0f} KiB; fused accuracy "
          f"{lora['fused_accuracy']:.4f} (unfused {lora['accuracy']:.4f})")
    print(f"RATIO accuracy gap full - LoRA = {gap:+.2f} points (target <= 2)")
    print(f"RATIO trainable LoRA / full = {share:.2f} % (target <= 2 %)")
    print(f"RATIO train step LoRA / full = {lora['step_s'] / full['step_s']:.3f}; "
          f"peak training memory LoRA / full = {lora['peak_mib'] / max(full['peak_mib'], 1e-9):.3f}")
    print(f"RATIO inference fused / base = {infer:.3f} (median pairwise {lora['infer_pair_ratio']:.3f}; "
          f"base {lora['infer_base_s'] * 1e3:.1f} ms, fused {lora['infer_fused_s'] * 1e3:.1f} ms; target <= 1.03)")
    ok = gap <= 2.0 and share <= 2.0 and infer <= 1.03 and lora["fused_accuracy"] == lora["accuracy"]
    print("TARGETS MET" if ok else "TARGETS MISSED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="training reviews")
    parser.add_argument("--test", type=int, default=1000, help="held-out reviews")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr-full", type=float, default=1e-4)
    parser.add_argument("--lr-lora", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=21, help="interleaved inference repetitions")
    a = parser.parse_args(argv)
    cfg = {"train": a.train, "test": a.test, "max_length": a.max_length, "epochs": a.epochs, "batch": a.batch,
           "lr_full": a.lr_full, "lr_lora": a.lr_lora, "repeats": a.repeats}
    results = {}
    for mode in ("full", "lora"):  # one fresh process each: separate peak memory, no shared state
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[mode] = pool.submit(run_variant, mode, cfg).result()
        r = results[mode]
        print(f"[{mode}] accuracy {r['accuracy']:.4f}, {r['steps']} steps, median step {r['step_s'] * 1e3:.0f} ms, "
              f"train {r['train_s']:.0f}s", flush=True)
    return 0 if report(results["full"], results["lora"], cfg) else 1


if __name__ == "__main__":
    raise SystemExit(main())
