"""Run in a fresh interpreter by the crash-safety tests: write a checkpoint and SIGKILL ourselves at one step.

A fresh process (not ``os.fork``) because a forked child of a process with live torch thread pools can
deadlock on a lock held by a thread that was not copied.

    python kill_child.py graph STEP SRC_CHECKPOINT DEST
    python kill_child.py lora STEP BASE_CHECKPOINT SRC_ADAPTERS DEST
"""

from __future__ import annotations

import os
import signal
import sys

from fxforge import ForgeGraph
from fxforge.graph import atomic
from fxforge.passes.lora_checkpoint import load_lora_adapters, save_lora_adapters


def main(argv: list[str]) -> None:
    kind, step, *paths = argv
    graph = ForgeGraph.from_checkpoint(paths[0])
    if kind == "lora":
        graph, _ = load_lora_adapters(graph, paths[1])
    atomic.STEP_HOOK = lambda s: os.kill(os.getpid(), signal.SIGKILL) if s == step else None
    if kind == "lora":
        save_lora_adapters(graph, paths[-1])
    else:
        graph.export(paths[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
