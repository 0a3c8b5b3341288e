"""The memory timeline of a graph: live activation bytes at each node, from liveness_analysis_pass's records.

Each LivenessRecord names a buffer (a storage group) with the node indices it is born and dies at, its
bytes, and whether autograd saves it for backward (then, in training, it stays alive to the end of the
forward); ``others`` lists a node's further buffers. Summing every distinct buffer over its lifetime gives
the inference and training curves whose maxima are the pass's peak estimates. Records come from
checkpoints too, so every field is checked before it is used (a bad or stale record raises ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..graph.metadata import get_meta, has_meta

__all__ = ["LiveBuffer", "MemoryTimeline", "memory_timeline"]


@dataclass(frozen=True)
class LiveBuffer:
    """One buffer: the node that created it, its lifetime (node indices) and size, saved for backward or not."""

    node: str
    born: int
    dies: int
    bytes: int
    saved: bool


@dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes per node (graph order) in inference and in training, the peaks, the buffers alive there."""

    nodes: tuple[str, ...]
    inference: tuple[int, ...]
    training: tuple[int, ...]
    peak_inference: int  # node index of the (first) maximum
    peak_training: int
    at_inference_peak: tuple[LiveBuffer, ...]  # largest first, at most ``top``
    at_training_peak: tuple[LiveBuffer, ...]

    @property
    def peak_inference_bytes(self) -> int:
        return self.inference[self.peak_inference]

    @property
    def peak_training_bytes(self) -> int:
        return self.training[self.peak_training]


def _int(value: Any, what: str, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"liveness record {what} must be an integer in [{low}, {high if high is not None else '∞'}], "
                         f"got {str(value)[:40]!r}")
    return value


def _buffer(entry: Any, node: str, index: int, count: int) -> tuple[int, LiveBuffer]:
    """``(buffer id, LiveBuffer)`` of one [born, dies, bytes, buffer, saved] entry of ``node`` (at ``index``)."""
    if not isinstance(entry, list | tuple) or len(entry) != 5:
        raise ValueError(f"liveness record of node {node!r}: a buffer must be [born, dies, bytes, buffer, saved]")
    born = _int(entry[0], f"{node!r} born", 0, count - 1)
    dies = _int(entry[1], f"{node!r} dies", born, count - 1)
    size = _int(entry[2], f"{node!r} bytes", 0, None)
    ident = _int(entry[3], f"{node!r} buffer", 0, None)
    if entry[4] not in (True, False, 0, 1):
        raise ValueError(f"liveness record of node {node!r}: saved must be a bool, got {str(entry[4])[:40]!r}")
    if not born <= index <= dies:  # a node's buffers are born at or before it and live at least until it runs
        raise ValueError(f"liveness record of node {node!r} does not match the graph (born {born}, dies {dies}, node "
                         f"at {index}): the graph changed after liveness_analysis_pass; run it again")
    return ident, LiveBuffer(node, born, dies, size, bool(entry[4]))


def _alive(buffers: list[LiveBuffer], at: int, training: bool, top: int) -> tuple[LiveBuffer, ...]:
    """The ``top`` largest buffers alive at node index ``at``."""
    alive = [b for b in buffers if b.born <= at and (at <= b.dies or (training and b.saved))]
    return tuple(sorted(alive, key=lambda b: (-b.bytes, b.born))[:top])


def memory_timeline(mg: ForgeGraph, top: int = 8) -> MemoryTimeline | None:
    """The timeline of ``mg`` from its LivenessRecords, or None when liveness_analysis_pass has not run on it;
    ValueError when a record is malformed or does not match the graph."""
    from ..passes.analysis.liveness import LivenessRecord, live_bytes

    nodes = list(mg.model.graph.nodes)
    count = len(nodes)
    found: dict[int, LiveBuffer] = {}
    for index, node in enumerate(nodes):
        rec = get_meta(node).software.get(LivenessRecord) if has_meta(node) else None
        if rec is None:
            continue
        if not isinstance(rec.others, list | tuple):
            raise ValueError(f"liveness record of node {node.name!r}: others must be a list")
        main = [rec.born, rec.dies, rec.bytes, rec.buffer, rec.saved_for_backward]
        for entry in (main, *rec.others):
            ident, buf = _buffer(entry, node.name, index, count)
            found.setdefault(ident, buf)  # the first node holding a buffer in graph order created it
    if not found:
        return None
    buffers = list(found.values())
    # the pass's own curve computation over the recorded buffers (each to its death, saved ones to the end)
    inference, training = (curve[:count] for curve in live_bytes(
        {k: [b.born, b.dies, b.bytes, b.saved] for k, b in enumerate(buffers)}, count - 1))
    peak_i = max(range(count), key=lambda i: inference[i])
    peak_t = max(range(count), key=lambda i: training[i])
    return MemoryTimeline(tuple(n.name for n in nodes), tuple(inference), tuple(training), peak_i, peak_t,
                          _alive(buffers, peak_i, False, top), _alive(buffers, peak_t, True, top))
