"""Each example's main() end to end with tiny settings (seconds, not the minutes of the real run): what it
writes exists and reloads, and the numbers it reports are the ones its outputs hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from fxforge import ForgeGraph


def test_search_nas_example_builds_trains_and_exports_the_best_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The NAS example (it was refused at start: num_labels in base): a trial of a tiny BERT, the best one
    exported as a checkpoint that reloads with the sampled sizes and the 2-way head the base asked for."""
    from fxforge.examples.search_nas import main

    run = tmp_path / "nas"
    assert main(["--trials", "1", "--train-size", "32", "--eval-size", "16", "--max-length", "16", "--epochs", "1",
                 "--report-every", "1", "--sizes", "16", "--ffn-sizes", "32", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"best configuration (\{.*\}): accuracy ([0-9.]+)", out)
    assert found, out
    params = ast.literal_eval(found.group(1))
    best = ForgeGraph.from_checkpoint(next((run / "best").iterdir()))
    names = dict(best.model.named_modules())
    assert names["bert.embeddings.word_embeddings"].embedding_dim == 16
    assert names["bert.encoder.layer.0.intermediate.dense"].out_features == 32
    layers = {n.split(".")[3] for n in names if n.startswith("bert.encoder.layer.") and n.count(".") > 3}
    assert len(layers) == params["num_hidden_layers"]
    assert names["bert.encoder.layer.0.attention.self.query"].out_features == 16
    assert names["classifier"].out_features == 2
    count = re.search(r"best architecture: ([0-9,]+) parameters, accuracy ([0-9.]+) .* bert-tiny .* at 0\.860", out)
    assert count and int(count.group(1).replace(",", "")) == sum(p.numel() for p in best.model.parameters())
    assert count.group(2) == found.group(2)
    assert any(p.suffix == ".html" for p in (run / "plots").iterdir())


def test_search_nas_example_trials_inherit_the_donor_given_by_init_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--init-from: the trial's model starts from the donor's weights (at learning rate 0 the exported best
    still holds them: the leading slice of the donor's block 0 query)."""
    from transformers import BertConfig, BertModel

    from fxforge.examples.search_nas import main

    torch.manual_seed(0)
    donor = BertModel(BertConfig(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48))
    donor.save_pretrained(tmp_path / "donor", safe_serialization=True)
    run = tmp_path / "nas"
    assert main(["--trials", "1", "--train-size", "32", "--eval-size", "16", "--max-length", "16", "--epochs", "1",
                 "--report-every", "1", "--sizes", "16", "--ffn-sizes", "32", "--run-dir", str(run), "--lr", "0",
                 "--init-from", str(tmp_path / "donor")]) == 0
    assert "best configuration" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a warmup fraction outside [0, 1) is refused before any study is created
        main(["--warmup", "1.5", "--run-dir", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    best = ForgeGraph.from_checkpoint(next((run / "best").iterdir()))
    query = dict(best.model.named_parameters())["bert.encoder.layer.0.attention.self.query.weight"]
    assert torch.equal(query, donor.encoder.layer[0].attention.self.query.weight.detach()[:16, :16])
    ids = torch.randint(0, 30522, (2, 16))
    with torch.no_grad():
        assert best(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(2, dtype=torch.long)
                    ).logits.shape == (2, 2)


def test_pipeline_minilm_example_exports_a_checkpoint_its_history_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The TOML pipeline example on two 16-token reviews: the int8 checkpoint it exports reloads, records the
    pipeline's passes, and replaying that history on the fp32 graph gives the checkpoint's outputs."""
    from fxforge.examples.pipeline_minilm import main

    out = tmp_path / "int8.ckpt"
    assert main(["--batch", "2", "--length", "16", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    reloaded = ForgeGraph.from_checkpoint(out)
    names = [r.name for r in reloaded.history]
    assert "quantize_transform_pass" in names and f"history {names}" in text
    diff = float(re.search(r"max abs diff vs checkpoint ([0-9.e+-]+)", text).group(1))
    assert diff <= 1e-6
    assert 0 < float(re.search(r"fp32 vs int8 logits on the batch: max abs diff ([0-9.e+-]+)", text).group(1)) < 1


def test_train_agru_example_learns_digits_in_one_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.examples.train_agru import main

    main(["--epochs", "1", "--hidden_size", "32", "--num_layers", "1"])
    text = capsys.readouterr().out
    first = float(re.search(r"^epoch +1 +train loss [0-9.]+ +test acc ([0-9.]+)", text, re.M).group(1))
    final = float(re.search(r"final digits test accuracy: ([0-9.]+) on 450 held-out", text).group(1))
    assert final == first > 0.3  # one epoch: the final accuracy is epoch 1's; chance is 0.1


def test_lora_finetune_example_variants_and_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Both variants of the LoRA example (main() runs each in its own process; here in this one) on 16
    reviews: LoRA trains under 2 % of the parameters, its fused graph scores what the unfused one did, the
    saved adapters are a small fraction of the model, and the report prints every ratio."""
    from fxforge.examples.lora_finetune import report, run_variant

    cfg = {"train": 16, "test": 16, "max_length": 16, "epochs": 1.0, "batch": 16, "lr_full": 1e-4,
           "lr_lora": 1e-3, "repeats": 3}
    full, lora = run_variant("full", cfg), run_variant("lora", cfg)
    assert full["steps"] == lora["steps"] == 1
    assert lora["trainable_percent"] < 2.0 and full["trainable"] == full["total"] > 50 * lora["trainable"]
    assert lora["fused_accuracy"] == lora["accuracy"]
    assert 0 < lora["adapter_kib"] * 1024 < 0.02 * 4 * full["total"]
    report(full, lora, cfg)
    text = capsys.readouterr().out
    assert len(re.findall(r"^RATIO ", text, re.M)) == 4 and re.search(r"^TARGETS (MET|MISSED)$", text, re.M)


def test_prune_minilm_example_prints_its_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pruning table (MASE tutorial 4) on 16 reviews: the element-wise row prunes half the weights and its
    masked weights stay zero through the fine-tune; the structured row's shrunk model is smaller."""
    from fxforge.examples.prune_minilm import main

    main(["--train", "16", "--ft-train", "16", "--test", "16", "--length", "16", "--epochs", "1",
          "--rows", "elementwise,structured", "--cache-dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert (tmp_path / "minilm-imdb-16-16" / "config.json").is_file()  # the fine-tuned base, cached
    element = re.search(r"element-wise \(sparsity ([0-9.]+)\) +([0-9.]+) +([0-9.]+) +([0-9.]+) +ft .*"
                        r"masked weights still zero: (\w+)", text)
    assert element, text
    assert abs(float(element.group(1)) - 0.5) < 0.01 and element.group(5) == "True"
    structured = re.search(r"shrunk \(([0-9.]+)x params\)", text)
    assert structured and 0.5 < float(structured.group(1)) < 0.95


def test_search_joint_example_searches_exports_and_remeasures(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The joint search example on 16 reviews of 16 tokens: its two hand-picked points run as trials, the CSV
    and JSON of the front are written, and the exported trial reloads with the search's accuracy."""
    import json

    from fxforge.examples.search_joint import main

    run = tmp_path / "joint"
    assert main(["--trials", "2", "--train-size", "16", "--eval-size", "16", "--max-length", "16",
                 "--run-dir", str(run), "--export-trials", "0"]) == 0
    text = capsys.readouterr().out
    trials = json.loads((run / "pareto.json").read_text())["trials"]
    assert [t["trial"] for t in trials] == [0, 1] and (run / "pareto.csv").is_file()
    assert trials[1]["weight_bits"] < trials[0]["weight_bits"]  # MXINT4 weights vs MXINT8
    assert (run / "pareto" / "trial_0" / "manifest.json").is_file()
    found = re.search(r"trial_0: accuracy ([0-9.]+) \(search: ([0-9.]+);", text)
    assert found and found.group(1) == found.group(2), text
