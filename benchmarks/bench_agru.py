"""Naive A-GRU vs the fxforge-optimized graph vs nn.GRU vs torch.compile: fwd+bwd and forward, one run.

Run: ``python -m fxforge.benchmarks.bench_agru`` (``--quick`` skips torch.compile and the large size).
Variants, all with the same sizes and the same Linear head on the last hidden state:

* ``naive``: ``AGRUClassifier`` in eager mode (the baseline, ratio 1.00);
* ``captured``: its export capture (time loop unrolled), no passes;
* ``optimized``: the capture after ``optimize_graph_pipeline`` (CSE, DCE, hoisting, matmul batching,
  addcmul fusion), the unmodified model; ``optimized+fold`` adds constant folding (forward only);
* ``nn.GRU``: ``nn.GRU(input, H, layers, batch_first=True)`` + head;
* ``compile(naive)`` / ``compile(optimized)``: ``torch.compile`` of the naive model / of the optimized
  graph (the hand-off of the gate math to inductor);
* ablation: the optimized graph with one pipeline step left out (ratio to ``optimized``).

Every round runs each variant once, in turn (interleaved), after a warm-up round; cells are medians;
ratios are variant / naive. Memory: bytes of the distinct tensors autograd saves for backward (the
activation memory held at the end of forward, which dominates fwd+bwd peak), optimized vs naive.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..graph.forge_graph import ForgeGraph
from ..models.agru import AGRUClassifier
from ..passes.compiler.pipeline import ROUND, optimize_graph_pipeline


class GRUClassifier(nn.Module):
    """torch's nn.GRU with the A-GRU's head: logits from the last hidden state."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, num_classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(input_size, hidden_size, num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1, :])


Step = Callable[[], float]


def fwd_bwd(model: Callable[[torch.Tensor], torch.Tensor], params: Sequence[torch.Tensor], x: torch.Tensor,
            y: torch.Tensor) -> Step:
    def run() -> float:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        return time.perf_counter() - t0
    return run


def forward(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Step:
    def run() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            model(x)
            return time.perf_counter() - t0
    return run


def interleaved(steps: dict[str, Step], repeats: int) -> dict[str, float]:
    """Median seconds per variant; variants alternate within each round (round 0 warms up)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for round_ in range(repeats + 1):
        for name, step in steps.items():
            seconds = step()
            if round_:
                times[name].append(seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def saved_bytes(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(seen.values())


def build(size: tuple[int, int, int, int], layers: int, compile_: bool, ablate: bool
          ) -> tuple[dict[str, nn.Module | Callable[..., torch.Tensor]], dict[str, list[nn.Parameter]], torch.Tensor,
                     torch.Tensor, dict[str, float]]:
    hidden, length, batch, inputs = size
    torch.manual_seed(0)
    naive = AGRUClassifier(inputs, hidden, layers, 10).eval()
    x = torch.randn(batch, length, inputs)
    y = torch.randint(0, 10, (batch,))
    t0 = time.perf_counter()
    captured = ForgeGraph(naive, x)
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    optimized, info = optimize_graph_pipeline(captured.copy())
    optimize_s = time.perf_counter() - t0
    folded, _ = optimize_graph_pipeline(captured.copy().eval(), fold=True)
    models: dict[str, nn.Module | Callable[..., torch.Tensor]] = {
        "naive": naive, "captured": captured.model, "optimized": optimized.model,
        "nn.GRU": GRUClassifier(inputs, hidden, layers).eval(),
    }
    sizes = {"capture_s": round(capture_s, 2), "optimize_s": round(optimize_s, 2),
             "nodes_captured": info.nodes_before, "nodes_optimized": info.nodes_after}
    if ablate:
        for step in dict.fromkeys(ROUND):
            graph, _ = optimize_graph_pipeline(captured.copy(), skip=(step,))
            models[f"optimized without {step}"] = graph.model
    fold_model = {"optimized+fold": folded.model}
    if compile_:
        models["compile(naive)"] = torch.compile(naive)
        models["compile(optimized)"] = torch.compile(optimized.model)
    params = {k: [p for p in m.parameters()] if isinstance(m, nn.Module) else list(naive.parameters())
              for k, m in models.items()}
    models.update(fold_model)
    return models, params, x, y, sizes


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1: robust on a shared, loaded machine)")
    p.add_argument("--quick", action="store_true", help="no torch.compile, no ablation, small size only")
    p.add_argument("--no-large", action="store_true", help="skip the large size")
    p.add_argument("--no-small", action="store_true", help="skip the small size")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (~30 s+ cold per model)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = ([] if args.no_small else [(128, 28, 128, 28)]) + (
        [] if args.quick or args.no_large else [(256, 128, 128, 28)])
    print(f"A-GRU benchmark: torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}, repeats {args.repeats} (medians)")
    results: dict[str, dict[str, float]] = {}
    for size in sizes:
        hidden, length, batch, inputs = size
        large = size[0] > 128
        compile_ = not (args.quick or args.no_compile)
        models, params, x, y, info = build(size, args.layers, compile_, ablate=not args.quick and not large)
        print(f"\nH {hidden}, T {length}, B {batch}, inputs {inputs}, layers {args.layers}: {info}")
        train = {k: fwd_bwd(m, params[k], x, y) for k, m in models.items() if k != "optimized+fold"}
        if compile_:
            t0 = time.perf_counter()
            for k in ("compile(naive)", "compile(optimized)"):
                train[k]()
            print(f"torch.compile warm-up (fwd+bwd, both): {time.perf_counter() - t0:.1f} s")
        fb = interleaved(train, args.repeats)
        fwd = interleaved({k: forward(m, x) for k, m in models.items()}, args.repeats)
        base_fb, base_f = fb["naive"], fwd["naive"]
        print(f"{'variant':34s} {'fwd+bwd ms':>11s} {'ratio':>6s} {'forward ms':>11s} {'ratio':>6s}")
        for k in fwd:
            fbs = f"{fb[k] * 1e3:11.2f} {fb[k] / base_fb:6.2f}" if k in fb else f"{'-':>11s} {'-':>6s}"
            print(f"{k:34s} {fbs} {fwd[k] * 1e3:11.2f} {fwd[k] / base_f:6.2f}")
        opt_fb, opt_f = fb["optimized"], fwd["optimized"]
        print(f"optimized / nn.GRU: fwd+bwd {opt_fb / fb['nn.GRU']:.2f}, forward {opt_f / fwd['nn.GRU']:.2f}")
        if "compile(naive)" in fb:
            print(f"optimized / compile(naive): fwd+bwd {opt_fb / fb['compile(naive)']:.2f}, "
                  f"forward {opt_f / fwd['compile(naive)']:.2f}")
        ablation = [k for k in fb if k.startswith("optimized without")]
        for k in ablation:
            print(f"ablation {k:30s}: fwd+bwd x{fb[k] / opt_fb:.2f}, forward x{fwd[k] / opt_f:.2f} of optimized")
        mem_naive = saved_bytes(models["naive"], x)
        mem_opt = saved_bytes(models["optimized"], x)
        print(f"saved-for-backward memory: naive {mem_naive / 2**20:.1f} MiB, optimized {mem_opt / 2**20:.1f} MiB "
              f"(ratio {mem_opt / mem_naive:.2f}); load average now {os.getloadavg()[0]:.2f}")
        results[f"H{hidden}_T{length}"] = {**{f"fb_{k}": v for k, v in fb.items()},
                                           **{f"fwd_{k}": v for k, v in fwd.items()}}
    return results


if __name__ == "__main__":
    main()
