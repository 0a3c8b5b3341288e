"""Knowledge distillation through get_trainer: the loss it trains on, a frozen teacher, bad settings refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fxforge import ForgeGraph
from fxforge.data import get_tokenized_dataset, get_trainer
from fxforge.distill import DistillationModel, DistillConfig, distillation_loss
from fxforge.models.bert import tiny_bert

INPUTS = ["input_ids", "attention_mask", "labels"]


@pytest.fixture(scope="module")
def tiny_data() -> tuple[dict, object]:
    return get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=16, limit=8)


def _batch(seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 1000, (4, seq), generator=gen),
            "attention_mask": torch.ones(4, seq, dtype=torch.long), "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("seq", [9, 16])
def test_loss_mixes_labels_and_teacher(seq: int) -> None:
    torch.manual_seed(0)
    teacher, student = tiny_bert(vocab_size=1000).eval(), tiny_bert(vocab_size=1000, seed=1).eval()
    model = DistillationModel(student, teacher, DistillConfig(alpha=0.3, temperature=2.0)).train()
    student.eval()  # no dropout: the expected value below is deterministic
    batch = _batch(seq)
    got = model(**batch).loss
    with torch.no_grad():
        s, t = student(**batch), teacher(**batch)
    soft_t, log_s = F.softmax(t.logits / 2, -1), F.log_softmax(s.logits / 2, -1)
    kl = (soft_t * (soft_t.log() - log_s)).sum(-1).mean() * 4
    assert torch.allclose(got, 0.3 * s.loss + 0.7 * kl, atol=1e-6)
    assert distillation_loss(t.logits, t.logits, 2.0).abs() < 1e-6
    assert not any(k.startswith("_teacher") or k.startswith("teacher") for k in model.state_dict())
    assert torch.equal(model.eval()(**batch).logits, s.logits)  # eval: the student alone


def test_get_trainer_distills_from_a_frozen_graph_teacher(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    ds, tok = tiny_data
    teacher = ForgeGraph(tiny_bert(vocab_size=30522).eval(), hf_input_names=INPUTS).eval()
    student = ForgeGraph(tiny_bert(vocab_size=30522, seed=1).eval(), hf_input_names=INPUTS)
    t_before = copy.deepcopy(teacher.model.state_dict())
    s_before = student.model.classifier.weight.detach().clone()
    trainer = get_trainer(student, ds, tok, output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                          teacher=teacher, distill={"alpha": 0.5, "temperature": 3.0})
    assert trainer.model.teacher.graph_module is teacher.model and trainer.model.student.graph_module is student.model
    assert trainer.model.distill_config == DistillConfig(alpha=0.5, temperature=3.0)  # the settings reach the loss
    assert trainer.train().global_step == 2
    assert not torch.equal(s_before, student.model.classifier.weight)
    assert all(torch.equal(v, teacher.model.state_dict()[k]) for k, v in t_before.items())
    assert not teacher.model.training


def test_bad_distillation_settings(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    ds, tok = tiny_data
    model = tiny_bert(vocab_size=30522)
    with pytest.raises(ValueError, match="distill settings given without a teacher"):
        get_trainer(model, ds, tok, output_dir=str(tmp_path), distill={"alpha": 0.5})
    with pytest.raises(ValueError, match=r"unknown distill key\(s\) \['temp'\]; allowed"):
        get_trainer(model, ds, tok, output_dir=str(tmp_path), teacher=tiny_bert(vocab_size=30522), distill={"temp": 2})
    with pytest.raises(ValueError, match="alpha must be in"):
        DistillConfig(alpha=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        DistillConfig(temperature=0)
