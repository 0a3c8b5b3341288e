"""ForgeGraph: a captured model (one torch.fx GraphModule IR) plus its provenance.

Users start every workflow with ``mg = ForgeGraph(model, ...)`` (MASE's MaseGraph) and chain passes
on it. The GraphModule is ``mg.model``; node metadata lives on its nodes (graph/metadata).
"""

from __future__ import annotations

import copy
import typing
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .capture import CaptureError, Frontend, capture
from .inputs import ExampleInputs
from .metadata import NodeMeta, get_meta
from .treespec import copy_codegen, spec_memo

# Buffers holding values folded from parameters for inference (fold_constants_transform_pass): the
# derived "constants folded" flag of a graph. They do not follow the weights if the graph is trained.
FOLDED_PREFIX = "fxforge_folded_"


def folded_buffers(module: nn.Module) -> list[str]:
    """Names of the root buffers of ``module`` that hold folded constants."""
    return [name for name, _ in module.named_buffers(recurse=False) if name.startswith(FOLDED_PREFIX)]


@dataclass(frozen=True)
class PassRecord:
    """One entry of a graph's pass history: which pass ran, of which kind, with which (JSON) args."""

    name: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "args": self.args}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PassRecord:
        """Rebuild a record, its fields type-checked (a checkpoint's history is hostile): ValueError naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"a history record must be an object, got {type(data).__name__}")
        for key, kind in (("name", str), ("kind", str), ("args", dict)):
            if (key in data or key != "args") and not isinstance(data.get(key), kind):
                raise ValueError(f"history record {str(data.get('name'))[:60]!r}: {key} must be "
                                 f"{'a string' if kind is str else 'an object'}, got {type(data.get(key)).__name__}")
        return cls(name=data["name"], kind=data["kind"], args=dict(data.get("args", {})))


# torch-owned node.meta entries that are immutable values (fake tensors, tensor metadata): kept as they are.
_SHARED_META = frozenset({"val", "example_value", "tensor_meta", "unbacked_bindings", "eager_input_vals"})


def _copy_meta_value(key: str, value: Any) -> Any:
    """A node.meta value for a copied graph: deep-copied, except torch's immutable fake values."""
    return value if key in _SHARED_META else copy.deepcopy(value)


def _copy_graph(graph: fx.Graph, memo: dict[int, Any]) -> fx.Graph:
    """fx's ``Graph.__deepcopy__`` (node by node, old nodes mapped to new ones in ``memo``), except that the
    codegen is copied through ``memo``: fx copies it without one, rebuilding its immutable pytree specs."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    copied = new.graph_copy(graph, memo,  # type: ignore[arg-type]  # fx's own deepcopy passes its id-keyed memo
                            return_output_node=True)
    new._codegen = copy_codegen(graph._codegen, memo)
    if copied is not None:
        value, old_output = typing.cast(tuple[Any, fx.Node], copied)  # return_output_node=True: (value, node)
        new.output(value, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
    return new


def _own_copy(model: nn.Module, share_weights: bool) -> nn.Module:
    """The copy of ``model`` a graph is captured from (same module paths, so HF parameter names survive):
    capture and passes then never change ``model`` (capture runs its forward, which may write to its
    config). ``share_weights`` keeps its parameter and buffer tensors shared, copying only the modules."""
    memo: dict[int, Any] = {}
    if share_weights:
        memo.update((id(t), t) for t in (*model.parameters(), *model.buffers()))
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise CaptureError(f"could not copy {type(model).__name__} for capture ({type(exc).__name__}: {exc}): the "
                           "graph works on its own copy so passes never change the model you pass; make the model "
                           "deep-copyable (copy.deepcopy) or hold the offending attribute outside it") from exc


class ForgeGraph:
    """A model captured into a metadata-annotated torch.fx GraphModule.

    Args:
        model: the nn.Module (or HF PreTrainedModel) to capture.
        example_inputs: a tensor, a tuple of args or a dict of kwargs; needed by the export frontend
            and by shape propagation (HF models get dummy inputs built from ``hf_input_names``).
        hf_input_names: HF forward arguments to expose, e.g. ``["input_ids", "attention_mask",
            "labels"]``; with ``labels`` the graph returns the loss as the HF model does.
        frontend: ``"fx"`` (symbolic tracing), ``"export"`` (torch.export) or ``"auto"``.
        leaf_modules: module types the fx frontend keeps as single call_module nodes.
        leaf_functions: functions the fx frontend keeps as single call_function nodes.
        dynamic: export frontend only: make every input dimension dynamic where the model allows.
        cache: reuse the graph of an identical architecture captured before (graph/capture_cache): same
            class, config, module attributes, parameter shapes and input spec; weights may differ.
        share_weights: the graph always owns its modules, so no pass changes ``model``'s structure. By default
            it also owns copies of the parameters and buffers: passes (pruning, freezing, LoRA, training)
            never change ``model``, at the cost of a second copy of the weights in memory while ``model``
            is alive. ``True`` shares the tensors themselves (no extra weight memory): pruning or training
            the graph then changes ``model``'s weights and ``requires_grad`` flags too.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any = None,
        hf_input_names: Sequence[str] | None = None,
        frontend: Frontend = "auto",
        leaf_modules: Sequence[type[nn.Module]] = (),
        leaf_functions: Sequence[Any] = (),
        dynamic: bool = True,
        cache: bool = True,
        share_weights: bool = False,
    ) -> None:
        result = capture(
            _own_copy(model, share_weights) if isinstance(model, nn.Module) else model,
            example_inputs=example_inputs,
            hf_input_names=hf_input_names,
            frontend=frontend,
            leaf_modules=tuple(leaf_modules),
            leaf_functions=tuple(leaf_functions),
            dynamic=dynamic,
            cache=cache,
        )
        self.model: fx.GraphModule = result.module
        self.frontend: str = result.frontend
        self.example_inputs: ExampleInputs | None = result.example_inputs
        self.capture_notes: tuple[str, ...] = result.notes
        self.history: list[PassRecord] = []

    @classmethod
    def from_parts(
        cls,
        module: fx.GraphModule,
        frontend: str,
        example_inputs: ExampleInputs | None = None,
        history: Sequence[PassRecord] = (),
        notes: Sequence[str] = (),
    ) -> ForgeGraph:
        """Assemble a ForgeGraph from an already captured GraphModule (used by checkpoint loading)."""
        obj = cls.__new__(cls)
        obj.model = module
        obj.frontend = frontend
        obj.example_inputs = example_inputs
        obj.capture_notes = tuple(notes)
        obj.history = list(history)
        return obj

    # -- graph access ------------------------------------------------------------------------
    @property
    def fx_graph(self) -> fx.Graph:
        """The torch.fx Graph (MASE spelling)."""
        return self.model.graph

    @property
    def nodes(self) -> Iterator[fx.Node]:
        return iter(self.model.graph.nodes)

    def node(self, name: str) -> fx.Node:
        """The node called ``name``; KeyError listing a few names otherwise."""
        for n in self.model.graph.nodes:
            if n.name == name:
                return n
        names = [n.name for n in self.model.graph.nodes]
        raise KeyError(f"no node {name!r}; nodes include {names[:10]}")

    def meta(self, node: fx.Node | str) -> NodeMeta:
        """Typed metadata of a node (by node or name)."""
        return get_meta(self.node(node) if isinstance(node, str) else node)

    def modules(self) -> dict[str, nn.Module]:
        return dict(self.model.named_modules())

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> ForgeGraph:
        """Set train/eval mode; warns when constants were folded from weights (training would not update them)."""
        folded = folded_buffers(self.model) if mode else []
        if folded:
            warnings.warn(f"this graph holds {len(folded)} constant(s) folded from weights for inference "
                          f"({folded[:3]}...): training will not update them and the weights they came from may "
                          "be gone; re-capture, or use hoist_parameter_subgraphs_transform_pass instead of "
                          "fold_constants_transform_pass for a graph you train", stacklevel=2)
        self.model.train(mode)
        return self

    def eval(self) -> ForgeGraph:
        return self.train(False)

    def recompile(self) -> None:
        """Lint and regenerate the GraphModule's code after a rewrite."""
        self.model.graph.lint()
        self.model.recompile()

    def copy(self, share_weights: bool = False) -> ForgeGraph:
        """A copy sharing nothing mutable: modules, parameters and buffers, node metadata, example inputs,
        history. ``share_weights=True`` keeps the parameter and buffer tensors shared (new modules and
        metadata all the same), e.g. for read-only trials on a large model.
        """
        memo: dict[int, Any] = spec_memo(self.model)
        memo[id(self.model.graph)] = _copy_graph(self.model.graph, memo)
        if share_weights:
            for t in (*self.model.parameters(), *self.model.buffers()):
                memo[id(t)] = t
        new = copy.deepcopy(self, memo)
        # fx copies each node's ``meta`` dict shallowly: its values would be shared with the original.
        for old_node, new_node in zip(self.model.graph.nodes, new.model.graph.nodes):
            new_node.meta = {k: _copy_meta_value(k, v) for k, v in old_node.meta.items()}
        return new

    # -- persistence and drawing ----------------------------------------------------------------
    def export(self, path: str | Path, pack: bool = True) -> Path:
        """Write a pickle-free checkpoint directory (see graph/checkpoint); ``pack=False`` keeps quantized layers'
        float weights (for QAT) instead of storing them at their format's width."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, path, pack)

    @classmethod
    def from_checkpoint(cls, path: str | Path, expected_sha256: str | None = None) -> ForgeGraph:
        """Load a checkpoint written by :meth:`export`; verifies hashes and resolves targets by allowlist.
        ``expected_sha256``: the published manifest digest (``fxforge verify`` prints it) the checkpoint must have."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, expected_sha256)

    def draw(self, path: str | Path) -> Path:
        """Write an SVG picture of the graph."""
        from .draw import draw_svg

        return draw_svg(self, path)

    def _repr_html_(self) -> str | None:
        """Jupyter: the HTML report, framed (the view report/notebook.py registers; None: plain repr)."""
        from .html_view import html_view

        return html_view(self)

    def __repr__(self) -> str:
        n = sum(1 for _ in self.model.graph.nodes)
        return f"ForgeGraph(frontend={self.frontend!r}, nodes={n}, passes={[p.name for p in self.history]})"
