"""Each timed runtime in its own worker process, driven round by round by the benchmark that owns it.

Why: ONNX Runtime's and torch's thread pools living in one process on two cores interfere (ORT's workers keep
spinning after a run while torch's OpenMP threads start the next variant); session 16 saw ratios move 2-7x with
that alone. One process per runtime is how each is deployed. Idle workers block on a pipe, and a settle pause
before each timed call lets the previous variant's spinning threads go idle. The parent still interleaves the
rounds (benchmarks/timing.py), so load drift hits every variant alike. A worker reports the time it measured
around the call itself, so pipe latency is not counted.

Protocol (JSON lines on stdin/stdout): the first line is a spec ``{"kind": "ort"|"aoti"|"eager"|"ao", "path":
..., "names": [...], "threads": n, "inputs": {shape: safetensors file}, "realtime": priority or 0}``
(a round-robin real-time priority, root only: on a machine shared with other jobs the timed runtime then
preempts them, the nearest to a quiet machine one can get without one); the worker answers ``{"ready": ...}``,
then each ``{"run": shape}`` with ``{"s": seconds}``; end of input ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["RuntimeWorker", "save_inputs", "load_runner"]


def save_inputs(inputs: Mapping[str, torch.Tensor], path: Path) -> Path:
    """One shape's timing inputs as a safetensors file the workers load."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in inputs.items()}, str(path))
    return path


def load_runner(spec: Mapping[str, Any]) -> Callable[[Mapping[str, torch.Tensor]], Any]:
    """The runtime a spec names, as a function of the keyword inputs (the worker's side)."""
    kind, path = spec["kind"], str(spec["path"])
    if kind == "ort":
        import importlib

        from ..deploy.ort_options import session_kwargs

        ort = importlib.import_module("onnxruntime")
        session = ort.InferenceSession(path, **session_kwargs(int(spec["threads"])))
        names = [i.name for i in session.get_inputs()]
        return lambda kw: session.run(None, {k: kw[k].numpy() for k in names})
    if kind == "aoti":
        loaded = torch._inductor.aoti_load_package(path)
        order = list(spec["names"])
        return lambda kw: loaded(*(kw[n] for n in order))
    if kind in ("eager", "ao"):
        import copy
        import warnings

        from ..graph.forge_graph import ForgeGraph
        from .deploy_runtimes import eager_runner

        model = ForgeGraph.from_checkpoint(path).eval().model
        if kind == "ao":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao's deprecation notice: the reference row, not a product
                model = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                               dtype=torch.qint8)
        run = eager_runner(model)
        return lambda kw: run(**kw)
    raise ValueError(f"runtime worker: unknown kind {kind!r}")


def _serve() -> None:
    """The worker: load the spec's runtime and inputs, then time one call per request."""
    from safetensors.torch import load_file

    spec = json.loads(sys.stdin.readline())
    if spec.get("realtime"):  # before any thread pool exists: ORT's and OpenMP's threads inherit the policy
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(int(spec["realtime"])))
    torch.set_num_threads(int(spec["threads"]))
    run = load_runner(spec)
    inputs = {shape: load_file(f) for shape, f in spec["inputs"].items()}
    print(json.dumps({"ready": torch.get_num_threads()}), flush=True)
    with torch.no_grad():
        for line in sys.stdin:
            shape = json.loads(line)["run"]
            start = time.perf_counter()
            run(inputs[shape])
            print(json.dumps({"s": time.perf_counter() - start}), flush=True)


class RuntimeWorker:
    """The parent's handle on one worker process: ``time(shape)`` runs one call there and returns its seconds."""

    def __init__(self, spec: Mapping[str, Any], settle_s: float = 0.05) -> None:
        self.settle_s = settle_s
        self.proc = subprocess.Popen([sys.executable, "-m", "fxforge.benchmarks.runtime_workers"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(dict(spec)) + "\n")
        self.proc.stdin.flush()
        self.ready = False

    def wait_ready(self) -> RuntimeWorker:
        """Block until the worker has loaded its runtime (start every worker first: they load in parallel)."""
        if not self.ready:
            self._read("ready")
            self.ready = True
        return self

    def _read(self, key: str) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"runtime worker exited (code {self.proc.wait()}) before answering {key!r}")
        return json.loads(line)[key]

    def time(self, shape: str) -> float:
        self.wait_ready()
        assert self.proc.stdin is not None
        time.sleep(self.settle_s)  # the previous variant's spinning threads go idle (not timed)
        self.proc.stdin.write(json.dumps({"run": shape}) + "\n")
        self.proc.stdin.flush()
        return float(self._read("s"))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    _serve()
