"""StageRegion: one pipeline stage of a split graph, a small fx graph over the very modules it calls.

A stage is stored the way an activation-checkpointed region is (passes/memory/checkpoint_region.py: its body as
checkpoint JSON, its children as aliases of the layers where they live), so a split graph saves and loads like any
other (its own class: code that finds checkpointed regions must not find stages); unlike that region it runs its
body as is, with or without grad. Tensors the stage reads from its layers
(buffers such as rotary tables, parameters read by get_attr) are fetched from its children when it runs and handed
to the body as trailing inputs: the body holds no get_attr, whose targets a checkpoint could not check before the
layers are restored.
"""

from __future__ import annotations

from typing import Any, cast

import torch.fx as fx
import torch.nn as nn

from ...graph import targets
from ..memory.checkpoint_region import CheckpointRegion, _from_config, _to_config

__all__ = ["StageRegion", "build_stage"]


class StageRegion(nn.Module):
    """Runs ``graph`` over its children ``m0, m1, ...``: the stage's inputs, then ``reads`` (child, attribute)
    fetched from the children, as the body's placeholders (``inputs`` counts both); a tuple out."""

    pipeline_stage = True  # the "pipeline-stages" graph property (passes/contract.py)

    def __init__(self, graph: fx.Graph, children: dict[str, nn.Module], inputs: int,
                 reads: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__()
        for name, module in children.items():
            self.add_module(name, module)
        self.inputs = inputs + len(reads)
        self.reads = tuple(reads)
        self._graph = graph
        self._body: tuple[tuple[int, ...], fx.GraphModule] | None = None

    def body(self) -> fx.GraphModule:
        """The graph as a GraphModule over the current children (rebuilt when a child was replaced, e.g. by a
        checkpoint's module aliases or a copy)."""
        key = tuple(id(m) for m in self._modules.values())
        if self._body is None or self._body[0] != key:
            self._body = (key, fx.GraphModule(self, self._graph, class_name="StageRegionBody"))
        return self._body[1]

    def forward(self, *args: Any) -> Any:
        expected = self.inputs - len(self.reads)
        if len(args) != expected:
            raise TypeError(f"StageRegion takes {expected} inputs, got {len(args)}")
        fetched = [getattr(self.get_submodule(child), attr) for child, attr in self.reads]
        return self.body()(*args, *fetched)


def _stage_to_config(stage: StageRegion) -> dict[str, Any]:
    """The checkpoint region's JSON of the body and children (the same shape: it reads only those), and the reads."""
    return {"region": _to_config(cast(CheckpointRegion, stage)), "reads": [list(r) for r in stage.reads]}


def _stage_from_config(config: dict[str, Any]) -> StageRegion:
    """Rebuild from :func:`_stage_to_config`'s JSON (hostile: the region's loader checks the body, every read
    names a child and an identifier)."""
    if not isinstance(config, dict) or set(config) != {"region", "reads"} or not isinstance(config["reads"], list):
        raise targets.CheckpointError("StageRegion config: expected 'region' and a list of 'reads'")
    region = _from_config(config["region"])
    reads = config["reads"]
    if not all(isinstance(r, list) and len(r) == 2 and r[0] in region._modules and targets.is_identifier(r[1])
               for r in reads) or len(reads) > region.inputs:
        raise targets.CheckpointError("StageRegion config: a read names no child or no identifier")
    stage = StageRegion(fx.Graph(), dict(region.named_children()), region.inputs - len(reads),
                        tuple((str(c), str(a)) for c, a in reads))
    stage._graph = region._graph
    return stage


def build_stage(gm: fx.GraphModule, graph: fx.Graph, inputs: int) -> StageRegion:
    """A StageRegion over ``graph`` (its first ``inputs`` placeholders are the stage's inputs) whose call_module and
    get_attr targets are paths in ``gm``: each module called or read from becomes a child ``m<i>`` (the same object);
    each get_attr becomes a trailing placeholder fed from that child. ValueError for a tensor of the root itself."""
    children: dict[str, nn.Module] = {}
    local: dict[str, str] = {}

    def child(path: str) -> str:
        if path not in local:
            local[path] = f"m{len(local)}"
            children[local[path]] = gm.get_submodule(path)
        return local[path]

    reads: list[tuple[str, str]] = []
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1] if inputs else None
    for node in list(graph.nodes):
        if node.op == "call_module":
            node.target = child(str(node.target))
        elif node.op == "get_attr":
            owner, _, attr = str(node.target).rpartition(".")
            if not owner:
                raise ValueError(f"node {node.name!r} reads {node.target!r}, a tensor of the graph's root, which a "
                                 "stage cannot alias")
            reads.append((child(owner), attr))
            anchor = last_input if last_input is not None else next(iter(graph.nodes))
            with (graph.inserting_after(anchor) if last_input is not None else graph.inserting_before(anchor)):
                placeholder = graph.placeholder(node.name)
            last_input = placeholder
            node.replace_all_uses_with(placeholder)
            graph.erase_node(node)
    return StageRegion(graph, children, inputs, tuple(reads))


targets.register_module(StageRegion, _stage_to_config, _stage_from_config, name="fxforge.StageRegion")
