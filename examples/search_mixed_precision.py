"""MASE tutorials 6 and 10, as a library call: mixed-precision search on the fine-tuned MiniLM over IMDb.

    .venv/bin/python -m fxforge.examples.search_mixed_precision --trials 30

Per Linear layer, the search picks fixed-point widths for inputs and weights (MASE's ``integer``
format) with every fraction width chosen from the range (``frac_width: "auto"``: per output row of a
weight, per tensor for an input, calibrated on training reviews); objectives are accuracy and average
weight bits, with the constraint "accuracy drops at most one point". It is compared with the uniform
configurations the tutorial picks by hand. ``--choices tutorial`` searches the tutorial's own fraction
widths (1-5), which round most of MiniLM's pooler and classifier weights to zero (the search warns).
The study is a journal file in the run directory: interrupt it and run again with ``--resume``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from fxforge.examples.search_common import finetuned_minilm, imdb_task  # noqa: E402
from fxforge.pipelines import Pipeline  # noqa: E402
from fxforge.search import Constraint, MixedPrecisionSpace, Search  # noqa: E402
from fxforge.search.objectives import avg_weight_bits  # noqa: E402
from fxforge.search.precision import AUTO_FIXED_POINT, TUTORIAL_FIXED_POINT  # noqa: E402

CHOICES = {"auto": AUTO_FIXED_POINT, "tutorial": TUTORIAL_FIXED_POINT}


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
                        "or the tutorial's widths 2-8 and fraction widths 1-5")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    task = imdb_task(args.train_size, args.eval_size)
    base = finetuned_minilm(run, task)
    fp32 = task.accuracy(base)
    print(f"fp32 accuracy on {args.eval_size} held-out reviews: {fp32:.3f}")
    print("uniform configurations (the tutorial's hand-picked choice, then fraction widths from the range):")
    calibration = task.calibration(base.model)[0]
    for width, frac in ((8, 4), (6, 3), (4, 2), (8, "auto"), (6, "auto"), (4, "auto")):
        g, _ = Pipeline(uniform(width, frac, calibration), name=f"uniform integer {width}/{frac}", verify=False)(base)
        print(f"  integer {width}/{frac} everywhere: accuracy {task.accuracy(g):.3f}, "
              f"avg weight bits {avg_weight_bits(g):.2f}")
    space = MixedPrecisionSpace({"integer": CHOICES[args.choices]}, roles=("data_in", "weight"), per="layer")
    layers = space.bind(base).keys()
    # the first trials are the uniform 8- and 6-bit points (when the choices are auto), so the search starts
    # from feasible parents instead of independent draws per layer
    start = [{f"{layer}:integer:{role}_width": width for layer in layers for role in ("data_in", "weight")}
             for width in (8, 6)] if args.choices == "auto" else []
    result = Search(space, ["accuracy", "avg_weight_bits"], base=base, task=task, n_trials=args.trials,
                    sampler=args.sampler, constraints=[Constraint("accuracy", max_drop=0.01)], run_dir=run,
                    study_name=f"mixed-precision-{args.choices}", resume=args.resume, enqueue=start).run()
    print(result.table())
    result.to_csv(run / "pareto.csv")
    result.to_json(run / "pareto.json")
    plots = result.plots(run / "plots")
    print(f"results: {run / 'pareto.csv'}, plots: {', '.join(p.name for p in plots)}")
    best = result.front()[:1]
    if best:
        paths = result.export(run / "best", best)
        print(f"best point rebuilt from its parameters and exported to {paths[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
