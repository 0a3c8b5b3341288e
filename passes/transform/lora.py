"""LoRA: insert low-rank adapters into a graph's nn.Linear layers, train them, fuse them back.

``insert_lora_adapter_transform_pass(mg, {"rank": 6, "alpha": 1.0, "dropout": 0.5})`` (MASE tutorial 2)
replaces each selected ``nn.Linear`` behind a call_module node by :class:`LoraLinear`, which keeps the
layer -- weight **and bias**, frozen -- and adds ``scaling * B @ A`` with ``scaling = alpha / rank``.
A is kaiming-uniform (as PEFT and loralib) and B is zero, so inserting adapters does not change the
model's outputs. ``fuse_lora_weights_transform_pass(mg)`` merges ``W + scaling * B @ A`` into a copy of
the base layer (the same arithmetic as PEFT's ``merge_and_unload``): a plain ``nn.Linear``, or a
quantized linear that stays quantized (quantize -> LoRA -> fuse). Quantizing a LoRA graph quantizes the
base layers; the adapters stay float until fused.

Defaults (documented choices):

* ``rank=8, alpha=8.0, dropout=0.0, init="kaiming"``: PEFT's defaults (scaling 1). MASE's tutorial keys
  ``rank``/``alpha``/``dropout`` all take effect; any other key is an error listing the allowed ones.
* ``targets``: every ``nn.Linear`` of the graph (MASE parity; for BERT that is query/key/value/dense,
  the pooler and the classifier). A selector narrows it; LoRA candidates are always nn.Linear layers,
  so ``{"regex": r".*attention.*"}`` adapts the attention's linears and ignores its dropout. A selected
  non-Linear layer is listed in ``info.skipped``; when no Linear is selected the pass fails.
* ``trainable`` (PEFT's ``modules_to_save``): modules kept fully trainable, e.g. a freshly initialised
  classifier head ``{"name": "classifier"}``. Linear layers inside them get no adapter.
* ``freeze_rest=True``: every parameter that is neither an adapter nor in ``trainable`` is frozen
  (embeddings, LayerNorms, biases...), as in PEFT. Adapted layers' own weight and bias are always frozen.

Like every transform, insertion and fusion return a new graph and leave their input as it was (the
freezing happens on the copy). Fusing into a quantized base is refused unless ``requantize=True``
(see :func:`fuse_lora_weights_transform_pass`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets as checkpoint_targets
from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import MetaRecord, get_meta, has_meta, register_record
from ..base import PassArgsError, forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..quantize.modules import _QuantizedLayer
from ..quantize.records import QuantizationRecord
from ..rewrite import NoMatchError, inject_modules, param_users, refresh_nodes, swap_module
from ..select import Selector, iter_layers, parse_selector_fields, select_modules, select_nodes
from .lora_dropout import DropoutDown

LoraInit = Literal["kaiming", "gaussian"]
LORA_INITS: tuple[LoraInit, ...] = ("kaiming", "gaussian")
DEFAULT_TARGETS: Selector = Selector.parse({"type": "linear"})


class LoraError(ValueError):
    """LoRA cannot be applied as asked (adapter already present, nothing to fuse, ...)."""


def check_lora_hparams(rank: Any, alpha: Any, dropout: Any, init: Any = "kaiming") -> None:
    """Validate LoRA hyper-parameters; ValueError naming the key and the allowed values."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"'rank' must be a positive int (the adapter's bottleneck width), got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"'alpha' must be a finite number > 0 (scaling = alpha / rank), got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"'dropout' must be a probability in [0, 1), got {dropout!r}")
    lora_init(init)


def lora_init(value: object) -> LoraInit:
    """``value`` checked to be an adapter initialisation name; ValueError naming the allowed ones."""
    for name in LORA_INITS:
        if value == name:
            return name
    raise ValueError(f"'init' must be one of {list(LORA_INITS)}, got {value!r}")


class LoraLinear(nn.Module):
    """``base(x) + scaling * B(A(dropout(x)))`` around a frozen ``nn.Linear`` (its bias included).

    ``lora_A`` is ``(rank, in_features)``, ``lora_B`` is ``(out_features, rank)`` and starts at zero,
    so a fresh adapter is an exact no-op. ``lora_dropout`` only acts in train mode.
    """

    fxforge_op = "lora_linear"
    fxforge_wraps = "base"  # computes base(x) + adapter: passes that rewrite layers (quantize) reach the base

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 init: LoraInit = "kaiming") -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoraLinear wraps an nn.Linear, got {type(base).__name__}")
        check_lora_hparams(rank, alpha, dropout, init)
        self.base = base
        self.rank, self.alpha, self.dropout_p, self.init = rank, float(alpha), float(dropout), init
        self.scaling = self.alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reset_lora_parameters(self) -> None:
        """A as PEFT/loralib (kaiming-uniform, a=sqrt(5); or normal with std 1/rank), B = 0."""
        with torch.no_grad():
            if self.init == "kaiming":
                nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            else:
                nn.init.normal_(self.lora_A, std=1.0 / self.rank)
            nn.init.zeros_(self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        """``(B @ A) * scaling``: what fusion adds to the base weight (PEFT's ``get_delta_weight``)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """The fused weight ``W + (B @ A) * scaling`` (detached)."""
        with torch.no_grad():
            return self.base.weight + self.delta_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = getattr(self.base, "weight_mask", None)
        if isinstance(mask, torch.Tensor):  # a pruned base (passes/prune): the update obeys its masks, so the
            masked_input = getattr(self.base, "masked_input", None)  # fused layer computes exactly this
            xin = masked_input(x) if callable(masked_input) else x
            return self.base(x) + F.linear(self.lora_dropout(xin), self.delta_weight() * mask)
        # Scale the rank-wide activation (rank << out_features) rather than the output: fewer flops.
        if self.training and self.dropout_p > 0 and torch.is_grad_enabled():
            low = DropoutDown.apply(x, self.lora_A, self.dropout_p, self.scaling / (1.0 - self.dropout_p))
        else:
            low = F.linear(self.lora_dropout(x), self.lora_A) * self.scaling
        return self.base(x) + F.linear(low, self.lora_B)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, scaling={self.scaling:g}, dropout={self.dropout_p:g}"


def _lora_config(m: LoraLinear) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.base.bias is not None,
            "rank": m.rank, "alpha": m.alpha, "dropout": m.dropout_p, "init": m.init}


def _lora_from_config(c: dict[str, Any]) -> LoraLinear:
    base = nn.Linear(int(c["in_features"]), int(c["out_features"]), bias=bool(c["bias"]))
    return LoraLinear(base, int(c["rank"]), float(c["alpha"]), float(c["dropout"]), lora_init(c.get("init", "kaiming")))


checkpoint_targets.register_module(LoraLinear, _lora_config, _lora_from_config, name="fxforge.LoraLinear",
                                   keys=("in_features", "out_features", "bias", "rank", "alpha", "dropout", "init"))


@register_record("software.lora")
@dataclass
class LoraRecord(MetaRecord):
    """LoRA adapter of a call_module node (software metadata)."""

    rank: int = 0
    alpha: float = 0.0
    scaling: float = 0.0
    dropout: float = 0.0
    init: str = "kaiming"
    in_features: int = 0
    out_features: int = 0


def lora_layers(gm: fx.GraphModule) -> list[tuple[fx.Node, str, LoraLinear]]:
    """(node, path, module) of every call_module node whose module is a LoraLinear."""
    return [(layer.node, layer.path, layer.module) for layer in iter_layers(gm, LoraLinear)
            if isinstance(layer.module, LoraLinear)]  # always (iter_layers filtered by type): typed as one


register_property("lora", lambda graph: any(True for _ in iter_layers(graph.model, LoraLinear)),
                  "a LoRA adapter (LoraLinear) is in the graph (insert_lora_adapter_transform_pass)")


@dataclass(frozen=True)
class LoraInfo(PassInfo):
    """adapted: adapted layer paths; skipped: selected non-Linear layers (path, type); trainable_modules:
    modules kept fully trainable; scaling = alpha / rank; parameter counts after insertion."""

    adapted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    trainable_modules: list[str] = field(default_factory=list)
    scaling: float = 0.0
    trainable: int = 0
    total: int = 0
    trainable_percent: float = 0.0


@dataclass(frozen=True)
class FuseLoraInfo(PassInfo):
    """fused: the layer paths whose adapters were merged; requantized (only with ``requantize=True``):
    quantized layers whose merged weight was re-rounded -> max |change of the weight the layer applies|
    against base + adapter; max_weight_error: the largest of those (0.0 when none)."""

    fused: list[str] = field(default_factory=list)
    requantized: dict[str, float] = field(default_factory=dict)
    max_weight_error: float = 0.0


@dataclass(frozen=True)
class LoraArgs:
    """rank, alpha (scaling = alpha/rank), dropout (on the adapter's input), targets/exclude (selectors
    over nn.Linear layers; default every Linear), trainable (modules kept fully trainable, PEFT's
    modules_to_save), init ('kaiming' | 'gaussian' for A), freeze_rest (freeze all other parameters)."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: Any = None
    exclude: Any = None
    trainable: Any = None
    init: LoraInit = "kaiming"
    freeze_rest: bool = True

    def __post_init__(self) -> None:
        check_lora_hparams(self.rank, self.alpha, self.dropout, self.init)
        parse_selector_fields(self, select=("targets", "trainable"))


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


@forge_pass("transform", LoraArgs, info=LoraInfo, ensures=("lora",),
            forbids=("activation-checkpointed", "pipeline-stages"),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="B = 0: a fresh adapter adds nothing"))
def insert_lora_adapter_transform_pass(graph: ForgeGraph, args: LoraArgs) -> tuple[ForgeGraph, LoraInfo]:
    """Wrap each selected nn.Linear in a LoraLinear; outputs are unchanged (B = 0) until training.

    info = {"adapted": [paths], "skipped": [(path, type)], "trainable_modules": [paths], "scaling",
    "trainable", "total", "trainable_percent"}. Errors: a selected layer that already has an adapter,
    no Linear selected (the message lists candidates).
    """
    gm = graph.model
    targets = DEFAULT_TARGETS if args.targets is None else args.targets
    include, skip = targets, args.exclude
    again = [path for _, path, m in lora_layers(gm)
             if include.matches(path, m.base, "linear") and not skip.matches(path, m.base, "linear")]
    if again:
        raise LoraError(f"layer(s) {again[:4]}{' ...' if len(again) > 4 else ''} already have a LoRA adapter; "
                        "inserting twice is an error: fuse first, or exclude them")
    keep = [] if args.trainable is None else [p for p, _ in select_modules(gm, args.trainable)]
    if args.trainable is not None and not keep:
        raise NoMatchError(f"'trainable' selector {args.trainable!r} matched no module")
    exclude = [args.exclude, lambda name, module, op: _inside(name, keep)] if keep else args.exclude
    skipped: list[tuple[str, str]] = []

    def build(name: str, module: nn.Module) -> nn.Module | None:
        if not isinstance(module, nn.Linear):
            skipped.append((name, type(module).__name__))
            return None
        lora = LoraLinear(module, args.rank, args.alpha, args.dropout, args.init)
        return lora.train(module.training)  # a new module is in train mode: follow the layer it replaces

    narrow = {name: min(m.in_features, m.out_features) for _, name, m, _ in
              select_nodes(gm, targets, exclude, modules_only=True)
              if isinstance(m, nn.Linear) and args.rank > min(m.in_features, m.out_features)}
    if narrow:  # checked on every selected layer before the graph is touched (e.g. a 2-label classifier)
        shown = [f"{n} ({d})" for n, d in narrow.items()][:4]
        names = {"name": list(narrow)}
        raise PassArgsError(f"insert_lora_adapter_transform_pass: pass_args['rank'] = {args.rank} exceeds the smaller "
                            f"dimension of layer(s) {shown}{' ...' if len(narrow) > 4 else ''}: leave them out "
                            f"with {{'exclude': {names}}}, or train them fully with {{'trainable': {names}}} (PEFT's "
                            "modules_to_save, the usual choice for a fresh classifier head), or lower 'rank'")
    try:
        done = inject_modules(gm, targets, exclude, build, what="nn.Linear layer for LoRA")
    except NoMatchError as exc:
        if not skipped:
            raise
        raise NoMatchError(f"{exc}. The selected layers are not nn.Linear: {skipped[:4]}; LoRA wraps float or "
                           "simulated-quantized (quantize_transform_pass) linears, not layers lowered to int8 "
                           "kernels (lower_int8_transform_pass): insert adapters before lowering") from None
    adapted = [d.name for d in done]
    if args.freeze_rest:
        for p in gm.parameters():
            p.requires_grad_(False)
    for path in adapted:
        module = gm.get_submodule(path)
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    for path in keep:
        for p in gm.get_submodule(path).parameters():
            p.requires_grad_(True)
    refresh_nodes(gm, param_users(gm))  # requires_grad flags changed; the engine refreshed adapted nodes
    for node, path, module in lora_layers(gm):
        if path in adapted:
            _move_quantizer_paths(node, path, f"{path}.", f"{path}.base.")
        if path in adapted and has_meta(node):
            get_meta(node).software.set(LoraRecord(rank=module.rank, alpha=module.alpha, scaling=module.scaling,
                                         dropout=module.dropout_p, init=module.init,
                                         in_features=module.in_features, out_features=module.out_features))
    trainable = sum(p.numel() for p in gm.parameters() if p.requires_grad)
    total = sum(p.numel() for p in gm.parameters())
    return graph, LoraInfo(adapted=adapted, skipped=skipped, trainable_modules=keep, scaling=args.alpha / args.rank,
                           trainable=trainable, total=total,
                           trainable_percent=100.0 * trainable / total if total else 0.0)


@dataclass(frozen=True)
class FuseLoraArgs:
    """targets/exclude: which adapted layers to fuse (selectors as for insertion; default all);
    requantize: also fuse adapters whose base is quantized (inexact: the error is measured, see the pass)."""

    targets: Any = None
    exclude: Any = None
    requantize: bool = False

    def __post_init__(self) -> None:
        parse_selector_fields(self)


def fused_linear(module: LoraLinear) -> nn.Linear:
    """A copy of the base layer (its class: a quantized base stays quantized, with its quantizers) with
    weight ``W + (B @ A) * scaling`` and the base's bias (copied, not shared)."""
    # imported here: passes/prune declares graph properties that are registered after this module loads
    from ..prune.modules import is_masked

    base = module.base
    new = copy.deepcopy(base)
    new.weight = nn.Parameter(module.merged_weight().clone(), requires_grad=base.weight.requires_grad)
    new.train(base.training)
    if is_masked(new):  # a pruned base (passes/prune): the copy keeps its masks; zero what they cut
        new.set_masks(new.weight_mask, new.bias_mask)
    return new


def _move_quantizer_paths(node: fx.Node, path: str, old: str, new: str) -> None:
    """Keep a quantized layer's record pointing at its quantizers when LoRA wraps or unwraps it."""
    rec = get_meta(node).software.get(QuantizationRecord) if has_meta(node) else None
    if rec is not None:
        rec.quantizers = {r: new + q[len(old):] if q.startswith(old) else q for r, q in rec.quantizers.items()}


def _is_quantized(layer: nn.Module) -> bool:
    """A simulated-quantized layer (quantize_transform_pass): merging into it is not exact."""
    return isinstance(layer, _QuantizedLayer)


def _weight_error(lora: LoraLinear, fused: nn.Linear) -> float:
    """max |q(W + BA·s) - (q(W) + BA·s)|: how far the fused layer's applied weight is from the adapted one's."""
    q = getattr(fused, "weight_quantizer", None)
    with torch.no_grad():
        applied = (lora.base.weight if q is None else q(lora.base.weight)) + lora.delta_weight()
        merged = fused.weight if q is None else q(fused.weight)
        return float((merged - applied).abs().max()) if merged.numel() else 0.0


@forge_pass("transform", FuseLoraArgs, info=FuseLoraInfo, requires=("lora",), forbids=("activation-checkpointed",),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5, note="W + scaling * B @ A, float rounding"))
def fuse_lora_weights_transform_pass(graph: ForgeGraph, args: FuseLoraArgs) -> tuple[ForgeGraph, FuseLoraInfo]:
    """Merge each selected adapter into its layer and replace the LoraLinear by the base layer's class.

    Float bases: eval outputs are unchanged up to float rounding (the declared exact contract); the fused
    graph costs what the base model costs and keeps the base's requires_grad flags.

    Quantized bases (quantize -> LoRA -> fuse) are refused unless ``requantize=True``: the merged weight
    is re-rounded to the base's format and the adapter's path now sees the quantized input, so the
    result is bounded, not exact (PEFT warns on merges into quantized layers likewise). With the opt-in,
    ``info.requantized`` reports each such layer's measured weight error; a pipeline step that uses it
    sets contract thresholds (e.g. ``{"atol": 0.1}``). The exact alternative: fuse before quantizing.
    """
    gm = graph.model
    layers = lora_layers(gm)
    include = DEFAULT_TARGETS if args.targets is None else args.targets
    skip = args.exclude
    chosen = {path: module for _, path, module in layers
              if include.matches(path, module.base, "linear") and not skip.matches(path, module.base, "linear")}
    if not chosen:
        raise NoMatchError(f"no LoRA adapter matched targets={args.targets!r} exclude={args.exclude!r}; "
                           f"adapted layers: {[p for _, p, _ in layers][:6]}")
    quantized = [p for p, m in chosen.items() if _is_quantized(m.base)]
    if quantized and not args.requantize:
        raise LoraError(
            f"layer(s) {quantized[:4]}{' ...' if len(quantized) > 4 else ''} have a quantized base "
            f"({type(chosen[quantized[0]].base).__name__}): merging W + scaling * B @ A re-rounds the weight to its "
            "format and quantizes the adapter's input, so the fused graph would not compute what this one does. "
            "Pass {'requantize': True} to fuse anyway (the measured error is reported in info.requantized), "
            "or fuse before quantizing (insert -> train -> fuse -> quantize_transform_pass), or keep the "
            "adapters unfused, or leave those layers out with 'exclude'")
    requantized: dict[str, float] = {}
    for path, module in chosen.items():
        new = fused_linear(module)
        if path in quantized:
            requantized[path] = _weight_error(module, new)
        swap_module(gm, path, new)
    for node, path, _ in layers:
        if path in chosen:
            _move_quantizer_paths(node, path, f"{path}.base.", f"{path}.")
        if path in chosen and has_meta(node):
            get_meta(node).software.remove(LoraRecord)
    gm.delete_all_unused_submodules()
    return graph, FuseLoraInfo(fused=list(chosen), requantized=requantized,
                               max_weight_error=max(requantized.values(), default=0.0))
