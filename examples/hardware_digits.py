"""MASE tutorial 8 end to end: a digits MLP searched for fixed-point widths, emitted as SystemVerilog, simulated.

1. Train a small MLP (64 -> hidden -> ReLU -> 10) on scikit-learn's bundled ``load_digits`` (no download;
   fixed seed; train / validation / test split).
2. Search per-layer fixed-point widths (inputs and weights of each Linear) with Optuna (TPE) through
   ``fxforge.search``: objectives are validation accuracy and two numbers of ``hardware_estimate_analysis_pass``
   at a fixed parallelism: the multipliers weighted by their operand widths (``multiplier_bits``: the
   estimate's multiplier count times data bits times weight bits, what array multipliers cost in LUTs) and
   the weight ROM bits. Fraction widths are not searched: each tensor gets the most fraction bits its range
   (weights: the trained values; inputs: the activations seen on the training set) leaves at the sampled width.
3. Pick the smallest front point (weight memory, then multiplier bits) within 1 point of the front's best
   accuracy, emit it with the argmax classifier in hardware (``emit_verilog_transform_pass``), simulate the
   test set under Verilator with cocotb (``simulate_design``; builds cached per source hash) and assert the
   RTL's class indices equal the integer reference's and the quantized model's, bit for bit.

``python -m fxforge.examples.hardware_digits [--quick] [--run-dir DIR]``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.hardware import (
    build_hw_graph,
    dequantize,
    hardware_estimate_analysis_pass,
    integer_forward,
    quantize_input,
)
from fxforge.passes import quantize_transform_pass
from fxforge.search import Objective, Search, SearchSpace, TensorTask, TrialPlan

PARALLELISM = {"data_in_0": 8, "fc1": 4, "fc2": 2}  # input beats of 8 pixels; 4 hidden / 2 class outputs per beat
WIDTHS = (2, 3, 4, 5, 6, 8)


class DigitsMLP(nn.Module):
    """64 pixels -> hidden -> ReLU -> 10 logits, or (``argmax``) the class index: the classifier in hardware."""

    def __init__(self, hidden: int = 32, argmax: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, 10)
        self.argmax = argmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.relu(self.fc1(x)))
        return y.argmax(-1) if self.argmax else y


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits (the file ``sklearn.datasets.load_digits`` reads: 64 pixels 0-16 and the
    label per row), read without importing scikit-learn, whose import (SciPy's stats) takes seconds."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits example needs scikit-learn installed (its bundled load_digits data)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        rows = torch.tensor([[float(v) for v in line.split(",")] for line in f if line.strip()])
    return rows[:, :-1], rows[:, -1].to(torch.int64)


def digits_splits(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The 1,797 8x8 digits, pixels scaled to [0, 1], split 60/20/20 per class (seeded)."""
    x, y = load_digits_tensors()
    x = x / 16.0
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": []}
    for label in range(10):
        idx = torch.nonzero(y == label).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_train, n_val = round(0.6 * len(idx)), round(0.2 * len(idx))
        for name, part in (("train", idx[:n_train]), ("val", idx[n_train:n_train + n_val]),
                           ("test", idx[n_train + n_val:])):
            parts[name].append(part)
    out = {}
    for name, chunks in parts.items():
        order = torch.cat(chunks).sort().values
        out[name] = (x[order], y[order])
    return out


def train_mlp(x: torch.Tensor, y: torch.Tensor, hidden: int, steps: int, seed: int = 0) -> DigitsMLP:
    """Full-batch SGD with momentum by hand (torch.optim's first step imports torch._dynamo, seconds)."""
    torch.manual_seed(seed)
    model = DigitsMLP(hidden)
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, v, g in zip(model.parameters(), velocity, grads):
                v.mul_(0.9).add_(g)
                p.sub_(v, alpha=0.2)
    return model.eval()


def frac_for(width: int, max_abs: float) -> int:
    """The most fraction bits a signed ``width``-bit fixed point has while still covering ``max_abs``."""
    int_bits = math.ceil(math.log2(max_abs)) if max_abs > 0 else 0
    return min(width, width - 1 - int_bits)


def tensor_ranges(model: DigitsMLP, x_train: torch.Tensor) -> dict[str, float]:
    """Largest magnitude of each Linear's input (on the training set), weight and bias."""
    with torch.no_grad():
        hidden = torch.relu(model.fc1(x_train))
        out = {"fc1.data_in": float(x_train.abs().max()), "fc2.data_in": float(hidden.abs().max())}
        for name in ("fc1", "fc2"):
            layer = getattr(model, name)
            out[f"{name}.weight"], out[f"{name}.bias"] = float(layer.weight.abs().max()), float(layer.bias.abs().max())
    return out


def fixed_config(widths: Mapping[str, int], ranges: Mapping[str, float]) -> dict[str, Any]:
    """quantize_transform_pass's config: per layer ``{layer}:data_in`` / ``{layer}:weight`` widths (the bias
    takes the weight's), each fraction width from the tensor's range."""
    config: dict[str, Any] = {"by": "name", "default": {"config": {"name": None}}}
    for layer in ("fc1", "fc2"):
        entry: dict[str, Any] = {"name": "integer"}
        for role, width in (("data_in", widths[f"{layer}:data_in"]), ("weight", widths[f"{layer}:weight"]),
                            ("bias", widths[f"{layer}:weight"])):
            entry[f"{role}_width"], entry[f"{role}_frac_width"] = width, frac_for(width, ranges[f"{layer}.{role}"])
        config[layer] = {"config": entry}
    return config


class FixedWidthSpace(SearchSpace):
    """Per Linear layer, the input and weight widths of fixed point; fraction widths follow from the ranges
    (numeric per tensor, as the emitter needs them)."""

    kind = "digits_fixed_widths"

    def __init__(self, ranges: Mapping[str, float], widths: Sequence[int] = WIDTHS) -> None:
        self.ranges, self.widths = dict(ranges), tuple(widths)

    def suggest(self, trial: Any) -> TrialPlan:
        widths = {f"{layer}:{role}": trial.suggest_categorical(f"{layer}:{role}_width", list(self.widths))
                  for layer in ("fc1", "fc2") for role in ("data_in", "weight")}
        return TrialPlan((("quantize_transform_pass", fixed_config(widths, self.ranges)),))

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranges": self.ranges, "widths": list(self.widths)}


def estimate(graph: ForgeGraph, clock_mhz: float = 100.0) -> Any:
    """hardware_estimate_analysis_pass at the example's parallelism."""
    return hardware_estimate_analysis_pass(graph, {"parallelism": dict(PARALLELISM), "clock_mhz": clock_mhz})[1]


def multiplier_bits(graph: ForgeGraph) -> float:
    """Sum over layers of the estimate's multipliers times their operand widths (data bits x weight bits)."""
    layers = estimate(graph).layers.values()
    return float(sum(e["multipliers"] * e["multiplier_bits"][0] * e["multiplier_bits"][1] for e in layers))


def _hw_cost(measure: Any) -> Any:
    """An objective's measurement; a graph the emitter refuses (the float base graph) costs infinitely much."""
    from fxforge.passes import PassError

    def cost(graph: ForgeGraph, task: Any) -> float:
        try:
            return float(measure(graph))
        except PassError:
            return math.inf
    return cost


HW_OBJECTIVES = (Objective("multiplier_bits", "minimize", _hw_cost(multiplier_bits)),
                 Objective("weight_memory_bits", "minimize", _hw_cost(lambda g: estimate(g).weight_memory_bits)))


def choose(rows: list[dict[str, Any]], tolerance: float = 0.01) -> dict[str, Any]:
    """The smallest front point (weight memory, then multiplier bits) within ``tolerance`` of the best accuracy."""
    best = max(r["accuracy"] for r in rows)
    near = [r for r in rows if r["accuracy"] >= best - tolerance - 1e-12]
    return min(near, key=lambda r: (r["weight_memory_bits"], r["multiplier_bits"], -r["accuracy"]))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer training steps and trials, a smaller hidden layer")
    p.add_argument("--hidden", type=int, default=None, help="hidden width (default 32; 16 with --quick)")
    p.add_argument("--trials", type=int, default=None, help="search trials (default 40; 10 with --quick)")
    p.add_argument("--run-dir", default="out/hardware-digits")
    p.add_argument("--sampler", default="tpe", help="Optuna sampler (fxforge.search.SAMPLERS)")
    p.add_argument("--clock-mhz", type=float, default=200.0)
    p.add_argument("--build-root", default=None, help="Verilator build cache (default <tmp>/fxforge-hw-builds)")
    p.add_argument("--no-sim", action="store_true", help="stop before the emit and the Verilator simulation")
    args = p.parse_args(argv)
    hidden = args.hidden or (16 if args.quick else 32)
    trials = args.trials or (10 if args.quick else 40)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    data = digits_splits()
    (x_tr, y_tr), (x_val, y_val), (x_te, y_te) = data["train"], data["val"], data["test"]
    model = train_mlp(x_tr, y_tr, hidden, steps=150 if args.quick else 500)
    float_acc = accuracy(model, x_te, y_te)
    print(f"float MLP 64-{hidden}-10 on load_digits ({len(y_tr)} train / {len(y_val)} val / {len(y_te)} test): "
          f"test accuracy {float_acc:.4f}")
    base = ForgeGraph(model, (x_tr[:4],))
    ranges = tensor_ranges(model, x_tr)
    task = TensorTask({"x": x_val}, y_val, batch_size=len(y_val))
    start = [{f"{layer}:{role}_width": w for layer in ("fc1", "fc2") for role in ("data_in", "weight")} for w in (8, 4)]
    result = Search(FixedWidthSpace(ranges), ["accuracy", *HW_OBJECTIVES], base=base, task=task, n_trials=trials,
                    sampler=args.sampler, run_dir=run, study_name=f"digits-widths-h{hidden}-{args.sampler}",
                    resume=True, enqueue=start, progress=False).run()
    print(f"search: {trials} trials over per-layer input / weight widths {list(WIDTHS)} at parallelism "
          f"{PARALLELISM}; Pareto front (validation accuracy):")
    print(result.table())
    rows = result.rows()
    chosen = choose(rows)
    trial = next(t for t in result.front() if t.number == chosen["trial"])
    config = trial.user_attrs["fxforge_plan"]["steps"][0][1]
    widths = {k.removesuffix("_width"): v for k, v in sorted(chosen["params"].items())}
    print(f"chosen: trial {chosen['trial']} (smallest within 1 pt of the front's best accuracy): widths {widths}")
    # the same trained weights captured with the argmax classifier, quantized with the chosen config
    logits_graph = quantize_transform_pass(ForgeGraph(copy.deepcopy(model), (x_tr[:4],)), config)[0]
    model.argmax = True
    classifier = quantize_transform_pass(ForgeGraph(copy.deepcopy(model), (x_tr[:4],)), config)[0]
    with torch.no_grad():
        q_classes = classifier.model(x_te)
    quant_acc = float((q_classes == y_te).float().mean())
    hw = build_hw_graph(classifier, dict(PARALLELISM))
    x_int = quantize_input(x_te, hw.layers[hw.input].fmt)
    ref = integer_forward(hw, x_int)
    assert torch.equal(ref.squeeze(-1), q_classes), "the integer reference's classes differ from the quantized model's"
    hw_logits = build_hw_graph(logits_graph, dict(PARALLELISM))
    with torch.no_grad():
        q_logits = logits_graph.model.double()(x_te.double())
    assert torch.equal(dequantize(hw_logits, integer_forward(hw_logits, x_int)), q_logits), \
        "the integer reference's logits differ from the quantized model's"
    est = estimate(classifier, args.clock_mhz)
    print(f"quantized model test accuracy {quant_acc:.4f} (float {float_acc:.4f})")
    print(f"estimate at parallelism {PARALLELISM}: {est.multipliers} multipliers "
          f"({multiplier_bits(classifier):.0f} multiplier bits), {est.weight_memory_bits} weight memory bits, "
          f"{est.buffer_bits} buffer bits, {est.adder_bits} adder bits; latency {est.latency_cycles} cycles "
          f"= {est.latency_us:.3f} us at {est.clock_mhz:.0f} MHz, initiation interval {est.initiation_interval} cycles")
    summary: dict[str, Any] = {"float_accuracy": float_acc, "quantized_accuracy": quant_acc, "chosen": chosen,
                               "config": config, "estimate": {k: v for k, v in est.to_json().items() if k != "layers"}}
    if not args.no_sim:
        summary.update(_emit_and_simulate(classifier, x_int, ref, y_te, run, args.build_root, est.latency_cycles))
        print(f"RTL (Verilator) test accuracy {summary['rtl_accuracy']:.4f} = quantized model {quant_acc:.4f}: "
              f"{len(y_te)} class indices bit-exact; simulated latency {summary['rtl_latency_cycles']} cycles "
              f"(estimate {est.latency_cycles}); build {summary['build_seconds']:.1f} s, "
              f"simulation {summary['sim_seconds']:.1f} s")
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def _emit_and_simulate(classifier: ForgeGraph, x_int: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor,
                       run: Path, build_root: str | None, est_latency: int) -> dict[str, Any]:
    """Emit the classifier, stream the test set through Verilator, and check it bit for bit."""
    from fxforge.hardware import emit_verilog_transform_pass
    from fxforge.hardware.simulate import simulate_design

    rtl = run / "rtl"
    _, info = emit_verilog_transform_pass(classifier, {"out_dir": str(rtl), "top": "digits_mlp",
                                                       "parallelism": dict(PARALLELISM)})
    print(f"emitted {len(info.sources)} sources and {len(info.roms)} ROM files to {rtl}")
    res = simulate_design(rtl, x_int, build_root=build_root)
    assert torch.equal(res.outputs, ref.reshape(res.outputs.shape)), "RTL outputs differ from the integer reference"
    alone = simulate_design(rtl, x_int[:2], build_root=build_root, one_at_a_time=True)
    assert alone.latencies == [est_latency] * 2, (alone.latencies, est_latency)
    rtl_acc = float((res.outputs.squeeze(-1) == labels).float().mean())
    return {"rtl_accuracy": rtl_acc, "rtl_latency_cycles": alone.latencies[0], "build_seconds": res.build_seconds,
            "sim_seconds": res.sim_seconds, "rtl_dir": str(rtl)}


if __name__ == "__main__":
    raise SystemExit(main())
