"""NASSpace(init_from=...): each trial's model inherits a pretrained donor's weights, sliced and spread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel

from fxforge.search import NASSpace
from fxforge.search.errors import SearchError
from fxforge.search.nas_inherit import donor_block, inherit_weights, load_donor
from fxforge.search.space import SPACES

BASE = {"vocab_size": 120, "max_position_embeddings": 32, "num_labels": 2}
DONOR = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 64}


@pytest.fixture(scope="module")
def donor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small pretrained-like encoder saved as safetensors (the bare BertModel, as sentence encoders ship)."""
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=120, max_position_embeddings=64, **DONOR)).eval()
    path = tmp_path_factory.mktemp("donor")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _space(donor: Path | str, **choices: list[int]) -> NASSpace:
    return NASSpace("BertConfig", choices or {"num_hidden_layers": [1, 3, 5]}, base=BASE, init_from=str(donor))


@pytest.mark.parametrize("shape", [(2, 8), (3, 16)])
def test_the_donors_own_architecture_computes_the_donors_outputs(donor_dir: Path, shape: tuple[int, int]) -> None:
    donor = BertModel.from_pretrained(donor_dir).eval()
    model = _space(donor_dir).bind(None).build_model(DONOR, ())
    ids = torch.randint(0, 120, shape)
    mask = torch.ones(shape, dtype=torch.long)
    mask[0, shape[1] // 2:] = 0
    with torch.no_grad():
        want = donor(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(got, want, atol=1e-6)


def test_narrower_and_shallower_models_take_leading_slices_of_spread_blocks(donor_dir: Path) -> None:
    want = load_donor(str(donor_dir)).tensors
    model = _space(donor_dir).build_model({"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                                           "intermediate_size": 48}, ())
    # 2 blocks of a 3-block donor: blocks 0 and 1 (floor(i * 3 / 2))
    assert [donor_block(i, 2, 3) for i in range(2)] == [0, 1]
    for i in range(2):
        q = model.bert.encoder.layer[i].attention.self.query.weight
        assert torch.equal(q, want[f"encoder.layer.{donor_block(i, 2, 3)}.attention.self.query.weight"][:16, :16])
        up = model.bert.encoder.layer[i].intermediate.dense.weight
        assert torch.equal(up, want[f"encoder.layer.{donor_block(i, 2, 3)}.intermediate.dense.weight"][:48, :16])
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, want["embeddings.word_embeddings.weight"][:, :16])
    assert torch.equal(model.bert.embeddings.position_embeddings.weight,
                       want["embeddings.position_embeddings.weight"][:32, :16])


def test_wider_and_deeper_models_keep_fresh_weights_beyond_the_donor(donor_dir: Path) -> None:
    want = load_donor(str(donor_dir)).tensors
    model = _space(donor_dir).build_model({"hidden_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
                                           "intermediate_size": 64}, ())
    blocks = [donor_block(i, 5, 3) for i in range(5)]
    assert blocks == [0, 0, 1, 1, 2]
    for i, b in enumerate(blocks):
        q = model.bert.encoder.layer[i].attention.self.query.weight
        assert torch.equal(q[:32, :32], want[f"encoder.layer.{b}.attention.self.query.weight"])
        assert not torch.equal(q[32:, :32], torch.zeros(16, 32))  # beyond the donor: the fresh initialisation
    # what was copied whole, in part, or left fresh: the classification head is not in the (bare encoder) donor
    from transformers import BertForSequenceClassification

    config = BertConfig(**{**BASE, "hidden_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
                           "intermediate_size": 64})
    report = inherit_weights(BertForSequenceClassification(config), load_donor(str(donor_dir)), 5)
    assert {"classifier.weight", "classifier.bias"} <= set(report.fresh)
    assert "bert.encoder.layer.4.attention.self.query.weight" in report.sliced
    assert "bert.encoder.layer.4.attention.self.query.bias" in report.sliced
    # only tensors not touching the (wider) residual width come whole: the FFN biases, as wide as the donor's
    assert report.whole == [f"bert.encoder.layer.{i}.intermediate.dense.bias" for i in range(5)], report.whole


def test_a_pickled_or_missing_donor_is_refused_before_any_trial(tmp_path: Path) -> None:
    torch.save(BertModel(BertConfig(vocab_size=120, **DONOR)).state_dict(), tmp_path / "pytorch_model.bin")
    BertConfig(vocab_size=120, **DONOR).save_pretrained(tmp_path)
    with pytest.raises(SearchError, match="safetensors"):
        _space(tmp_path).bind(None)
    with pytest.raises(SearchError, match="cannot load"):
        _space(tmp_path / "missing").bind(None)
    with pytest.raises(SearchError, match="init_from"):
        NASSpace("BertConfig", {"num_hidden_layers": [1]}, base=BASE, init_from="  ")


def test_spec_round_trip_keeps_init_from_and_older_specs_are_unchanged(donor_dir: Path) -> None:
    spec = _space(donor_dir).to_spec()
    assert spec["init_from"] == str(donor_dir)
    again = SPACES["nas"]({k: v for k, v in spec.items() if k != "kind"})
    assert isinstance(again, NASSpace) and again.init_from == str(donor_dir)
    assert "init_from" not in NASSpace("BertConfig", {"num_hidden_layers": [1]}, base=BASE).to_spec()
