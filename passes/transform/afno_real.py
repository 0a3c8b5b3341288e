"""afno_real_arithmetic_transform_pass: complex multiplies between the FFTs become real tensor ops.

Inductor does not generate code for complex tensors, so ``torch.compile`` of the AFNO mixer falls back
to eager for ``rfft(x) * rfft(k)`` and fuses nothing around it; worse, autograd through ``rfft`` and
``irfft`` runs full-length complex FFTs and complex zero-fills / slice-scatters, all eager fallbacks.
This pass rewrites

* an FFT convolution ``irfft(rfft(a, n, d) * rfft(b, n, d), n, d)`` (AFNO's causal token mixing) into
  one call of :func:`fft_conv`: real-arithmetic spectral product, backward = circular correlation
  (one rfft and two irffts, no complex copies);
* every other complex x complex ``mul`` into real arithmetic on the stacked (real, imag) parts::

      ra, rb = view_as_real(a), view_as_real(b)
      out = view_as_complex(stack([ar*br - ai*bi, ar*bi + ai*br], -1))

so the only complex *computations* left are the FFTs (``view_as_real`` / ``view_as_complex`` are free
views). Contract: outputs within 1e-5 and gradients unchanged (same arithmetic, reassociated).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.metadata import get_meta, has_meta
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .fft_conv import fft_conv

# Ops with complex results that compute nothing (views, layout) or are the FFTs themselves.
COMPLEX_VIEWS: frozenset[str] = frozenset({
    "view_as_complex", "view_as_real", "reshape", "view", "transpose", "permute", "contiguous", "narrow",
    "slice", "getitem", "unsqueeze", "squeeze", "expand", "clone", "alias", "_unsafe_view", "placeholder",
    "get_attr", "output",
})


def is_complex(node: object) -> bool:
    """Whether a node's recorded result is a complex tensor."""
    if not isinstance(node, fx.Node) or not has_meta(node):
        return False
    value = get_meta(node).common.results.get("data_out_0")
    return value is not None and (value.dtype or "").startswith("complex")


def complex_compute_ops(gm: fx.GraphModule) -> list[str]:
    """Canonical ops of the nodes that compute on complex values (FFTs included), in graph order."""
    return [classify(n, gm)[1] for n in gm.graph.nodes
            if is_complex(n) and classify(n, gm)[1] not in COMPLEX_VIEWS]


@dataclass(frozen=True)
class AfnoRealInfo(PassInfo):
    """rewritten: complex multiplies turned real; fft_convs: of them, FFT convolutions fused into
    :func:`fft_conv`; complex_ops_before / after: what still computes on complex (graph level)."""

    rewritten: int = 0
    fft_convs: int = 0
    complex_ops_before: tuple[str, ...] = ()
    complex_ops_after: tuple[str, ...] = ()


def _real_mul(rw: GraphRewrite, node: fx.Node) -> fx.Node:
    a, b = node.args

    def call(fn: Callable[..., Any], *args: Any) -> fx.Node:
        return rw.call_function(fn, args, before=node)

    ra, rb = call(torch.view_as_real, a), call(torch.view_as_real, b)
    ar, ai = call(torch.select, ra, -1, 0), call(torch.select, ra, -1, 1)
    br, bi = call(torch.select, rb, -1, 0), call(torch.select, rb, -1, 1)
    re = call(operator.sub, call(operator.mul, ar, br), call(operator.mul, ai, bi))
    im = call(operator.add, call(operator.mul, ar, bi), call(operator.mul, ai, br))
    return call(torch.view_as_complex, call(torch.stack, [re, im], -1))


_FFT_PARAMS = ("input", "n", "dim", "norm")


def _fft_params(node: fx.Node, gm: fx.GraphModule, op: str) -> dict[str, object] | None:
    """``input, n, dim, norm`` of a ``torch.fft.<op>`` / ``aten.fft_<op>`` call (dim counted from the end)."""
    if node.op != "call_function" or classify(node, gm)[1] != op or len(node.args) > len(_FFT_PARAMS) \
            or not set(node.kwargs) <= set(_FFT_PARAMS):
        return None
    params: dict[str, object] = {"n": None, "dim": -1, "norm": None, **dict(zip(_FFT_PARAMS, node.args)),
                                 **node.kwargs}
    shape = get_meta(node).common.results["data_out_0"].shape if has_meta(node) else None
    dim = params["dim"]
    if not isinstance(dim, int) or shape is None or params["n"] is None or params["norm"] not in (None, "backward"):
        return None
    params["dim"] = dim - len(shape) if dim >= 0 else dim
    return params


def _fft_conv_pattern(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node] | None:
    """``[rfft_a, rfft_b, mul, irfft]`` (graph order) when ``node`` is the product of an FFT convolution
    whose spectra nothing else reads."""
    sources = [a for a in node.args if isinstance(a, fx.Node)]
    if len(sources) != len(node.args):
        return None
    users = list(node.users)
    inverse = _fft_params(users[0], gm, "fft_irfft") if len(users) == 1 else None
    if inverse is None or inverse["input"] is not node:
        return None
    for a in sources:
        s = _fft_params(a, gm, "fft_rfft")
        if s is None or len(a.users) != 1 or s["n"] != inverse["n"] or s["dim"] != inverse["dim"]:
            return None
    return sorted([*sources, node, users[0]], key=list(gm.graph.nodes).index)


def _fused_conv(pattern: list[fx.Node], gm: fx.GraphModule) -> Callable[[GraphRewrite, fx.Node], fx.Node]:
    """The builder of the :func:`fft_conv` call that replaces a pattern :func:`_fft_conv_pattern` matched."""
    mul, irfft = pattern[-2], pattern[-1]
    spectra = [_fft_params(s, gm, "fft_rfft") if isinstance(s, fx.Node) else None for s in mul.args]
    inverse = _fft_params(irfft, gm, "fft_irfft")
    if inverse is None or len(spectra) != 2 or spectra[0] is None or spectra[1] is None:
        raise RuntimeError(f"afno_real_arithmetic_transform_pass: the FFT convolution at {mul.name!r} is no "
                           "longer rfft * rfft -> irfft; a bug in the pass's matching, please report it")
    a, b = spectra[0]["input"], spectra[1]["input"]
    return lambda rw, last: rw.call_function(fft_conv, (a, b, inverse["n"], inverse["dim"]), before=last)


@forge_pass("transform", NoArgs, info=AfnoRealInfo, requires=("shapes",),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5, note="outputs and gradients"))
def afno_real_arithmetic_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, AfnoRealInfo]:
    """Rewrite complex x complex multiplies (AFNO's FFT-domain products) into real ops on (real, imag) pairs;
    whole FFT convolutions into :func:`fft_conv`."""
    gm = graph.model
    before = tuple(complex_compute_ops(gm))
    rewritten = convs = 0
    for node in list(gm.graph.nodes):
        if classify(node, gm)[1] != "mul" or node.kwargs or len(node.args) != 2 \
                or not all(is_complex(a) for a in node.args):
            continue
        pattern = _fft_conv_pattern(node, gm)
        with GraphRewrite(gm) as rw:
            if pattern is not None:
                rw.replace_pattern(pattern, _fused_conv(pattern, gm))
                convs += 1
            else:
                rw.bypass(node, _real_mul(rw, node))
        rewritten += 1
    return graph, AfnoRealInfo(rewritten=rewritten, fft_convs=convs, complex_ops_before=before,
                               complex_ops_after=tuple(complex_compute_ops(gm)))
