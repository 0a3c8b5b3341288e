"""MASE tutorials 6 and 10, as a library call: mixed-precision search on the fine-tuned MiniLM over IMDb.

    .venv/bin/python -m fxforge.examples.search_mixed_precision --trials 30
    .venv/bin/python -m fxforge.examples.search_mixed_precision --choices tutorial6 --prior sensitivity --trials 30

Per Linear layer, the search picks fixed-point widths for inputs and weights (MASE's ``integer``
format) with every fraction width chosen from the range (``frac_width: "auto"``: per output row of a
weight, per tensor for an input, calibrated on training reviews); objectives are accuracy and average
weight bits, with the constraint "accuracy drops at most one point". It is compared with the uniform
configurations the tutorial picks by hand. ``--choices tutorial`` searches the tutorial's own fraction
widths (1-5), which round most of MiniLM's pooler and classifier weights to zero (the search warns).
``--choices tutorial6`` is tutorial 6's own space: (width, frac_width) pairs for inputs, weights and biases of
each layer, widths 4/6/8/16 with fraction widths 2-12 (the pairs valid for the format: the tutorial's 13 and
six more, (4,4), (6,3), (6,6), (8,3), (8,8), (16,3)); with ``--prior sensitivity`` each layer's weight widths are
shaped by one sensitivity measurement and its ranked allocations are queued first (nothing by hand). The search's
points are reported against the uniform 8-bit and 16-bit ones.
The study is a journal file in the run directory: interrupt it and run again with ``--resume``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from fxforge.benchmarks.minilm_imdb import finetuned_minilm, imdb_task  # noqa: E402
from fxforge.pipelines import Pipeline  # noqa: E402
from fxforge.search import Constraint, MixedPrecisionSpace, Search  # noqa: E402
from fxforge.search.objectives import avg_weight_bits  # noqa: E402
from fxforge.search.precision import AUTO_FIXED_POINT, TUTORIAL_FIXED_POINT  # noqa: E402

# tutorial 6: (4,2) (4,3) (6,2) (6,4) (8,2) (8,4) (8,6) (16,2) ... (16,12) per role; pairs with frac_width > width
# are not valid fixed point, so the product below holds the tutorial's pairs and the few valid ones between them
TUTORIAL6 = {"width": [4, 6, 8, 16], "frac_width": [2, 3, 4, 6, 8, 10, 12]}
CHOICES = {"auto": AUTO_FIXED_POINT, "tutorial": TUTORIAL_FIXED_POINT, "tutorial6": TUTORIAL6}
ROLES = {"auto": ("data_in", "weight"), "tutorial": ("data_in", "weight"), "tutorial6": ("data_in", "weight", "bias")}
UNIFORM = {"auto": ((8, 4), (6, 3), (4, 2), (8, "auto"), (6, "auto"), (4, "auto")),
           "tutorial": ((8, 4), (6, 3), (4, 2), (8, "auto"), (6, "auto"), (4, "auto")),
           "tutorial6": ((16, 8), (8, 4), (16, "auto"), (8, "auto"))}


def uniform(width: int, frac: int | str, calibration: list | None = None) -> list[tuple[str, dict]]:
    """One fixed-point format on every Linear (inputs, weights, biases); ``"auto"`` inputs are calibrated."""
    cfg = {"name": "integer", **{f"{r}_{k}": v for r in ("data_in", "weight", "bias")
                                 for k, v in (("width", width), ("frac_width", frac))}}
    config = {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": cfg}}
    steps: list[tuple[str, dict]] = [("quantize_transform_pass", config)]
    if frac == "auto":
        steps.append(("calibrate_transform_pass", {"data": calibration}))
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--run-dir", default="out/search-mixed-precision")
    p.add_argument("--sampler", default="nsga2")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--choices", choices=sorted(CHOICES), default="auto",
                   help="fixed-point choices per layer: widths 4/6/8 with fraction widths from the range (auto), "
                        "the tutorial's widths 2-8 and fraction widths 1-5 (tutorial), or tutorial 6's (width, "
                        "frac_width) pairs for inputs, weights and biases (tutorial6)")
    p.add_argument("--prior", choices=("none", "sensitivity"), default="none",
                   help="sensitivity: per-layer weight widths shaped and allocations queued by one measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=128, help="tokens kept per review")
    p.add_argument("--calibration-size", type=int, default=256,
                   help="training reviews the calibration and the sensitivity prior run on")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    task = imdb_task(args.train_size, args.eval_size, args.max_length)
    task.calibration_size = args.calibration_size
    base = finetuned_minilm(run, task)
    fp32 = task.accuracy(base)
    print(f"fp32 accuracy on {args.eval_size} held-out reviews: {fp32:.3f}")
    print("uniform configurations (the tutorial's hand-picked choice, then fraction widths from the range):")
    calibration = task.calibration(base.model)[0]
    uniforms: dict[tuple[int, int | str], tuple[float, float]] = {}
    for width, frac in UNIFORM[args.choices]:
        g, _ = Pipeline(uniform(width, frac, calibration), name=f"uniform integer {width}/{frac}", verify=False)(base)
        uniforms[width, frac] = task.accuracy(g), avg_weight_bits(g)
        print(f"  integer {width}/{frac} everywhere: accuracy {uniforms[width, frac][0]:.3f}, "
              f"avg weight bits {uniforms[width, frac][1]:.2f}")
    prior = None if args.prior == "none" else args.prior
    roles = ROLES[args.choices]
    space = MixedPrecisionSpace({"integer": CHOICES[args.choices]}, roles=roles, per="layer", prior=prior)
    layers = space.bind(base).keys()
    # the first trials are the uniform 8- and 6-bit points (when the choices are auto and there is no prior to
    # queue its own), so the search starts from feasible parents instead of independent draws per layer
    start = [{f"{layer}:integer:{role}_width": width for layer in layers for role in roles}
             for width in (8, 6)] if args.choices == "auto" and prior is None else []
    name = f"mixed-precision-{args.choices}" + ("-prior" if prior else "")
    result = Search(space, ["accuracy", "avg_weight_bits"], base=base, task=task, n_trials=args.trials,
                    sampler=args.sampler, seed=args.seed, constraints=[Constraint("accuracy", max_drop=0.01)],
                    run_dir=run, study_name=name, resume=args.resume, enqueue=start).run()
    print(result.table())
    compare(result, fp32, uniforms)
    result.to_csv(run / "pareto.csv")
    result.to_json(run / "pareto.json")
    plots = result.plots(run / "plots")
    print(f"results: {run / 'pareto.csv'}, plots: {', '.join(p.name for p in plots)}")
    best = result.front()[:1]
    if best:
        paths = result.export(run / "best", best)
        print(f"best point rebuilt from its parameters and exported to {paths[0]}")
    return 0


def compare(result: Any, fp32: float, uniforms: dict[tuple[int, int | str], tuple[float, float]]) -> None:
    """The front's points against the uniform 8-bit and 16-bit configurations (accuracy, average weight bits)."""
    eight = [v for (w, _), v in uniforms.items() if w == 8]
    sixteen = [v for (w, _), v in uniforms.items() if w == 16]
    refs = [("uniform 8-bit", max(eight)), *([("uniform 16-bit", max(sixteen))] if sixteen else [])]
    print("search vs uniform (best fraction width of each uniform width): "
          + ", ".join(f"{n} accuracy {a:.3f} at {b:.2f} avg weight bits" for n, (a, b) in refs)
          + f"; fp32 {fp32:.3f}")
    for row in result.rows(result.front()):
        print(f"  trial {row['trial']}: accuracy {row['accuracy']:.3f} at {row['avg_weight_bits']:.2f} bits; "
              + ", ".join(f"{100 * (row['accuracy'] - a):+.1f} points and {row['avg_weight_bits'] - b:+.2f} bits vs {n}"
                          for n, (a, b) in refs) + (" (feasible)" if row["feasible"] else ""))


if __name__ == "__main__":
    raise SystemExit(main())
