"""MASE tutorials 6 and 10, as a library call: mixed-precision search on the fine-tuned MiniLM over IMDb.

    .venv/bin/python -m fxforge.examples.search_mixed_precision --trials 30

Per Linear layer, the search picks fixed-point widths for inputs and weights (MASE's ``integer``
format); objectives are accuracy and average weight bits, with the constraint "accuracy drops at most
one point". It is compared with the uniform configurations the tutorial picks by hand. The study is a
journal file in the run directory: interrupt it and run again with ``--resume``.
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
from fxforge.search.precision import TUTORIAL_FIXED_POINT  # noqa: E402


def uniform(width: int, frac: int) -> list[tuple[str, dict]]:
    cfg = {"name": "integer", **{f"{r}_{k}": v for r in ("data_in", "weight", "bias")
                                 for k, v in (("width", width), ("frac_width", frac))}}
    config = {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": cfg}}
    return [("quantize_transform_pass", config)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--run-dir", default="out/search-mixed-precision")
    p.add_argument("--sampler", default="nsga2")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    task = imdb_task(args.train_size, args.eval_size)
    base = finetuned_minilm(run, task)
    fp32 = task.accuracy(base)
    print(f"fp32 accuracy on {args.eval_size} held-out reviews: {fp32:.3f}")
    print("uniform configurations (the tutorial's hand-picked choice):")
    for width, frac in ((8, 4), (6, 3), (4, 2)):
        g, _ = Pipeline(uniform(width, frac), name=f"uniform integer {width}/{frac}", verify=False)(base)
        print(f"  integer {width}/{frac} everywhere: accuracy {task.accuracy(g):.3f}, "
              f"avg weight bits {avg_weight_bits(g):.2f}")
    space = MixedPrecisionSpace({"integer": TUTORIAL_FIXED_POINT}, roles=("data_in", "weight"), per="layer")
    result = Search(space, ["accuracy", "avg_weight_bits"], base=base, task=task, n_trials=args.trials,
                    sampler=args.sampler, constraints=[Constraint("accuracy", max_drop=0.01)], run_dir=run,
                    study_name="mixed-precision", resume=args.resume).run()
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
