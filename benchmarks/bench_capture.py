"""Capture + metadata time of the MiniLM classifier next to one eager forward pass (ratio from one run).

    .venv/bin/python -m fxforge.benchmarks.bench_capture
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.examples.demo import load_minilm_classifier  # noqa: E402


def _best_time(fn, repeats: int = 7) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs after two warm-ups (robust to a busy machine)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    model = load_minilm_classifier().eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (8, 128), generator=gen),
              "attention_mask": torch.ones(8, 128, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}
    with torch.no_grad():
        t_forward = _best_time(lambda: model(**inputs))

    t0 = time.perf_counter()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "labels"])
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    t_meta = time.perf_counter() - t0
    mg.eval()
    with torch.no_grad():
        t_graph = _best_time(lambda: mg(**inputs))

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"eager forward (batch 8, len 128, best):  {t_forward * 1e3:8.1f} ms")
    print(f"captured graph forward (same inputs):    {t_graph * 1e3:8.1f} ms  ratio {t_graph / t_forward:.2f}x")
    print(f"capture (torch.export + normalize):      {t_capture * 1e3:8.1f} ms  ratio {t_capture / t_forward:.1f}x")
    print(f"metadata (init + common, dummy inputs):  {t_meta * 1e3:8.1f} ms  ratio {t_meta / t_forward:.1f}x")
    print(f"capture + metadata:                      {(t_capture + t_meta) * 1e3:8.1f} ms  "
          f"ratio {(t_capture + t_meta) / t_forward:.1f}x one eager forward")


if __name__ == "__main__":
    main()
