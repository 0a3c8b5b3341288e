"""rotate_hadamard_transform_pass: QuaRot-style rotation of a Llama/Qwen residual stream, fused into weights.

First every RMSNorm scale is folded into the linears that read the normed value (input_layernorm into
q/k/v, post_attention_layernorm into gate/up, the final norm into the LM head) and set to 1. RMSNorm
without a scale commutes with any orthogonal Q (‖xQ‖ = ‖x‖), so the residual stream can then be carried
rotated: the embedding table becomes E·Q, every linear reading the stream W·Q, every linear writing it
(o_proj, down_proj) Qᵀ·W (bias Qᵀ·b). The model computes the same function (exact in fp32 up to rounding),
but its weights and activations lose their outlier channels, so they quantize better (GPTQ after it).

Q is the normalised Sylvester Hadamard matrix when the hidden size is a power of two, otherwise a seeded
random orthogonal matrix. Supported: HF Llama / Qwen2 / Mistral-style decoders (modules named
``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
``embed_tokens``, ``norm``, ``lm_head``), tied embeddings untied. Not supported: the per-head (online)
rotations of full QuaRot; LayerNorm models (GPT-2, the zoo GPT, BERT) are left unchanged with the reason in
``info.unsupported`` (as conv_bn_fusion leaves a graph without BatchNorm): LayerNorm subtracts the mean, which
does not commute with a rotation unless the stream is made mean-free and LayerNorm replaced by RMSNorm (not done).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo

_log = logging.getLogger(__name__)

__all__ = ["rotate_hadamard_transform_pass", "RotateArgs", "RotateInfo", "hadamard", "rotation_matrix"]

_NORM_READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class RotateArgs:
    """seed: of the random orthogonal matrix used when the hidden size is not a power of two."""

    seed: int = 0


@dataclass(frozen=True)
class RotateInfo(PassInfo):
    """hidden: residual width; rotation: ``hadamard`` or ``random_orthogonal``; blocks: decoder blocks rotated;
    folded_norms: RMSNorm scales folded into the following linears; untied: LM head untied from the embedding;
    unsupported: why the graph was left as it is (no RMSNorm decoder found: LayerNorm models, encoders)."""

    hidden: int = 0
    rotation: str = ""
    blocks: int = 0
    folded_norms: list[str] = field(default_factory=list)
    untied: bool = False
    unsupported: str = ""


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two), in float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard matrices exist for powers of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def rotation_matrix(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """(orthogonal Q of size ``n`` in float64, its kind): Hadamard for powers of two, else seeded random."""
    if n & (n - 1) == 0:
        return hadamard(n), "hadamard"
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0), "random_orthogonal"


def _find(root: nn.Module, suffix: str) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in root.named_modules() if p == suffix or p.endswith("." + suffix)]


def _layer_norm(root: nn.Module) -> str | None:
    """Why a model with LayerNorm is left unrotated (None when it has none)."""
    for path, module in root.named_modules():
        if isinstance(module, nn.LayerNorm):
            return (f"{path!r} is a LayerNorm, which subtracts the mean and does not commute with a rotation; only "
                    "RMSNorm (Llama/Qwen-style) decoders are rotated: quantize this model without rotation "
                    "(gptq_transform_pass alone)")
    return None


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


@forge_pass("transform", RotateArgs, info=RotateInfo, forbids=("quantized", "pipeline-stages"),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5,
                                       note="norm scales folded, residual stream rotated: the same function"))
def rotate_hadamard_transform_pass(graph: ForgeGraph, args: RotateArgs) -> tuple[ForgeGraph, RotateInfo]:
    """Fold RMSNorm scales into the next linears and rotate the residual stream by an orthogonal Q."""
    root = graph.model
    embeds = _find(root, "embed_tokens")
    blocks = sorted({p.rsplit(".self_attn", 1)[0] for p, _ in _find(root, "self_attn.q_proj")},
                    key=lambda p: int(re.findall(r"\d+", p)[-1]))
    heads = _find(root, "lm_head")
    unsupported = _layer_norm(root)
    if unsupported is None and (len(embeds) != 1 or not blocks):
        unsupported = ("no Llama/Qwen-style decoder (one 'embed_tokens' and blocks 'layers.N' with "
                       "self_attn.q_proj, ...): the pass rotates HF Llama / Qwen2 / Mistral-style models only")
    if unsupported is not None:  # like conv_bn_fusion without a BatchNorm: nothing to do, said once
        _log.warning("rotate_hadamard_transform_pass: graph left as it is: %s", unsupported)
        return graph, RotateInfo(unsupported=unsupported, changed=False)
    embed = embeds[0][1]
    assert isinstance(embed, nn.Embedding)
    hidden = embed.weight.shape[1]
    q, kind = rotation_matrix(hidden, args.seed)
    folded: list[str] = []

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
    final_norm = embeds[0][0].rsplit("embed_tokens", 1)[0] + "norm"
    fold(final_norm, [_linear(root, p) for p, _ in heads])

    with torch.no_grad():
        embed.weight.copy_((embed.weight.double() @ q).to(embed.weight.dtype))
    for block in blocks:
        for r in (*_NORM_READERS["input_layernorm"], *_NORM_READERS["post_attention_layernorm"]):
            lin = _linear(root, f"{block}.{r}")
            _set(lin, lin.weight.detach().double() @ q)
        for w in _WRITERS:
            lin = _linear(root, f"{block}.{w}")
            b = lin.bias.detach().double() @ q if lin.bias is not None else None
            _set(lin, q.T @ lin.weight.detach().double(), b)
    for p, _ in heads:
        head = _linear(root, p)
        _set(head, head.weight.detach().double() @ q)
    return graph, RotateInfo(hidden=hidden, rotation=kind, blocks=len(blocks), folded_norms=folded, untied=untied)
