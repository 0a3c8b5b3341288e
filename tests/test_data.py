"""fxforge.data: the offline review split, tokenized datasets, and get_trainer on a model and a graph."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from fxforge.data import (
    cache_dir,
    get_tokenized_dataset,
    get_trainer,
    load_reviews,
    normalize_text,
)
from fxforge.models.bert import tiny_bert


@pytest.fixture(scope="module")
def imdb() -> dict[str, list]:
    return load_reviews("imdb")


def test_imdb_split_is_disjoint_deduplicated_and_fixed(imdb: dict[str, list]) -> None:
    train = {normalize_text(r.text) for r in imdb["train"]}
    test = {normalize_text(r.text) for r in imdb["test"]}
    assert not train & test
    assert len(train) == len(imdb["train"]) and len(test) == len(imdb["test"])  # no duplicates inside
    total = len(train) + len(test)
    assert 24_800 < total < 25_000  # 25k reviews minus exact duplicates
    assert 0.18 < len(test) / total < 0.22
    assert [r.digest for r in imdb["test"]] == sorted(r.digest for r in imdb["test"])
    assert all(int(r.digest, 16) % 5 == 0 for r in imdb["test"])
    assert all(int(r.digest, 16) % 5 != 0 for r in imdb["train"])
    first = [r.label for r in imdb["train"][:1000]]
    assert 400 < sum(first) < 600  # the hash order mixes labels, so prefixes are roughly balanced


def test_rotten_tomatoes_split_is_disjoint() -> None:
    rt = load_reviews("rotten_tomatoes")
    train = {normalize_text(r.text) for r in rt["train"]}
    test = {normalize_text(r.text) for r in rt["test"]}
    assert not train & test and 8_000 < len(train) + len(test) <= 8_530
    with pytest.raises(ValueError, match="unknown dataset"):
        load_reviews("sst2")


def test_normalize_text() -> None:
    assert normalize_text("  A  Great\n\tMOVIE ") == "a great movie"
    assert normalize_text("ﬁne") == "fine"  # NFKC


def test_get_tokenized_dataset_offline(capsys: pytest.CaptureFixture[str]) -> None:
    ds, tok = get_tokenized_dataset("imdb", checkpoint="bert-base-uncased", return_tokenizer=True,
                                    max_length=24, limit=10, test_limit=6)
    assert "falling back to the offline MiniLM tokenizer" in capsys.readouterr().out
    assert len(ds["train"]) == 10 and len(ds["test"]) == 6
    item = ds["train"][0]
    assert {"input_ids", "attention_mask", "labels"} <= set(item)
    assert len(item["input_ids"]) <= 24 and item["input_ids"][0] == tok.cls_token_id
    # the offline path keeps the corpus' order and labels: the first ten train reviews, labelled as in the corpus
    assert ds["train"]["labels"] == [r.label for r in load_reviews("imdb")["train"][:10]]
    assert isinstance(ds, datasets.DatasetDict) and isinstance(ds["test"], datasets.Dataset)
    assert ds["train"].column_names == ["labels", "input_ids", "token_type_ids", "attention_mask"]
    assert ds["train"].features["labels"].names == ["neg", "pos"]
    only = get_tokenized_dataset("rotten_tomatoes", checkpoint="minilm", limit=4)
    assert len(only["train"]) == len(only["test"]) == 4
    with pytest.raises(ValueError, match="limit"):
        get_tokenized_dataset("imdb", limit=0)
    with pytest.raises(ValueError, match="unknown dataset"):
        get_tokenized_dataset("mnist")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXFORGE_CACHE", str(tmp_path_factory.getbasetemp() / "fxforge-cache"))


@pytest.mark.slow  # 21 s: tokenizes the full 25k-review split
def test_full_imdb_split_as_datasets_is_cached_and_matches_the_reviews(imdb: dict[str, list]) -> None:
    ds, tok = get_tokenized_dataset("imdb", checkpoint="minilm", max_length=16, return_tokenizer=True)
    assert (len(ds["train"]), len(ds["test"])) == (19_797, 5_107)
    for split in ("train", "test"):
        assert ds[split]["labels"] == [r.label for r in imdb[split]]  # same deterministic order
        for i in (0, len(imdb[split]) - 1):
            assert ds[split][i]["input_ids"] == tok(imdb[split][i].text, truncation=True, max_length=16)["input_ids"]
    again = get_tokenized_dataset("imdb", checkpoint="minilm", max_length=16)
    files = [f["filename"] for f in again["train"].cache_files]
    assert files and all(Path(f).is_relative_to(cache_dir()) for f in files)  # memory-mapped from the Arrow cache
    assert again["test"]["labels"] == ds["test"]["labels"]


def test_out_of_vocabulary_tokenizer_fails_before_training(tmp_path: Path) -> None:
    ds, tok = get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=16, limit=8)
    small = tiny_bert(vocab_size=1000)
    with pytest.raises(ValueError, match=r"tokenizer has 30522 tokens.*embedding has only 1000 rows"):
        get_trainer(small, ds, tok, output_dir=str(tmp_path), max_steps=1)


def _check_accuracy(trainer: object, ds: dict) -> None:
    """eval_accuracy is the share of test labels the model's own predictions get right (the metric is
    wired to predictions and labels, not a constant in [0, 1])."""
    metrics = trainer.evaluate()  # type: ignore[attr-defined]
    pred = trainer.predict(ds["test"])  # type: ignore[attr-defined]
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    expected = float((np.asarray(logits).argmax(-1) == np.asarray(pred.label_ids)).mean())
    assert len(pred.label_ids) == len(ds["test"]) and "eval_loss" in metrics
    assert metrics["eval_accuracy"] == pytest.approx(expected)


@pytest.fixture(scope="module")
def tiny_data() -> tuple[dict, object]:
    return get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=16, limit=8)


def test_get_trainer_runs_a_step_on_tiny_bert(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    ds, tok = tiny_data
    model = tiny_bert()
    before = model.classifier.weight.detach().clone()
    trainer = get_trainer(model, ds, tok, output_dir=str(tmp_path), max_steps=1,
                          per_device_train_batch_size=4, use_cpu=True, report_to=[])
    out = trainer.train()
    assert out.global_step == 1
    assert not torch.equal(before, model.classifier.weight)
    _check_accuracy(trainer, ds)


def test_get_trainer_runs_a_step_on_an_exported_graph(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    ds, tok = tiny_data
    model = tiny_bert().eval()  # export bakes the mode in: train-mode dropout would make predictions random
    kwargs = {"input_ids": torch.randint(0, 1000, (4, 16)), "attention_mask": torch.ones(4, 16, dtype=torch.long),
              "labels": torch.zeros(4, dtype=torch.long)}
    gm = torch.export.export(model, (), kwargs).module()
    params = dict(gm.named_parameters())
    name = next(n for n in params if n.endswith("classifier.weight"))
    before = params[name].detach().clone()
    trainer = get_trainer(gm, ds, tok, output_dir=str(tmp_path), max_steps=1, report_to=[])
    assert trainer.args.per_device_train_batch_size == 4  # taken from the captured static shape
    assert trainer.train().global_step == 1
    assert not torch.equal(before, params[name])
    _check_accuracy(trainer, ds)
    with pytest.raises(ValueError, match="specialised to batch 4"):
        get_trainer(gm, ds, tok, output_dir=str(tmp_path), per_device_train_batch_size=8)


def test_get_trainer_trains_a_forge_graph(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    from fxforge import ForgeGraph

    ds, tok = tiny_data
    mg = ForgeGraph(tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    head = mg.model.get_submodule("classifier").weight
    before = head.detach().clone()
    trainer = get_trainer(mg, ds, tok, output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3,
                          report_to=[])
    assert trainer.args.dataloader_drop_last is False  # dynamic shapes: ragged batches are fine
    assert trainer.train().global_step == 2
    assert not torch.equal(before, head)
    _check_accuracy(trainer, ds)


def test_get_trainer_validates(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    ds, tok = tiny_data
    with pytest.raises(ValueError, match="evaluate_metric"):
        get_trainer(tiny_bert(), ds, tok, evaluate_metric="bleu", output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="test"):
        get_trainer(tiny_bert(), {"train": ds["train"]}, tok, output_dir=str(tmp_path))
    with pytest.raises(TypeError):
        get_trainer("model", ds, tok, output_dir=str(tmp_path))  # type: ignore[arg-type]
