"""Content keys of a plan's prefix (the steps before its fine-tune, and the fine-tune): what the prefix
cache (:mod:`fxforge.search.prefix_cache`) files an entry under.

A key hashes everything the prefix's result depends on: the base graph's state (weights, buffers,
structure, node metadata, history, example inputs), the prefix steps as canonical JSON, whether it
trains, the task's data the prefix reads (calibration batches; for training the train arguments and
train/eval data) and the checkpoint format. Anything that cannot be hashed by content (a NAS plan's
freshly built model, a custom task without a ``prefix_fingerprint()``, a callable among the train
arguments) makes the prefix unkeyable, so it is recomputed rather than ever served from a wrong entry.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import SearchError

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph
    from .space import TrialPlan
    from .task import Task

__all__ = ["Unkeyable", "canonical", "graph_fingerprint", "prefix_key", "task_fingerprint"]

LAYOUT_VERSION = 1  # of the cache entry (manifest fields, file names); bumped when either changes


class Unkeyable(Exception):
    """The prefix depends on something that cannot be hashed by content: it is not cached."""


def _tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a dense tensor's dtype, shape and bytes."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise Unkeyable(f"a {t.layout} / quantized / meta tensor cannot be hashed by content")
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{flat.dtype}:{tuple(t.shape)}:".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def canonical(value: Any) -> Any:
    """``value`` as JSON-able data in which tensors, graphs and modules stand as their content digests;
    Unkeyable for anything else (a callable, an open file...) whose content is not its data."""
    from ..graph.forge_graph import ForgeGraph

    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": _tensor_digest(value)}
    if isinstance(value, ForgeGraph):
        return {"graph": graph_fingerprint(value)}
    if isinstance(value, torch.nn.Module):
        return {"module": f"{type(value).__module__}.{type(value).__qualname__}",
                "state": {k: _tensor_digest(v) for k, v in value.state_dict().items()}}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise Unkeyable("a mapping with non-string keys")
        return {k: canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, Sequence | set | frozenset) and not isinstance(value, bytes | bytearray):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [canonical(v) for v in items]
    raise Unkeyable(f"a {type(value).__name__} has no content hash")


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def graph_fingerprint(graph: ForgeGraph) -> str:
    """SHA-256 of a graph's state: its code, module classes, every parameter and buffer (persistent or
    not), node metadata, pass history and example inputs. Costs one read of the weights."""
    from ..graph.metadata import get_meta, has_meta

    gm = graph.model
    tensors = {f"p:{k}": _tensor_digest(v) for k, v in gm.named_parameters(remove_duplicate=False)}
    tensors.update({f"b:{k}": _tensor_digest(v) for k, v in gm.named_buffers(remove_duplicate=False)})
    for node in gm.graph.nodes:  # plain tensor attributes read by get_attr (folded constants)
        if node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), torch.Tensor):
            tensors.setdefault(f"a:{node.target}", _tensor_digest(getattr(gm, str(node.target))))
    ex = graph.example_inputs
    doc = {
        "code": gm.code, "frontend": graph.frontend, "tensors": tensors,
        "modules": [[n, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr()]
                    for n, m in gm.named_modules(remove_duplicate=False)],
        "meta": {n.name: canonical(get_meta(n).to_json()) for n in gm.graph.nodes if has_meta(n)},
        "history": canonical([r.to_json() for r in graph.history]),
        "inputs": None if ex is None else canonical({"args": list(ex.args), "kwargs": dict(ex.kwargs)}),
    }
    return _digest(doc)


def _dataset_digest(split: Any) -> str:
    """SHA-256 of a ``datasets.Dataset``'s rows (content, not the library's fingerprint)."""
    return _digest(split.to_dict())


def task_fingerprint(task: Task | None, train: bool) -> dict[str, Any]:
    """What of ``task`` a prefix reads: its calibration batches (taylor pruning, quantizer calibration) and,
    when the prefix trains, how it trains: a task's own ``prefix_fingerprint()`` (any JSON-able value that
    changes whenever its training would), else TensorTask's or TextClassificationTask's arguments and data
    (their own ``train``, not a subclass's). Unkeyable when the task trains but says nothing about how."""
    from .task import Task, TensorTask, TextClassificationTask

    if task is None:
        return {"task": None}
    inner = getattr(task, "inner", None)
    if isinstance(inner, Task):  # a multi-fidelity view: trains its inner task to its schedule's last steps
        to_json = getattr(getattr(task, "fidelity", None), "to_json", None)
        if not callable(to_json):
            raise Unkeyable(f"{type(task).__name__} wraps a task with no fidelity schedule to key on")
        return {**task_fingerprint(inner, train), "fidelity": canonical(to_json()) if train else None}
    try:
        calib: Any = [canonical(list(b)) for b in task.calibration_batches()]
    except SearchError:  # no calibration data: passes fall back to the graph's example inputs (in the base key)
        calib = None
    out: dict[str, Any] = {"task": f"{type(task).__module__}.{type(task).__qualname__}", "calibration": calib}
    if not train:
        return out
    own, recipe = getattr(task, "prefix_fingerprint", None), type(task).train  # a subclass's own train: its own say
    if callable(own):
        out["training"] = canonical(own())
    elif recipe is TensorTask.train:
        assert isinstance(task, TensorTask)
        out["training"] = {"train": canonical([list(b) for b in task.training_batches or ()]),
                           "steps": task.train_steps, "learning_rate": task.learning_rate}
    elif recipe is TextClassificationTask.train:
        assert isinstance(task, TextClassificationTask)
        out["training"] = {
            "train_args": canonical(task.train_args), "train": _dataset_digest(task.data["train"]),
            "test": _dataset_digest(task.data["test"]), "max_length": task.max_length,
            "eval_batch_size": task.eval_batch_size, "report_every": task.report_every,
            "tokenizer": str(getattr(task.tokenizer, "name_or_path", type(task.tokenizer).__name__))}
    else:
        raise Unkeyable(f"{type(task).__name__} trains but defines no prefix_fingerprint()")
    return out


def prefix_key(base_fingerprint: str, plan: TrialPlan, task_doc: Mapping[str, Any], reports: bool,
               extra: Any = None) -> str:
    """The cache key of ``plan``'s prefix on a base with ``base_fingerprint`` (see the module docstring);
    ``reports``: whether the fine-tune reports to a trial (an entry then replays the reported values);
    ``extra``: anything else the caller's prefix depends on (e.g. a multi-fidelity training budget)."""
    from ..graph.checkpoint_load import CHECKPOINT_SCHEMA_VERSION
    from ..graph.metadata import SCHEMA_VERSION as METADATA_SCHEMA_VERSION

    if plan.model_config is not None:
        raise Unkeyable("a NAS plan builds a fresh model: there is no base graph to key it on")
    doc = {
        "layout": LAYOUT_VERSION, "checkpoint": CHECKPOINT_SCHEMA_VERSION, "metadata": METADATA_SCHEMA_VERSION,
        "torch": torch.__version__, "base": base_fingerprint,
        "steps": [[name, canonical(dict(args))] for name, args in plan.before_training()],
        "qat": plan.qat, "train": plan.train, "task": dict(task_doc), "reports": reports, "extra": canonical(extra),
    }
    return _digest(doc)
