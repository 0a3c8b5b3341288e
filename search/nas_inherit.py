"""Weight inheritance for NAS trials: a sampled architecture starts from a pretrained donor's weights.

Trained from random initialisation for the few hundred steps a trial can afford on a CPU, every BERT of
tutorial 5's space stays at chance on IMDb (measured: 0.50 after 63 steps). Weight-sharing NAS (once-for-all,
HAT's SubTransformers) instead lets each candidate inherit the leading slice of a larger pretrained
network's tensors. Here, for each parameter or buffer of the new model:

* the donor tensor of the same name (after the model's ``base_model_prefix``, since the donor may be the bare
  encoder) gives its leading block ``[:n0, :n1, ...]`` where both shapes overlap; what lies beyond the donor's
  widths keeps the fresh initialisation;
* block ``i`` of an ``L``-block model inherits donor block ``floor(i * D / L)`` of its ``D``: a shallower model
  takes evenly spread donor blocks (2 of 6: blocks 0 and 3), a deeper one repeats neighbours;
* a tensor the donor does not have (a new classification head) stays fresh.

Measured on IMDb (MiniLM donor, 1000 reviews, 63 fine-tune steps, 300 held-out reviews): a 4-layer model at
MiniLM's residual width 384 reaches 0.773; models whose residual width is sliced (128 or 256 of 384) stay at
chance (0.497) at learning rates 5e-5 to 1e-3 and 250 steps, and the 8-layer 512-wide one reaches 0.693 only at
5e-5. A pretrained network's residual channels are not ordered by importance the way once-for-all's progressively
shrunk supernet is, so inheritance transfers depth, head and FFN changes, not a narrower residual stream.

The donor is read once per process from safetensors (``use_safetensors``: no pickle), by HF name or local
directory; ``"minilm"`` is the offline all-MiniLM-L6-v2 package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn as nn

from .errors import SearchError

__all__ = ["Donor", "InheritReport", "donor_block", "inherit_weights", "load_donor"]

# a numbered block inside a module list, by the list names HF decoders and encoders use
_BLOCK = re.compile(r"^(?P<head>(?:.*?\.)?(?:layer|layers|h|blocks|block))\.(?P<index>\d+)\.(?P<tail>.+)$")


@dataclass(frozen=True)
class Donor:
    """A pretrained network's tensors by name and its number of blocks."""

    source: str
    tensors: Mapping[str, torch.Tensor]
    depth: int


@dataclass
class InheritReport:
    """What a model inherited: tensors copied whole, in part (a leading slice), and left fresh."""

    whole: list[str] = field(default_factory=list)
    sliced: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)


def donor_block(index: int, depth: int, donor_depth: int) -> int:
    """The donor block that block ``index`` of a ``depth``-block model inherits (evenly spread)."""
    return min(donor_depth - 1, index * donor_depth // depth)


@lru_cache(maxsize=2)
def load_donor(source: str) -> Donor:
    """The donor ``source`` (HF model name or local directory; ``"minilm"`` for the offline MiniLM) as CPU
    tensors; SearchError when it cannot be read."""
    if not isinstance(source, str) or not source.strip():
        raise SearchError(f"nas init_from: {source!r} is not a model name or directory")
    from ..models.bert import _MINILM_ALIASES, minilm_path
    from ..quiet import quiet

    path = str(minilm_path()) if source.lower() in _MINILM_ALIASES else source
    try:
        with quiet():
            from transformers import AutoModel

            model = AutoModel.from_pretrained(path, use_safetensors=True)
    except Exception as exc:  # whatever transformers raises for a missing, malformed or pickled checkpoint
        raise SearchError(f"nas init_from: cannot load {source!r} as a safetensors model "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    depth = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if depth < 1 or not any(_BLOCK.match(k) for k in tensors):
        raise SearchError(f"nas init_from: {source!r} has no numbered blocks to inherit from")
    return Donor(source, tensors, depth)


def inherit_weights(model: nn.Module, donor: Donor, depth: int) -> InheritReport:
    """Copy into ``model`` (``depth`` blocks) the overlapping leading slice of each donor tensor, in place."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    report = InheritReport()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            source = _donor_name(name, prefix, donor, depth)
            theirs = donor.tensors.get(source) if source is not None else None
            if theirs is None or theirs.dim() != tensor.dim() or theirs.dtype.is_floating_point \
                    != tensor.dtype.is_floating_point:
                report.fresh.append(name)
                continue
            region = tuple(slice(0, min(a, b)) for a, b in zip(tensor.shape, theirs.shape))
            tensor[region] = theirs[region].to(tensor.dtype)
            (report.whole if tuple(tensor.shape) == tuple(theirs.shape) else report.sliced).append(name)
    return report


def _donor_name(name: str, prefix: str, donor: Donor, depth: int) -> str | None:
    """The donor's name for the model's tensor ``name`` (the base-model prefix dropped when the donor has
    none, the block index mapped by :func:`donor_block`), or None."""
    candidates = [name]
    if prefix and name.startswith(prefix + "."):
        candidates.append(name[len(prefix) + 1:])
    for candidate in candidates:
        m = _BLOCK.match(candidate)
        if m is not None:
            mapped = donor_block(int(m["index"]), max(depth, 1), donor.depth)
            candidate = f"{m['head']}.{mapped}.{m['tail']}"
        if candidate in donor.tensors:
            return candidate
    return None
