"""rotate_hadamard_transform_pass: QuaRot-style Hadamard rotations fused into weights, outputs unchanged.

Three ways, chosen by ``mode`` (``auto``: the first that fits the graph):

* ``rmsnorm`` — HF Llama / Qwen2 / Mistral-style decoders (modules named ``layers.N.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``embed_tokens``, ``norm``,
  ``lm_head``): every RMSNorm scale folded into the linears reading it and set to 1, then the residual stream
  carried rotated (embedding E·Q, readers W·Q, writers o_proj / down_proj Qᵀ·W, bias Qᵀ·b; tied heads untied).
* ``layernorm`` — pre-LN models (GPT-2 style, the zoo GPT), found from the graph: the stream made mean-free,
  LayerNorms folded and replaced by unscaled ``nn.RMSNorm``, then rotated the same way (rotate_layernorm.py).
* ``online`` — any model (post-LN BERT / MiniLM): each selected linear's weight becomes W·H and x·H is computed
  on its input at run time by an inserted :class:`HadamardRotation` (rotate_online.py).

Each computes the same function (exact in fp32 up to rounding) with weights whose outlier channels are spread,
so they quantize better (gptq_transform_pass after it). Q is a Hadamard matrix (Sylvester ⊗ Paley) when one of
the hidden size exists, otherwise a seeded random orthogonal matrix; online rotations are block-diagonal
Hadamards when the width has no full one. Not done: the per-head rotations of full QuaRot. In ``auto`` mode a
graph fitting neither fused mode (e.g. BERT) is left as it is with the reason in ``info.unsupported``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import PassError, forge_pass
from ..contract import NumericalContract, PassInfo
from ..select import Selector, parse_selector_fields
from .hadamard import HadamardRotation, hadamard, rotation_matrix
from .rotate_layernorm import find_pre_ln_stream, rotate_pre_ln
from .rotate_online import rotate_online

_log = logging.getLogger(__name__)

__all__ = ["rotate_hadamard_transform_pass", "RotateArgs", "RotateInfo", "HadamardRotation", "hadamard",
           "rotation_matrix"]

_NORM_READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
MODES = ("auto", "rmsnorm", "layernorm", "online")
ONLINE_TARGETS = Selector.parse({"type": "linear"})


@dataclass(frozen=True)
class RotateArgs:
    """mode: ``auto`` | ``rmsnorm`` | ``layernorm`` | ``online`` (module docstring); seed: of the random orthogonal
    matrix used when the hidden size has no Hadamard matrix; targets / exclude: selectors of the linears whose
    inputs are rotated online: in ``online`` mode (default every nn.Linear; ``targets`` with mode ``auto`` means
    ``online``), and after a fused mode (as QuaRot rotates down_proj's input: ``{'mode': 'layernorm', 'targets':
    {'regex': '.*mlp.c_proj'}}``)."""

    mode: str = "auto"
    seed: int = 0
    targets: Any = None
    exclude: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        parse_selector_fields(self)


@dataclass(frozen=True)
class RotateInfo(PassInfo):
    """mode: the mode that ran (``rmsnorm`` | ``layernorm`` | ``online``, ``+online`` when a fused mode had targets too;
    empty when the graph was left as it is);
    rotated: layers whose weights were rotated; hidden: residual width (fused modes); rotation: ``hadamard`` or
    ``random_orthogonal``; blocks: decoder blocks rotated (rmsnorm); folded_norms: norms whose scale (and shift)
    were folded into the following linears; replaced_norms: LayerNorms replaced by unscaled RMSNorm (layernorm);
    inserted: HadamardRotation modules inserted (online); skipped: selected layers left as they are, with the
    reason (online); untied: a weight tied to another module was untied; unsupported: why the graph was left."""

    mode: str = ""
    rotated: list[str] = field(default_factory=list)
    hidden: int = 0
    rotation: str = ""
    blocks: int = 0
    folded_norms: list[str] = field(default_factory=list)
    replaced_norms: list[str] = field(default_factory=list)
    inserted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    untied: bool = False
    unsupported: str = ""


def _find(root: nn.Module, suffix: str) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in root.named_modules() if p == suffix or p.endswith("." + suffix)]


def _linear(root: nn.Module, path: str) -> nn.Linear:
    """The nn.Linear at ``path``; ValueError naming it when the block holds something else there."""
    module = root.get_submodule(path)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"rotate_hadamard_transform_pass: {path!r} is a {type(module).__name__}, not an nn.Linear; "
                         "rotate the float model before quantizing, pruning or adding LoRA to it")
    return module


@torch.no_grad()
def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight.copy_(weight.to(linear.weight.dtype))
    if bias is not None and linear.bias is not None:
        linear.bias.copy_(bias.to(linear.bias.dtype))


def _llama_blocks(root: nn.Module) -> tuple[list[str], str | None]:
    """(the decoder blocks of a Llama/Qwen-style model, None) or ([], why the model is not one)."""
    for path, module in root.named_modules():
        if isinstance(module, nn.LayerNorm):
            return [], f"{path!r} is a LayerNorm, not an RMSNorm"
    blocks = sorted({p.rsplit(".self_attn", 1)[0] for p, _ in _find(root, "self_attn.q_proj")},
                    key=lambda p: int(re.findall(r"\d+", p)[-1]))
    if len(_find(root, "embed_tokens")) != 1 or not blocks:
        return [], ("no Llama/Qwen-style decoder (one 'embed_tokens' and blocks 'layers.N' with self_attn.q_proj, "
                    "...)")
    return blocks, None


def _rotate_rmsnorm(root: nn.Module, blocks: list[str], seed: int) -> RotateInfo:
    """Fold RMSNorm scales into the next linears and rotate the residual stream of a Llama-style decoder."""
    (embed_path, embed), = _find(root, "embed_tokens")
    assert isinstance(embed, nn.Embedding)
    heads = _find(root, "lm_head")
    hidden = embed.weight.shape[1]
    q, kind = rotation_matrix(hidden, seed)
    folded: list[str] = []
    rotated: list[str] = [embed_path]

    def fold(norm_path: str, readers: list[nn.Linear]) -> None:
        scale = root.get_parameter(f"{norm_path}.weight")
        for lin in readers:
            _set(lin, lin.weight.detach().double() * scale.detach().double().unsqueeze(0))
        with torch.no_grad():
            scale.fill_(1.0)
        folded.append(norm_path)

    untied = False
    for p, _ in heads:
        head = _linear(root, p)
        if head.weight is embed.weight:  # tied: the head's folded/rotated weight is no longer the embedding's
            head.weight = nn.Parameter(head.weight.detach().clone())
            untied = True
    for block in blocks:
        for norm, readers in _NORM_READERS.items():
            fold(f"{block}.{norm}", [_linear(root, f"{block}.{r}") for r in readers])
    fold(embed_path.rsplit("embed_tokens", 1)[0] + "norm", [_linear(root, p) for p, _ in heads])

    with torch.no_grad():
        embed.weight.copy_((embed.weight.double() @ q).to(embed.weight.dtype))
    for block in blocks:
        for r in (*_NORM_READERS["input_layernorm"], *_NORM_READERS["post_attention_layernorm"]):
            lin = _linear(root, f"{block}.{r}")
            _set(lin, lin.weight.detach().double() @ q)
            rotated.append(f"{block}.{r}")
        for w in _WRITERS:
            lin = _linear(root, f"{block}.{w}")
            b = lin.bias.detach().double() @ q if lin.bias is not None else None
            _set(lin, q.T @ lin.weight.detach().double(), b)
            rotated.append(f"{block}.{w}")
    for p, _ in heads:
        head = _linear(root, p)
        _set(head, head.weight.detach().double() @ q)
        rotated.append(p)
    return RotateInfo(mode="rmsnorm", rotated=rotated, hidden=hidden, rotation=kind, blocks=len(blocks),
                      folded_norms=folded, untied=untied)


@forge_pass("transform", RotateArgs, info=RotateInfo, forbids=("quantized", "pipeline-stages", "lora", "pruned"),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5,
                                       note="norms folded, stream or linear inputs rotated: the same function"))
def rotate_hadamard_transform_pass(graph: ForgeGraph, args: RotateArgs) -> tuple[ForgeGraph, RotateInfo]:
    """Rotate by orthogonal Hadamard matrices fused into the weights (module docstring: the three modes)."""
    gm = graph.model
    mode = "online" if args.mode == "auto" and args.targets is not None else args.mode
    if mode == "online":
        return graph, _online(gm, args, RotateInfo(mode="online", rotation="hadamard"))
    reasons: list[str] = []
    fused: RotateInfo | None = None
    if mode in ("auto", "rmsnorm"):
        blocks, why = _llama_blocks(gm)
        if why is None:
            fused = _rotate_rmsnorm(gm, blocks, args.seed)
        else:
            reasons.append(f"rmsnorm: {why}")
    if fused is None and mode in ("auto", "layernorm"):
        stream = find_pre_ln_stream(gm)
        if not isinstance(stream, str):
            q, kind = rotation_matrix(stream.hidden, args.seed)
            rotated, replaced, untied = rotate_pre_ln(gm, stream, q)
            fused = RotateInfo(mode="layernorm", rotated=rotated, hidden=stream.hidden, rotation=kind,
                               folded_norms=replaced, replaced_norms=replaced, untied=untied)
        else:
            reasons.append(f"layernorm: {stream}")
    if fused is not None:
        return graph, fused if args.targets is None else _online(gm, args, fused)
    unsupported = "; ".join(reasons) + ". mode='online' rotates the inputs of any model's linears"
    if mode != "auto":
        raise PassError(f"rotate_hadamard_transform_pass: mode={mode!r} does not fit this graph: {unsupported}")
    _log.warning("rotate_hadamard_transform_pass: graph left as it is: %s", unsupported)
    return graph, RotateInfo(unsupported=unsupported, changed=False)


def _online(gm: nn.Module, args: RotateArgs, done: RotateInfo) -> RotateInfo:
    """Rotate the inputs of the selected linears online, after the fused rotation ``done`` (if any) ran."""
    assert isinstance(gm, torch.fx.GraphModule)
    targets = ONLINE_TARGETS if args.targets is None else args.targets
    rotated, inserted, skipped, untied = rotate_online(gm, targets, args.exclude)
    if not rotated:
        raise PassError(f"rotate_hadamard_transform_pass: online rotation selected no nn.Linear (targets {targets!r}, "
                        f"skipped {skipped}); select linears with 'targets'")
    mode = "online" if done.mode == "online" else f"{done.mode}+online"
    return dataclasses.replace(done, mode=mode, rotated=list(dict.fromkeys([*done.rotated, *rotated])),
                               inserted=inserted, skipped=skipped, untied=done.untied or untied)
