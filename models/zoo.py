"""Named zoo models ready to capture: what ``fxforge inspect minilm`` (or ``gpt-afno``, ``agru``...) builds.

Each entry builds a model in eval mode plus the capture keywords ``ForgeGraph`` needs for it (HF input
names, or example inputs for the plain PyTorch models). Sizes are small so a capture takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ZOO", "ZooModel", "UnknownModelError", "build"]

HF_CLASSIFIER_INPUTS = ("input_ids", "attention_mask", "labels")


class UnknownModelError(KeyError):
    """A model name that is not in the zoo; the message lists the zoo names."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


@dataclass(frozen=True)
class ZooModel:
    """A built model and how to capture it: ``ForgeGraph(model, **capture)``."""

    name: str
    model: nn.Module
    capture: dict[str, Any] = field(default_factory=dict)
    description: str = ""


def _minilm() -> ZooModel:
    from .bert import minilm_for_sequence_classification

    torch.manual_seed(0)
    return ZooModel("minilm", minilm_for_sequence_classification().eval(),
                    {"hf_input_names": list(HF_CLASSIFIER_INPUTS)}, "pretrained MiniLM-L6 + 2-way head")


def _tiny_bert() -> ZooModel:
    from .bert import tiny_bert

    return ZooModel("tiny-bert", tiny_bert().eval(), {"hf_input_names": list(HF_CLASSIFIER_INPUTS)},
                    "random 2-layer BERT classifier (hidden 32)")


def _gpt(mixer: str) -> Callable[[], ZooModel]:
    def build_gpt() -> ZooModel:
        from .gpt import GPT, GPTConfig

        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, sequence_length=64, n_layer=2, n_head=4, n_embd=64, mixer=mixer)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.sequence_length), generator=torch.Generator().manual_seed(0))
        name = "gpt" if mixer == "attn" else f"gpt-{mixer}"
        return ZooModel(name, GPT(cfg).eval(), {"example_inputs": tokens}, f"2-layer GPT, {mixer} token mixer")
    return build_gpt


def _agru() -> ZooModel:
    from .agru import AGRUClassifier

    torch.manual_seed(0)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))
    return ZooModel("agru", AGRUClassifier(input_size=8, hidden_size=32, num_layers=1, num_classes=10).eval(),
                    {"example_inputs": x}, "antisymmetric GRU classifier over 8 rows of 8 pixels (8x8 digits)")


ZOO: dict[str, Callable[[], ZooModel]] = {
    "minilm": _minilm,
    "tiny-bert": _tiny_bert,
    "gpt": _gpt("attn"),
    "gpt-afno": _gpt("afno"),
    "agru": _agru,
}


def build(name: str) -> ZooModel:
    """The zoo model called ``name``; :class:`UnknownModelError` listing the names otherwise."""
    if name not in ZOO:
        raise UnknownModelError(f"unknown model {name!r}; zoo names: {', '.join(ZOO)}")
    return ZOO[name]()
