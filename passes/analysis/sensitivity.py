"""sensitivity_analysis_pass: how much the loss grows when one layer is quantized, or one prune group pruned.

Per quantizable layer (every Linear by default) and candidate width, the weight is quantized exactly as
``quantize_transform_pass`` would quantize it (the same :class:`Quantize` module, role ``weight``, per
output row), giving a perturbation ``dW``; the loss increase is then estimated (or measured) on calibration batches:

* ``fisher``: ``0.5 * sum(F * dW^2)`` with ``F`` the empirical Fisher diagonal (squared per-sample gradients,
  averaged over the calibration samples): the second-order Taylor term with the Fisher for the Hessian.
* ``hessian_trace``: ``0.5 * Tr(G_l) / n_l * ||dW||^2`` (HAWQ-V3's trace x squared perturbation), with
  ``G_l = J_l^T H_z J_l`` the layer's Gauss-Newton block (``J_l``: the output's Jacobian in the weight,
  ``H_z``: the loss's Hessian in the output), its trace estimated by Hutchinson's method (``probes``
  Rademacher probes per layer and batch; ``J v`` and ``H_z (J v)`` by double backward). It is the Hessian
  block without the term weighted by the residuals ``dL/dz``, equal to it at a minimum and positive
  semi-definite everywhere: the full block's trace goes negative away from a minimum or through curved
  activations (tanh poolers, GELU), and a negative trace times ``||dW||^2`` ranked such a layer below every other.
* ``sqnr``: the layer alone runs quantized and the model output's noise power over its signal power is
  measured (loss-free; a loss-like score that grows with the noise).
* ``loss``: the layer alone runs quantized and the calibration loss is measured, minus the float model's:
  no estimate (HAQ's direct measurement), one pass over the batches per layer and width; cheap on small
  models and the reference the estimates approximate. It can be negative (a quantized layer that happens to
  fit the calibration batches better).

How well each ranks layers (tests/passes/test_sensitivity_ranking.py: a tiny BERT trained on scikit-learn's
digits, each of its 14 Linears alone quantized to 2 bits, accuracy drops measured on 7,173 held-out samples):
Spearman ``loss`` 0.86, ``sqnr`` 0.82, ``hessian_trace`` 0.67-0.69 over three probe seeds (the full Hessian
block's trace, replaced for its sign, 0.71-0.74 there at twice the time), ``fisher`` 0.63, alike at 1 and 2
threads; trained from another seed: ``loss`` 0.94, ``sqnr`` 0.68, ``hessian_trace`` 0.59, ``fisher`` 0.69.
The two estimates are second-order terms about a minimum with the curvature cut down to its diagonal
(``fisher``: weights independent) or its trace (``hessian_trace``: an isotropic block), assumptions a 2-bit
per-row grid, whose rounding errors are large and correlated along a row, is far from. Where one pass over
the calibration batches per layer and width is affordable (small models, few widths), rank by ``loss``.

Prune groups (attention heads, FFN units) are scored in passes/analysis/sensitivity_prune.py. Nothing is
written into the graph: perturbed weights are passed to ``torch.func.functional_call`` beside the module,
whose parameters, gradients, flags and mode are left as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ..base import PassArgsError, forge_pass
from ..batching import iter_batches
from ..quantize.config import RoleSpec
from ..quantize.formats import AUTO, QuantizeConfigError, check_role_params, get_format
from ..quantize.quantizer import Quantize
from ..select import select_nodes
from .sensitivity_types import METHODS, LayerSensitivity, SensitivityArgs, SensitivityInfo

__all__ = ["sensitivity_analysis_pass", "quantized_weight", "weight_spec"]

PASS = "sensitivity_analysis_pass"
WEIGHT_OPS = ("linear", "conv1d", "conv2d", "embedding")  # weights the quantized twins quantize per output row
Overrides = dict[str, torch.Tensor]


def weight_spec(fmt: str, width: int, params: Mapping[str, Any] | None) -> RoleSpec:
    """The weight role's spec at ``width`` (integer defaults to ``frac_width: "auto"``, per output row)."""
    fmt_def = get_format(fmt)
    given: dict[str, Any] = dict(params) if params is not None else (
        {"frac_width": AUTO} if fmt_def.name == "integer" else {})
    given["width"] = width
    return RoleSpec(fmt_def.name, tuple(sorted(check_role_params(fmt_def, given, "weight").items())))


def quantized_weight(weight: torch.Tensor, spec: RoleSpec) -> torch.Tensor:
    """``weight`` as the quantize pass's quantized layer computes with it (Linear: per row; conv: flattened)."""
    quantizer = Quantize(spec, "weight", is_param=True, channel_axis=0, block_axis=-1)
    with torch.no_grad():
        w = weight.detach()
        return quantizer(w.flatten(1)).view_as(w) if w.dim() > 2 else quantizer(w)


class Evaluator:
    """Runs the graph on the calibration batches with weights overridden (never written into the module)."""

    def __init__(self, graph: ForgeGraph, batches: list[Any], loss_fn: Callable[[Any, Any], Any] | None) -> None:
        self.gm: fx.GraphModule = graph.model
        self.batches, self.loss_fn = batches, loss_fn
        self.inputs = {str(n.target) for n in self.gm.graph.nodes if n.op == "placeholder"}

    def call(self, batch: Any, overrides: Mapping[str, torch.Tensor] | None = None) -> Any:
        """The model's output on ``batch`` with ``overrides`` (parameter name -> tensor) in place of its own."""
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if isinstance(batch, ExampleInputs):
            args, kwargs = tuple(batch.args), dict(batch.kwargs)
        elif isinstance(batch, Mapping):  # labels the graph does not take are the default loss's targets
            kwargs = {k: v for k, v in batch.items() if k != "labels" or k in self.inputs}
        elif isinstance(batch, tuple | list):
            args = tuple(batch)
        else:
            args = (batch,)
        return torch.func.functional_call(self.gm, dict(overrides or {}), args, kwargs, tie_weights=False,
                                          strict=False)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The scalar loss: loss_fn, else the output's ``loss``, else cross-entropy of logits vs ``labels``."""
        if self.loss_fn is not None:
            loss = self.loss_fn(output, batch)
        else:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, Mapping):
                loss = output.get("loss")
            if loss is None:
                labels = batch.get("labels") if isinstance(batch, Mapping) else None
                if not isinstance(labels, torch.Tensor):
                    raise PassArgsError(f"{PASS}: method needs a loss, but the output has no 'loss' and the batch no "
                                        "'labels': give batches with labels, or loss_fn(output, batch) -> loss")
                logits = output_tensor(output)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PassArgsError(f"{PASS}: the loss must be a scalar tensor, got {type(loss).__name__}")
        return loss.reshape(())

    def has_loss(self) -> bool:
        """Can a loss be computed on these batches (loss_fn, an output loss or labels)?"""
        if self.loss_fn is not None:
            return True
        batch = self.batches[0]
        if isinstance(batch, Mapping) and "labels" in batch:
            return True
        with torch.no_grad():
            out = self.call(batch)
        return getattr(out, "loss", None) is not None or isinstance(out, Mapping) and out.get("loss") is not None

    def mean_loss(self, overrides: Mapping[str, torch.Tensor] | None = None) -> float:
        with torch.no_grad():
            return sum(float(self.loss(self.call(b, overrides), b)) for b in self.batches) / len(self.batches)

    def outputs(self, overrides: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        with torch.no_grad():
            return [output_tensor(self.call(b, overrides)).detach().float() for b in self.batches]

    def noise_ratio(self, reference: list[torch.Tensor], overrides: Mapping[str, torch.Tensor]) -> float:
        """Output noise power over signal power, summed over the batches (0: outputs unchanged)."""
        noise = signal = 0.0
        for ref, out in zip(reference, self.outputs(overrides)):
            noise += float(((out - ref) ** 2).sum())
            signal += float((ref**2).sum())
        return noise / max(signal, 1e-30)

    def samples(self) -> Iterator[Any]:
        """Each batch split into its samples (a mapping or sequence of tensors sharing dim 0), else whole."""
        for batch in self.batches:
            values = list(batch.values()) if isinstance(batch, Mapping) else list(batch) \
                if isinstance(batch, tuple | list) else [batch]
            sizes = {v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else -1 for v in values}
            if len(sizes) != 1 or -1 in sizes or isinstance(batch, ExampleInputs):
                yield batch
                continue
            for i in range(sizes.pop()):
                if isinstance(batch, Mapping):
                    yield {k: v[i:i + 1] for k, v in batch.items()}
                elif isinstance(batch, tuple | list):
                    yield type(batch)(v[i:i + 1] for v in batch)
                else:
                    yield batch[i:i + 1]

    def grads(self, leaves: Mapping[str, torch.Tensor], create_graph: bool = False, per_sample: bool = False
              ) -> Iterator[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """Per batch (or per sample): (leaves as fresh grad-requiring tensors, d loss / d leaf)."""
        for batch in (self.samples() if per_sample else self.batches):
            fresh = {k: w.detach().requires_grad_(True) for k, w in leaves.items()}
            with torch.enable_grad():
                loss = self.loss(self.call(batch, fresh), batch)
                grads = torch.autograd.grad(loss, list(fresh.values()), create_graph=create_graph, allow_unused=True)
            yield tuple(fresh.values()), tuple(torch.zeros_like(w) if g is None else g
                                               for w, g in zip(fresh.values(), grads))


def output_tensor(output: Any) -> torch.Tensor:
    """The model output the loss-free methods compare: a tensor, else ``logits``, else its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    items = output.values() if isinstance(output, Mapping) else output if isinstance(output, tuple | list) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item
    raise PassArgsError(f"{PASS}: the model's output ({type(output).__name__}) holds no tensor to measure")


@contextmanager
def _eval_mode(gm: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and the math attention kernel (twice differentiable) for the block."""
    was = gm.training
    gm.eval()
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        gm.train(was)


def _check(args: SensitivityArgs) -> dict[int, RoleSpec]:
    """Refuse what cannot be measured before running anything; the weight spec per width."""
    if args.data is None:
        raise PassArgsError(f"{PASS}: no data: pass calibration batches, e.g. {{'data': [batch, ...]}}")
    if args.method not in METHODS:
        raise PassArgsError(f"{PASS}: unknown method {args.method!r}; methods: {list(METHODS)}")
    if not args.widths:
        raise PassArgsError(f"{PASS}: 'widths' must name at least one candidate width")
    ratios = [r for r in args.prune_ratios if not 0.0 < r < 1.0]
    if ratios:
        raise PassArgsError(f"{PASS}: prune_ratios must be fractions in (0, 1), got {ratios}")
    if args.probes < 1:
        raise PassArgsError(f"{PASS}: 'probes' must be >= 1, got {args.probes}")
    if args.loss_fn is not None and not callable(args.loss_fn):
        raise PassArgsError(f"{PASS}: 'loss_fn' must be callable(output, batch) -> scalar loss")
    specs = {}
    for width in args.widths:
        try:
            specs[width] = weight_spec(args.format, width, args.format_params)
        except QuantizeConfigError as exc:
            raise PassArgsError(f"{PASS}: width {width} is not supported by format {args.format!r}: {exc}") from None
    return specs


def target_layers(gm: fx.GraphModule, targets: Any, exclude: Any = None) -> dict[str, str]:
    """Layer name (as quantize configs ``by: name`` and MixedPrecisionSpace name it) -> its weight's key, for the
    selected modules (default: every Linear) of the WEIGHT_OPS types, with a weight of two or more dimensions."""
    out: dict[str, str] = {}
    chosen = targets if targets is not None else {"type": "linear"}
    for node, name, module, op in select_nodes(gm, chosen, exclude, modules_only=True):
        weight = getattr(module, "weight", None)
        if op in WEIGHT_OPS and isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            out.setdefault(name, f"{node.target}.weight")
    return out


def _quant_deltas(ev: Evaluator, args: SensitivityArgs, keys: dict[str, str], params: dict[str, torch.Tensor],
                  specs: dict[int, RoleSpec], baseline: float) -> dict[str, list[tuple[int, float]]]:
    """name -> [(width, estimated or measured loss increase)] by the chosen method, widest first."""
    widths = sorted(specs, reverse=True)
    perturbed = {name: {w: quantized_weight(params[key], specs[w]) for w in widths} for name, key in keys.items()}
    if args.method == "sqnr":
        reference = ev.outputs()
        return {name: [(w, ev.noise_ratio(reference, {key: perturbed[name][w]})) for w in widths]
                for name, key in keys.items()}
    if args.method == "loss":
        return {name: [(w, ev.mean_loss({key: perturbed[name][w]}) - baseline) for w in widths]
                for name, key in keys.items()}
    leaves = {key: params[key] for key in keys.values()}
    curvature = _fisher(ev, leaves) if args.method == "fisher" else _gauss_newton(ev, leaves, args.probes, args.seed)
    out = {}
    for name, key in keys.items():
        w = params[key].detach()
        row = []
        for width in widths:
            d2 = (perturbed[name][width] - w).double() ** 2
            c = curvature[key]  # fisher: a diagonal shaped like w; hessian_trace: the block's trace
            per = c if args.method == "fisher" else c / w.numel()
            row.append((width, float(0.5 * (per * d2).sum())))
        out[name] = row
    return out


def _fisher(ev: Evaluator, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empirical Fisher diagonal per weight: squared per-sample gradients, averaged over the samples (a batch's
    mean gradient nearly vanishes at a trained minimum, where the per-sample ones do not)."""
    acc = {k: torch.zeros_like(w, dtype=torch.float64) for k, w in leaves.items()}
    seen = 0
    for _, grads in ev.grads(leaves, per_sample=True):
        seen += 1
        for k, g in zip(leaves, grads):
            acc[k] += g.detach().double() ** 2
    return {k: a / max(seen, 1) for k, a in acc.items()}


def _gauss_newton(ev: Evaluator, leaves: dict[str, torch.Tensor], probes: int, seed: int) -> dict[str, torch.Tensor]:
    """Each weight's Gauss-Newton block trace, E[(J v)^T H_z (J v)] over Rademacher probes v of that layer alone
    (a probe spanning every layer adds the other blocks' coupling to each estimate's variance), averaged over
    batches. ``J v`` is the derivative in ``u`` of ``v . (J^T u)`` (double backward, no forward-mode AD)."""
    gen = torch.Generator().manual_seed(seed)
    acc = {k: torch.zeros((), dtype=torch.float64) for k in leaves}
    for batch in ev.batches:
        fresh = {k: w.detach().requires_grad_(True) for k, w in leaves.items()}
        with torch.enable_grad():
            out = ev.call(batch, fresh)
            z = output_tensor(out)
            (g_z,) = torch.autograd.grad(ev.loss(out, batch), z, create_graph=True, allow_unused=True)
            if g_z is None or not g_z.requires_grad:
                raise PassArgsError(f"{PASS}: hessian_trace needs a loss that is a twice differentiable function of "
                                    "the model output (its logits); use method 'fisher' or 'loss'")
            u = torch.zeros_like(z, requires_grad=True)
            for k, w in fresh.items():
                (jt_u,) = torch.autograd.grad(z, w, grad_outputs=u, create_graph=True, allow_unused=True)
                if jt_u is None:
                    continue  # the output does not depend on this weight: its block is zero
                for _ in range(probes):
                    v = (torch.randint(0, 2, w.shape, generator=gen) * 2 - 1).to(w.dtype)
                    (jv,) = torch.autograd.grad(jt_u, u, grad_outputs=v, retain_graph=True)
                    (h_jv,) = torch.autograd.grad(g_z, z, grad_outputs=jv, retain_graph=True)
                    acc[k] += (jv * h_jv).double().sum()
    return {k: a / (len(ev.batches) * probes) for k, a in acc.items()}


@forge_pass("analysis", SensitivityArgs, info=SensitivityInfo)
def sensitivity_analysis_pass(graph: ForgeGraph, args: SensitivityArgs) -> tuple[ForgeGraph, SensitivityInfo]:
    """Per layer, the loss increase at each candidate width; per attention block / FFN, the importance of each
    head / unit and the loss increase at each prune ratio (see the module docstring). The graph is unchanged."""
    from .sensitivity_prune import prune_groups

    specs = _check(args)
    batches = list(iter_batches(graph, args.data, args.num_batches))
    if not batches:
        raise PassArgsError(f"{PASS}: 'data' yielded no batch")
    gm = graph.model
    keys = target_layers(gm, args.targets, args.exclude)
    if not keys:
        raise PassArgsError(f"{PASS}: 'targets' selects no layer with a weight to quantize ({list(WEIGHT_OPS)}); "
                            "omit it for every Linear")
    ev = Evaluator(graph, batches, args.loss_fn)
    params: dict[str, torch.Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    with _eval_mode(gm):
        lossy = ev.has_loss()
        if args.method != "sqnr" and not lossy:
            ev.loss(ev.call(batches[0]), batches[0])  # raises the error naming what is missing
        baseline = ev.mean_loss() if lossy else 0.0
        if not math.isfinite(baseline):
            raise PassArgsError(f"{PASS}: the baseline loss on the calibration batches is {baseline}")
        deltas = _quant_deltas(ev, args, keys, params, specs, baseline)
        groups = prune_groups(graph, ev, args, params, baseline, lossy)
    layers = tuple(LayerSensitivity(name, params[key].numel(), tuple(deltas[name])) for name, key in keys.items())
    return graph, SensitivityInfo(method=args.method, baseline_loss=baseline, layers=layers, groups=groups)
