"""Capture frontends: torch.fx symbolic tracing and torch.export, behind one entry point.

Both produce the same IR (graph/normalize): parametrized layers as call_module nodes on real
submodules named by their original paths, other ops as function/method nodes. Tracing runs in train mode
(dropout stays switchable); training-only behaviour no switch restores is captured in eval semantics with
train mode refused (graph/training_only, graph/training_guard). A model that cannot be captured gets a
:class:`CaptureError` naming the module and source line that failed and what to try.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import re
import traceback
from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from . import capture_cache
from .capture_cache import architecture_key
from .dropout_tracing import DropoutTracing
from .grad_mode import GRAD_MODE_HINT, GradModeSwitchError, refuse_grad_mode_switches
from .guards import guard_spec, insert_guard
from .hf import KNOWN_INPUTS, cache_disabled, default_input_names, hf_dummy_inputs, is_hf_model
from .inputs import ExampleInputs
from .normalize import normalize
from .training_guard import insert_training_guard
from .training_only import (
    EvalSemantics,
    TrainingCaptureError,
    differs_cause,
    eval_mode_capture,
    eval_outputs,
    output_difference,
    rng_kept,
    train_mode_capture,
)

Frontend = Literal["auto", "fx", "export"]
FRONTENDS: tuple[str, ...] = ("auto", "fx", "export")
CACHE_HIT_NOTE = ("capture cache hit: reused the graph captured for the same architecture (class, config, input "
                  "spec), bound to this model's weights")


class CaptureError(RuntimeError):
    """A model could not be captured; the message names where and what to try."""


@dataclass(frozen=True)
class CaptureResult:
    module: fx.GraphModule
    frontend: str
    example_inputs: ExampleInputs | None
    notes: tuple[str, ...]


class _ForgeTracer(fx.Tracer):
    """fx tracer with user leaf modules/functions that remembers which module it is inside."""

    def __init__(self, leaf_modules: tuple[type[nn.Module], ...], leaf_functions: tuple[Any, ...]) -> None:
        super().__init__(autowrap_functions=leaf_functions)
        self.leaf_modules = leaf_modules
        self.path: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_modules and isinstance(m, self.leaf_modules):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.path.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.path.pop()


_TORCH_DIR = str(Path(torch.__file__).parent)
_GRAPH_DIR = str(Path(__file__).parent) + "/"  # fxforge's own capture frames hold the model too


@dataclass(frozen=True)
class _Site:
    path: str
    cls: str
    where: str

    def describe(self) -> str:
        return f"module '{self.path}' ({self.cls}){self.where}" if self.path else "the model's forward"


def _site_in(tb: TracebackType | None, names: dict[int, str]) -> _Site | None:
    """The innermost frame of one traceback running model code inside one of the model's modules."""
    site = None
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(owner, nn.Module) and id(owner) in names and \
                not code.co_filename.startswith((_TORCH_DIR, _GRAPH_DIR)):
            src = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            where = f" at {Path(code.co_filename).name}:{tb.tb_lineno} `{src}`"
            site = _Site(names[id(owner)] or "<root>", type(owner).__name__, where)
        tb = tb.tb_next
    return site


def _failure_site(exc: BaseException, model: nn.Module) -> _Site:
    """Where ``exc`` was raised: the innermost model frame of its own traceback; only when it has none, of
    the exception it was raised from (``__cause__``) or while handling (``__context__``, unless suppressed)
    -- an earlier exception caught by the model is not where the capture failed."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        site = _site_in(chain.__traceback__, names)
        if site is not None:
            return site
        chain = chain.__cause__ or (None if chain.__suppress_context__ else chain.__context__)
    return _Site("", "", "")


def _short(exc: BaseException) -> str:
    if isinstance(exc, TrainingCaptureError):  # its message already names the errors it stands for
        return str(exc)
    lines = [ln for ln in traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) < 400 else text[:400] + " ..."


_OUTPUT_TYPE = re.compile(r"Found <class '([\w.]+)'> in output")
_INPUT_WORDS = ("must specify", "have to specify", "specify either", "missing", "required positional argument",
                "unexpected keyword argument")


def _cause_hint(exc: BaseException, hf: bool) -> str | None:
    """A remedy matching what actually failed (None: no specific knowledge of this failure)."""
    if isinstance(exc, GradModeSwitchError):
        return GRAD_MODE_HINT
    if isinstance(exc, TrainingCaptureError):  # the eval-mode failure is what is left to fix
        return _cause_hint(exc.eval_error, hf)
    text = str(exc)
    m = _OUTPUT_TYPE.search(text)
    if m:
        what = "fxforge turns HF's use_cache off itself, so this is another output" if hf else \
            "fxforge keeps tensors, tuples, lists, dicts, dataclass/HF ModelOutput outputs as they are"
        return (f"the model returns a {m.group(1)}, which is not a tensor or a container of tensors, so no graph can "
                f"output it ({what}): return its tensors instead, or register {m.group(1).rsplit('.', 1)[-1]} with "
                "torch.utils._pytree.register_pytree_node")
    if "data-dependent" in text or "data dependent" in text or type(exc).__name__ == "GuardOnDataDependentSymNode":
        return "control flow depends on tensor values: make it independent of them (torch.where, torch.cond)"
    if isinstance(exc, ValueError | TypeError) and any(w in text for w in _INPUT_WORDS):
        names = f"hf_input_names (allowed: {list(KNOWN_INPUTS)})" if hf else "example_inputs"
        return f"the model rejected the inputs it was traced with: give it the inputs its forward needs via {names}"
    return None


def _trace_fx(model: nn.Module, leaf_modules: tuple[type[nn.Module], ...],
              leaf_functions: tuple[Any, ...]) -> fx.GraphModule:
    tracer = _ForgeTracer(leaf_modules, leaf_functions)
    with refuse_grad_mode_switches():  # fx would drop a no_grad region (graph/grad_mode)
        graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)


def _dynamic_shapes(example: ExampleInputs, model: nn.Module | None = None) -> tuple[Any, ...] | dict[str, Any]:
    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {i: torch.export.Dim.AUTO for i in range(v.dim())}
        return None

    if example.kwargs and not example.args:
        return {k: spec(v) for k, v in example.kwargs.items()}
    specs = [spec(v) for v in example.args]
    # torch.export binds the args to forward's signature: a ``*args`` parameter takes its specs as one tuple
    params = list(inspect.signature(model.forward).parameters.values()) if model is not None else []
    star = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    if star is not None and star <= len(specs):
        specs = [*specs[:star], tuple(specs[star:])]
    return (*specs, *[spec(v) for v in example.kwargs.values()])


def _trace_export(model: nn.Module, example: ExampleInputs,
                  dynamic: bool) -> tuple[fx.GraphModule, tuple[tuple[str, ...], list[Any], list[str]]]:
    """The exported module and its shape guards (names, checks, notes; see graph/guards)."""
    shapes = _dynamic_shapes(example, model) if dynamic else None
    if isinstance(shapes, tuple) and example.kwargs:
        shapes = None  # mixed args/kwargs: let export infer static shapes
    with DropoutTracing():  # dropout traced by cheap stand-in ops (graph/dropout_tracing)
        ep = torch.export.export(model, example.args, example.kwargs or None, dynamic_shapes=shapes, strict=False)
    gm = ep.module()
    return gm, guard_spec(gm, ep.range_constraints, getattr(ep, "_guards_code", []), shapes is not None)


def _trace_normalized(model: nn.Module, frontend: str, example: ExampleInputs | None, dynamic: bool,
                      leaf_modules: tuple[type[nn.Module], ...], leaf_functions: tuple[Any, ...]
                      ) -> tuple[fx.GraphModule, tuple[tuple[Any, ...] | None, list[str]]]:
    """One trace of ``model`` in its current modes, normalised: (graph, (shape guards or None, notes))."""
    notes: list[str] = []
    guards = None
    if frontend == "fx" or example is None:
        gm = _trace_fx(model, leaf_modules, leaf_functions)
    else:
        gm, guards = _trace_export(model, example, dynamic)
    return normalize(gm, model, notes), (guards, notes)


def _finish(gm: fx.GraphModule, model: nn.Module, guards: tuple[Any, ...] | None, taken: EvalSemantics,
            notes: list[str]) -> None:
    """Insert a trace's shape guards and its training guard, add their notes to ``notes``, recompile."""
    if guards is not None:  # torch.export's shape guards, kept as a checkpointable check
        insert_guard(gm, guards[0], guards[1])
        notes.extend(guards[2])
    if taken.causes or taken.whole_model:  # train mode refuses (graph/training_guard)
        insert_training_guard(gm, taken.labelled(model))
    notes.extend(taken.notes(model))
    gm.recompile()


def _eval_checked(model: nn.Module, example: ExampleInputs, trace: Any, gm: fx.GraphModule, taken: EvalSemantics,
                  notes: list[str]) -> tuple[fx.GraphModule, list[str]]:
    """The captured graph checked against eager in eval mode at the example inputs (graph/training_only): when it
    differs, the whole model captured in eval semantics if that one equals eager exactly, else ``gm`` with a note
    of the difference. Costs one eager and one graph forward when they agree."""
    args, kwargs = example.args, dict(example.kwargs)
    try:
        want = eval_outputs(model, args, kwargs)
        difference = output_difference(want, eval_outputs(gm, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - the capture stands; the note says it is unchecked
        return gm, [*notes, f"not checked against eager in eval mode: running it failed ({_short(exc)})"]
    if difference is None:
        return gm, notes
    kept = (f"the captured graph differs from eager in eval mode at the example inputs ({difference}); kept "
            "as captured")
    if taken.whole_model:
        return gm, [*notes, kept]
    try:
        gm2, (guards2, notes2), taken2 = eval_mode_capture(model, trace, differs_cause(difference))
        _finish(gm2, model, guards2, taken2, notes2)
        again = output_difference(want, eval_outputs(gm2, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - the train-mode capture stands, with the difference noted
        return gm, [*notes, f"{kept}: capturing it in eval mode failed ({_short(exc)})"]
    if again is None:
        return gm2, notes2
    return gm, [*notes, f"{kept}: captured in eval mode it differs too ({again}), so the difference is numeric "
                        "(e.g. another BLAS path), not training-dependent behaviour"]


def _site_path(site: _Site) -> tuple[str | None, str]:
    """(module path of a failure site, or None when it is in no module; where it is) for training_only."""
    return ("" if site.path == "<root>" else site.path or None), site.where


def capture(
    model: nn.Module,
    example_inputs: Any = None,
    hf_input_names: Sequence[str] | None = None,
    frontend: str = "auto",
    leaf_modules: tuple[type[nn.Module], ...] = (),
    leaf_functions: tuple[Any, ...] = (),
    dynamic: bool = True,
    cache: bool = True,
) -> CaptureResult:
    """Capture ``model`` into the fxforge IR with the requested frontend (see ForgeGraph)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ForgeGraph needs an nn.Module, got {type(model).__name__}")
    if frontend not in FRONTENDS:
        raise ValueError(f"unknown frontend {frontend!r}; allowed: {list(FRONTENDS)}")
    bad_leaves = [m for m in leaf_modules if not (isinstance(m, type) and issubclass(m, nn.Module))]
    if bad_leaves:
        raise TypeError(f"leaf_modules must be nn.Module subclasses, got {bad_leaves}")

    private = [getattr(f, "__name__", repr(f)) for f in leaf_functions if getattr(f, "__name__", "_").startswith("_")]
    if private:
        raise ValueError(f"leaf_functions {private}: torch.fx only wraps module-level functions whose name "
                         "does not start with '_'")
    hf = is_hf_model(model)
    if hf_input_names is not None and not hf:
        raise ValueError("hf_input_names is only for HuggingFace models; pass example_inputs instead")
    example = None if example_inputs is None else ExampleInputs.coerce(example_inputs)
    if hf and example is None:
        names = tuple(hf_input_names) if hf_input_names is not None else default_input_names(model)
        example = ExampleInputs(kwargs=hf_dummy_inputs(model, names))

    order = ["export"] if frontend == "auto" and hf else (["fx", "export"] if frontend == "auto" else [frontend])
    notes: list[str] = []
    key: Hashable | None = None
    if cache:
        settings = (tuple(order), dynamic, leaf_modules, leaf_functions, hf)
        key, why = architecture_key(model, example, settings)
        hit = None if key is None else capture_cache.lookup(key, model)
        if hit is not None:
            return CaptureResult(hit[0], hit[1], example, (*hit[2], CACHE_HIT_NOTE))
        if why:
            notes.append(why)
    failures: list[str] = []
    sites: list[_Site] = []
    errors: list[BaseException] = []
    was_training = model.training
    # Trace in train mode so every dropout probability is visible; normalization makes it switchable.
    model.train()
    try:
        # Grad enabled: under a caller's no_grad, export would record no no_grad region (gradients would differ).
        with rng_kept(), cache_disabled(model, notes) if hf else nullcontext(), torch.enable_grad():
            # Every frontend in train mode first; only when all fail, again taking failing training branches in
            # eval semantics (graph/training_only): a frontend that traces the training branch is better.
            for in_eval in (False, True):
                failures, sites, errors = [], [], []
                for name in order:
                    if name != "fx" and example is None:
                        failures.append("export: needs example_inputs (a tensor, tuple of args or dict of kwargs)")
                        continue
                    try:
                        trace = functools.partial(_trace_normalized, model, name, example, dynamic, leaf_modules,
                                                  leaf_functions)
                        gm, (guards, traced_notes), taken = train_mode_capture(
                            model, trace, lambda exc: _site_path(_failure_site(exc, model)), in_eval)
                    except Exception as exc:  # noqa: BLE001 - reported with context below
                        site = _failure_site(exc, model)
                        sites.append(site)
                        errors.append(exc)
                        failures.append(f"{name}: failed in {site.describe()}: {_short(exc)}")
                        continue
                    if failures:
                        notes.append(f"fell back to {name} after " + "; ".join(failures))
                    _finish(gm, model, guards, taken, traced_notes)
                    if example is not None:  # not on a cache hit: a hit returned above
                        gm, traced_notes = _eval_checked(model, example, trace, gm, taken, traced_notes)
                    notes.extend(traced_notes)
                    gm.train(was_training)
                    if key is not None:
                        capture_cache.store(key, gm, model, name, tuple(notes))
                    return CaptureResult(gm, name, example, tuple(notes))
    finally:
        model.train(was_training)

    hints = [h for h in (_cause_hint(e, hf) for e in errors) if h]
    leaf = next((x.cls for x in sites if x.path and x.path != "<root>"), "")
    if not hints and leaf:
        hints = [f"keep the failing module whole with leaf_modules=[{leaf}] (fx frontend)"]
    elif not hints:
        hints = ["the failure is in the top-level forward: make its control flow independent of tensor values"]
    if "export" not in order:
        hints.append("try frontend='export' with example_inputs")
    elif example is None:
        hints.append("pass example_inputs so the export frontend can run")
    if "fx" not in order and not hf:
        hints.append("try frontend='fx'")
    raise CaptureError(
        f"could not capture {type(model).__name__}:\n  " + "\n  ".join(failures) + "\nTry: " + "; ".join(hints)
    )
