"""Several worker processes of one example on one embedded journal study, stopped at a wall-clock deadline.

The launching process creates the study (and whatever it measures once) before any worker starts; each
worker is the same example module run again with ``--worker I`` appended, joining the study with
``Search(resume=True, fail_stale=False)`` (the others' trials in progress are live, not a crash's leftovers).
Workers that are still running at the deadline (or once ``done()`` says so) are terminated: a trial finishing
after it does not count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["run_workers"]


def run_workers(module: str, argv: list[str], n: int, deadline: float, log_dir: Path, threads: int | None = None,
                done: Callable[[], bool] | None = None, poll_s: float = 10.0) -> list[int | None]:
    """Run ``python -m module *argv --worker I`` for I < ``n`` until all exit, ``deadline`` (Unix time) passes or
    ``done()`` (asked every ``poll_s`` s) is true; each writes ``log_dir/worker-I.log``. Returns the exit codes
    (None: terminated)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:  # each worker's share of the cores (torch and the tokenizer's pools)
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        log = open(log_dir / f"worker-{i}.log", "w")  # noqa: SIM115 -- closed when the worker has exited
        procs.append((subprocess.Popen([sys.executable, "-m", module, *argv, "--worker", str(i)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes: list[int | None] = [None] * n
    asked = time.time()
    try:
        while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
            time.sleep(1.0)
            if done is not None and time.time() - asked >= poll_s:
                asked = time.time()
                if done():
                    break
    finally:
        for i, (p, log) in enumerate(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                print(f"worker {i}: stopped (deadline or done)")
            else:
                codes[i] = p.returncode
            log.close()
    return codes
