"""Knowledge distillation for fine-tuning: the student's loss mixes the labels' cross-entropy with the
KL divergence to a frozen teacher's softened logits (Hinton et al.), the usual way to recover a pruned or
quantized model from few labelled examples.

:class:`DistillationModel` wraps the student so any trainer (the HF Trainer of ``get_trainer``) trains it
unchanged: in training mode with labels it replaces the output's ``loss``; in eval mode it is the student.
The teacher is held outside the module tree, so its parameters are neither trained nor saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DistillConfig", "DistillationModel", "distillation_loss", "logits_of"]


@dataclass(frozen=True)
class DistillConfig:
    """``alpha``: weight of the labels' cross-entropy (1 - alpha on the teacher); ``temperature`` > 0."""

    alpha: float = 0.5
    temperature: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"distillation alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ValueError(f"distillation temperature must be > 0, got {self.temperature}")

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any] | None) -> DistillConfig:
        """Settings by name (a copy is read); an unknown key is an error naming the allowed ones."""
        settings = dict(settings or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            raise ValueError(f"unknown distill key(s) {unknown}; allowed: {allowed}")
        return cls(**settings)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (HF ModelOutput, dict, tuple or tensor); TypeError when there are none."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the temperature-softened distributions, scaled by T^2 (gradient size kept)."""
    t = float(temperature)
    return F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1), log_target=True,
                    reduction="batchmean") * t * t


class DistillationModel(nn.Module):
    """The student, trained with ``alpha * CE(labels) + (1 - alpha) * T^2 * KL(teacher || student)``."""

    accepts_loss_kwargs = False

    def __init__(self, student: nn.Module, teacher: nn.Module, config: DistillConfig | None = None) -> None:
        super().__init__()
        self.student = student
        self._teacher = (teacher.eval(),)  # a tuple: not a submodule (not trained, not in the state dict)
        self.distill_config = config or DistillConfig()

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def forward(self, **inputs: Any) -> Any:
        out = self.student(**inputs)
        if not self.training or inputs.get("labels") is None:
            return out
        loss = out.get("loss") if isinstance(out, Mapping) else None  # HF ModelOutput is a Mapping
        if loss is None:
            raise TypeError("distillation needs a student that returns a loss when given labels")
        with torch.no_grad():
            teacher_logits = logits_of(self.teacher(**inputs)).detach()
        kd = distillation_loss(logits_of(out), teacher_logits, self.distill_config.temperature)
        out["loss"] = self.distill_config.alpha * loss + (1.0 - self.distill_config.alpha) * kd
        return out
