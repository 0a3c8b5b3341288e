"""`make demo`: fxforge's main job end to end, offline, in five steps (about 4 minutes on 2 CPU cores).

1. capture the MiniLM classifier into a ForgeGraph and annotate every node (metadata passes);
2. fine-tune it with LoRA on a slice of IMDb, then fuse the adapters back into plain Linear layers;
3. search FFN pruning x weight bits jointly: a handful of trials in a resumable study under --out;
4. export the best point as a pickle-free checkpoint, verify it, reload it and compare its outputs;
5. write the HTML report (graph, nodes, pass history, quantization, Pareto front).

A second run reuses the fine-tuned model and resumes the study (``--trials`` more adds trials);
``--fresh`` starts over. Exits non-zero when any check fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.examples.lora_finetune import HF_NAMES, LORA_ARGS  # noqa: E402
from fxforge.examples.story import Story  # noqa: E402
from fxforge.graph.verify import verify_checkpoint  # noqa: E402
from fxforge.models.bert import MINILM_NAME, minilm_for_sequence_classification  # noqa: E402
from fxforge.quiet import quiet  # noqa: E402
from fxforge.report import write_report  # noqa: E402
from fxforge.search import (  # noqa: E402 (imported before quiet(): optuna sets its log level on import)
    Constraint,
    JointSpace,
    MixedPrecisionSpace,
    PruningSpace,
    Search,
    SearchResult,
    TextClassificationTask,
)

FFN = {"regex": [r".*intermediate\.dense"]}  # the 6 feed-forward expansions: pruned by whole units
MAX_DROP = 0.02  # a search point may lose at most 2 accuracy points against the fine-tuned model


def logits(mg: ForgeGraph, batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return mg.eval()(**batch[0], labels=batch[1]).logits


def capture(story: Story, task: TextClassificationTask) -> ForgeGraph:
    story.step("Capture the MiniLM classifier into a ForgeGraph")
    model = minilm_for_sequence_classification(num_labels=2, seed=0).eval()
    t0 = time.perf_counter()
    mg = ForgeGraph(model, hf_input_names=HF_NAMES)
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, meta = passes.add_common_metadata_analysis_pass(mg)
    _, ops = passes.count_op_analysis_pass(mg, {"ops": ["embedding", "linear", "layer_norm"]})
    story.say(f"{MINILM_NAME} (pretrained) + a fresh 2-way head: {sum(p.numel() for p in model.parameters()):,} "
              f"parameters")
    story.say(f"captured with {mg.frontend} in {time.perf_counter() - t0:.1f}s: {meta.nodes} nodes annotated "
              f"(shape, dtype, precision); ops {dict(ops.counts)}")
    batch = task.eval_batches()[0]
    with torch.no_grad():
        eager = model(**batch[0], labels=batch[1]).logits
    diff = (eager - logits(mg, batch)).abs().max().item()
    story.check(diff <= 1e-5, f"graph computes what the model computes: max |eager - graph| = {diff:.1e}")
    return mg


def finetune(story: Story, mg: ForgeGraph, task: TextClassificationTask, out: Path) -> ForgeGraph:
    story.step("Fine-tune with LoRA on IMDb, then fuse the adapters")
    ckpt = out / "minilm-lora"
    if (ckpt / "manifest.json").exists():
        mg = ForgeGraph.from_checkpoint(ckpt).eval()
        story.say(f"reusing the fine-tuned model saved by an earlier run: {ckpt} (--fresh trains again)")
        story.say(f"held-out accuracy {task.accuracy(mg):.3f}")
        return mg
    before = task.accuracy(mg)
    mg, info = passes.insert_lora_adapter_transform_pass(mg, LORA_ARGS)
    story.say(f"rank-{LORA_ARGS['rank']} adapters on {len(info.adapted)} Linear layers + the head: "
              f"{info.trainable:,} of {info.total:,} parameters train ({info.trainable_percent:.2f}%)")
    t0 = time.perf_counter()
    task.train(mg, None)
    after = task.accuracy(mg)
    n_train, n_eval = len(task.data["train"]), len(task.data["test"])
    story.say(f"trained on {n_train} reviews in {time.perf_counter() - t0:.0f}s: held-out accuracy "
              f"{before:.3f} -> {after:.3f} ({n_eval} reviews)")
    batch = task.eval_batches()[0]
    unfused = logits(mg, batch)
    mg, _ = passes.fuse_lora_weights_transform_pass(mg)
    diff = (logits(mg, batch) - unfused).abs().max().item()
    story.check(after > before, "fine-tuning improved held-out accuracy")
    story.check(diff <= 1e-4, f"fusing keeps the outputs: max |fused - unfused| = {diff:.1e}")
    mg.eval().export(ckpt)
    return mg


def search(story: Story, base: ForgeGraph, task: TextClassificationTask, out: Path, trials: int) -> SearchResult:
    story.step(f"Search FFN pruning x weight bits ({trials} trials, study {out / 'search'})")
    space = JointSpace(PruningSpace([0.0, 0.25, 0.5], groups={"ffn": FFN}, granularity="ffn", shrink=True),
                       MixedPrecisionSpace({"mxint": {"width": [3, 4, 6, 8]}}, roles=("weight",)))
    runner = Search(space, ["accuracy", "weight_bits"], base=base, task=task, n_trials=trials,
                    sampler="grid", constraints=[Constraint("accuracy", max_drop=MAX_DROP)],
                    run_dir=out / "search", study_name="demo", resume=True)
    result = runner.run()
    front = {r["trial"] for r in result.rows()}
    story.say(f"{'trial':>5}  {'FFN pruned':>10}  {'weights':>9}  {'accuracy':>8}  {'MB':>6}")
    base_mb = result.baseline["weight_bits"] / 8e6
    story.say(f"{'base':>5}  {'0%':>10}  {'fp32':>9}  {result.baseline['accuracy']:>8.3f}  {base_mb:>6.1f}")
    for r in result.rows(result.completed()):
        p = r["params"]
        mark = " <- Pareto front" + ("" if r["feasible"] else " (too inaccurate)") if r["trial"] in front else ""
        story.say(f"{r['trial']:>5}  {p['sparsity:ffn']:>10.0%}  {'mxint' + str(p['linear:mxint:weight_width']):>9}  "
                  f"{r['accuracy']:>8.3f}  {r['weight_bits'] / 8e6:>6.1f}{mark}")
    story.check(bool(front), f"{len(result.completed())} trials finished, {len(front)} on the Pareto front")
    return result


def export_best(story: Story, result: SearchResult, task: TextClassificationTask, out: Path) -> ForgeGraph | None:
    story.step("Export the smallest point within the accuracy budget; verify, reload, compare")
    best = min(result.front(), key=lambda t: t.values[1])
    row = result.rows([best])[0]
    story.say(f"trial {best.number}: accuracy {best.values[0]:.3f}, {best.values[1] / 8e6:.1f} MB "
              f"({'within' if row['feasible'] else 'OUTSIDE'} the {MAX_DROP:.0%} accuracy budget)")
    rebuilt = result.rebuild(best).eval()
    path = rebuilt.export(out / "best")
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    verdict, reloaded = verify_checkpoint(path)
    story.say(f"exported {path} ({size:.1f} MB on disk: fp32 tensors, mxint is simulated); `fxforge verify` says:")
    story.say(verdict.text())
    story.check(verdict.ok and reloaded is not None, "checkpoint verified (manifest, allowlist, reload, outputs)")
    if reloaded is None:
        return None
    batch = task.eval_batches()[0]
    diff = (logits(reloaded, batch) - logits(rebuilt, batch)).abs().max().item()
    acc = task.accuracy(reloaded)
    story.check(diff <= 1e-5 and acc == best.values[0],
                f"reloaded = rebuilt: max |diff| = {diff:.1e}, accuracy {acc:.3f} (search measured "
                f"{best.values[0]:.3f})")
    return reloaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fxforge-demo", help="where the model, study, checkpoint and report go")
    parser.add_argument("--trials", type=int, default=6, help="search trials in the study (a rerun resumes)")
    parser.add_argument("--train", type=int, default=640, help="IMDb reviews to fine-tune on")
    parser.add_argument("--max-length", type=int, default=64, help="tokens kept per review")
    parser.add_argument("--eval", type=int, default=200, help="held-out IMDb reviews to measure accuracy on")
    parser.add_argument("--fresh", action="store_true", help="delete --out first (train and search again)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    story = Story(5)
    print(f"fxforge demo: capture -> LoRA fine-tune -> search -> export -> report; outputs in {out.resolve()}")
    with quiet():
        task = TextClassificationTask("imdb", train_size=args.train, eval_size=args.eval, max_length=args.max_length,
                                      train_args={"learning_rate": 2e-3, "per_device_train_batch_size": 16,
                                                  "training_args": {"warmup_steps": 0.1, "eval_strategy": "no"}})
        mg = finetune(story, capture(story, task), task, out)
        result = search(story, mg, task, out, args.trials)
        best = export_best(story, result, task, out)
        story.step("Write the HTML report")
        if best is not None:
            results = json.loads(result.to_json(out / "search.json").read_text())
            report = write_report(best, out / "report.html", title="fxforge demo: MiniLM, LoRA + search",
                                  search_results=results)
            story.say(f"{report.resolve()} ({report.stat().st_size / 1e3:.0f} kB): open it in a browser")
            story.say(f"graph drawing, {sum(1 for _ in best.nodes)} sortable node rows, pass history, "
                      "quantization table, Pareto plot")
            story.say(f"the same from the command line: fxforge report {out / 'best'} --search {out / 'search.json'} "
                      f"-o report.html")
    return story.end()


if __name__ == "__main__":
    raise SystemExit(main())
