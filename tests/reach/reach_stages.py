"""The reach sweep's stages for one architecture, in order: raw torch.export, fxforge capture, exact equality with
eager at two shapes, metadata passes, 8-bit quantization of every linear, checkpoint round trip; and a train-mode
check. Shared by test_reach.py (which asserts each) and sweep.py (which tabulates where each architecture stops)."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from tiny_archs import CAPTURE_SHAPE, at_capture_size, build, capture_inputs, check_inputs

from fxforge import ForgeGraph, passes
from fxforge.graph.guards import ShapeGuardError
from fxforge.graph.hf import cache_disabled

STAGES = ("capture", "equal", "metadata", "quantize", "checkpoint")
# The README's 8-bit linears: scaled integer weights per channel, asymmetric 8-bit activations (static: calibrated).
QUANT_CONFIG = {"by": "type", "default": {"config": {"name": None}},
                "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_symmetric": False,
                                      "weight_width": 8, "weight_granularity": "per_channel"}}}
# The same with dynamic activation scales: nothing needs calibration (every weight takes its scale from itself).
DYNAMIC_CONFIG = {**QUANT_CONFIG, "linear": {"config": {**QUANT_CONFIG["linear"]["config"], "data_in_dynamic": True}}}


def tensor_fields(out: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every leaf of a model output: tensors, and non-tensors (a KV cache) as they are."""
    if isinstance(out, torch.Tensor) or out is None:
        if out is not None:
            yield prefix or "out", out
    elif isinstance(out, dict):  # ModelOutput is a dict of its non-None fields
        for k, v in out.items():
            yield from tensor_fields(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(out, list | tuple):
        for i, v in enumerate(out):
            yield from tensor_fields(v, f"{prefix}[{i}]")
    else:
        yield prefix or "out", out


def assert_same_outputs(got: Any, want: Any, what: str) -> None:
    """Every tensor ``want`` (eager) returns is in ``got`` and equal bit for bit, and ``got`` has no extra tensor;
    a non-tensor field (the KV cache fxforge turns off) is skipped. AssertionError names the field and the diff."""
    g = dict(tensor_fields(got))
    w = {k: v for k, v in tensor_fields(want) if isinstance(v, torch.Tensor)}
    extra = [k for k, v in g.items() if isinstance(v, torch.Tensor) and k not in w]
    missing = [k for k in w if k not in g]
    assert not missing and not extra, f"{what}: output fields differ: missing {missing}, extra {extra}"
    for k, v in w.items():
        gv = g[k]
        assert isinstance(gv, torch.Tensor) and gv.shape == v.shape and gv.dtype == v.dtype, \
            f"{what}: {k} is {getattr(gv, 'shape', type(gv))} {getattr(gv, 'dtype', '')}, eager {v.shape} {v.dtype}"
        if not torch.equal(gv, v):
            diff = (gv.double() - v.double()).abs().max().item()
            raise AssertionError(f"{what}: {k} differs from eager (max abs diff {diff:.3g}, shape {tuple(v.shape)})")


def eager(model: nn.Module, x: dict[str, torch.Tensor]) -> Any:
    """The eager reference: ``model(**x)`` with HF's KV cache off, the computation the graph holds (capture turns
    the cache off). With it on, keys pass through DynamicCache.update's torch.cat and reach matmul contiguous
    instead of as a permuted view, another BLAS path (GPT-2, GPT-Neo, BioGPT, T5: 1e-7 to 8e-6 apart)."""
    with cache_disabled(model, []):
        return model(**x)


def _dynamic(example: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: {i: torch.export.Dim.AUTO for i in range(v.dim())} for k, v in example.items()}


def raw_export(name: str, train: bool = False) -> torch.export.ExportedProgram:
    """Plain eval-mode (``train``: train-mode) torch.export of a fresh model, dynamic in every dimension as
    fxforge captures."""
    model = build(name).train(train)
    for config in {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}.values():
        if getattr(config, "use_cache", False):
            config.use_cache = False  # a KV cache is no tensor output (fxforge turns it off the same way)
    example = capture_inputs(name)
    return torch.export.export(model, (), example, dynamic_shapes=_dynamic(example), strict=False)


def raw_equal(name: str, ep: torch.export.ExportedProgram) -> str:
    """Whether raw export's module equals eager exactly at the two check shapes ('equal' or why not)."""
    model, module = build(name), ep.module()
    for x in check_inputs(name):
        try:
            with torch.no_grad():
                assert_same_outputs(module(**x), eager(model, x), f"raw export vs eager at {_shapes(x)}")
        except Exception as exc:  # noqa: BLE001 - tabulated
            return first_line(exc)
    return "equal"


def seeded(seed: int) -> None:
    """Seed every generator a training branch may draw from (SpecAugment draws from numpy)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@dataclass
class Run:
    """One architecture's state through the stages (each stage fills what the next needs)."""

    name: str
    model: nn.Module = field(init=False)
    graph: ForgeGraph | None = None
    meta: ForgeGraph | None = None
    cases: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the inputs `equal` checked
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = build(self.name)

    def capture(self) -> None:
        self.graph = ForgeGraph(self.model, example_inputs=capture_inputs(self.name))
        assert self.graph.frontend == "export", self.graph.capture_notes

    def equal(self) -> None:
        """The eval graph equals eager bit for bit at both check shapes, with grads off and on (a kernel may branch
        on grad mode: CPU SDPA leaves its flash kernel when T5's learned position bias in the mask requires grad,
        4.8e-7 apart, and the graph must take the same branch as eager)."""
        assert self.graph is not None
        self.graph.eval()
        raw: nn.Module | None = None
        for batch, x in enumerate(check_inputs(self.name)):
            try:
                with torch.no_grad():
                    self.graph(**x)
            except ShapeGuardError as exc:
                # A size raw torch.export fixes as well is torch.export's limit, not fxforge's: noted, and this
                # batch is checked at the captured sizes instead (the captured batch too if that is fixed as
                # well); a size only fxforge fixes fails the stage.
                raw = raw or raw_export(self.name).module()
                try:
                    with torch.no_grad():
                        raw(**x)
                except Exception as raw_exc:  # noqa: BLE001 - raw export rejects these sizes too
                    self.notes.append(f"static dim shared with torch.export ({first_line(raw_exc)})")
                else:
                    raise AssertionError(f"raw torch.export runs {_shapes(x)}, the graph refuses it: "
                                         f"{first_line(exc)}") from exc
                x = at_capture_size(self.name, len(next(iter(x.values()))), seed=7 + batch)
                try:
                    with torch.no_grad():
                        self.graph(**x)
                except ShapeGuardError:  # the batch size is fixed as well (raw export refused it above)
                    x = at_capture_size(self.name, CAPTURE_SHAPE[0], seed=7 + batch)
            self.cases.append(x)
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    got, want = self.graph(**x), eager(self.model, x)
                assert_same_outputs(got, want, f"eval graph vs eager ({'grad' if grad else 'no_grad'}) at "
                                               f"{_shapes(x)}")

    def metadata(self) -> None:
        assert self.graph is not None
        mg, _ = passes.init_metadata_analysis_pass(self.graph.copy())
        mg, _ = passes.add_common_metadata_analysis_pass(mg)
        self.meta = mg

    def quantize(self) -> None:
        """Every linear node to 8 bits and run: with dynamic activation scales (no calibration needed), then with
        static ones after calibrating on the capture's and the checked inputs."""
        assert self.meta is not None
        linears = sum(1 for n in self.meta.nodes if self.meta.meta(n).common.op == "linear")
        cases = self.cases
        for config in (DYNAMIC_CONFIG, QUANT_CONFIG):
            q, info = passes.quantize_transform_pass(self.meta, config)
            done = info.by_op.get("linear", 0)
            assert linears > 0 and done == linears, f"quantized {done} of the graph's {linears} linear nodes"
            if config is QUANT_CONFIG:
                q, _ = passes.calibrate_transform_pass(q, {"data": [capture_inputs(self.name), *cases]})
            q.eval()
            for x in cases:
                with torch.no_grad():
                    out = q(**x)
                for k, v in tensor_fields(out):
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        assert torch.isfinite(v).all(), f"quantized output {k} is not finite at {_shapes(x)}"
        self.notes.append(f"{linears} linears quantized")

    def checkpoint(self) -> None:
        assert self.graph is not None
        with tempfile.TemporaryDirectory() as tmp:
            self.graph.eval().export(Path(tmp) / "ckpt")
            back = ForgeGraph.from_checkpoint(Path(tmp) / "ckpt").eval()
            for x in self.cases:
                with torch.no_grad():
                    assert_same_outputs(back(**x), self.graph(**x), f"reloaded vs captured at {_shapes(x)}")

    def stage(self, stage: str) -> Callable[[], None]:
        return getattr(self, stage)  # type: ignore[no-any-return]

    def train_check(self) -> str:
        """Train mode, same seeds, grads on, at the shapes `equal` checked (the capture's if it did not run):
        'equal', 'refused: <error>' (``train()`` or the train-mode forward refused training by name), 'forward
        failed: <error>' or 'differs: <field and diff>' (train graph vs train eager, both without KV cache).
        Inputs eager cannot train on are skipped."""
        assert self.graph is not None
        g = self.graph.copy()
        try:
            g.train()
        except Exception as exc:  # noqa: BLE001 - a loud refusal is one of the accepted outcomes
            return f"refused: {first_line(exc)}"
        for x in self.cases or [capture_inputs(self.name)]:
            try:
                seeded(0)
                got = g(**x)
            except Exception as exc:  # noqa: BLE001 - a refusal to train is accepted, any other error is not
                if "Training" in type(exc).__name__ or "train mode" in str(exc):
                    return f"refused: {first_line(exc)}"
                if self._eager_train_fails(x):
                    continue  # these inputs cannot train eager either (BatchNorm over one value per channel)
                return f"forward failed: {first_line(exc)}"
            self.model.train()
            try:
                seeded(0)
                want = eager(self.model, x)
            finally:
                self.model.eval()
            try:
                assert_same_outputs(got, want, f"train graph vs eager at {_shapes(x)}")
            except AssertionError as exc:
                return f"differs: {first_line(exc)}"
        return "equal"

    def _eager_train_fails(self, x: dict[str, torch.Tensor]) -> bool:
        self.model.train()
        try:
            seeded(0)
            eager(self.model, x)
        except Exception:  # noqa: BLE001 - any eager failure: the inputs are not trainable
            return True
        finally:
            self.model.eval()
        return False


def first_line(exc: BaseException) -> str:
    """The error's type and first line (two lines when the first ends in ':', as a CaptureError's does)."""
    text = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    head = " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    return f"{type(exc).__name__}: {head}"[:400]


def _shapes(x: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k}{tuple(v.shape)}" for k, v in x.items())
