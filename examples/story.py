"""How the examples talk to a newcomer: numbered steps, indented lines under each, and checks that set the exit code."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Story"]


def _print(line: str) -> None:
    print(line, flush=True)  # flushed: the lines interleave with progress bars on stderr in order


class Story:
    """``step`` opens ``[n/N] title``; ``say`` and ``check`` print under it; ``end`` sums up and returns 0 or 1."""

    INDENT = "      "

    def __init__(self, steps: int, out: Callable[[str], None] = _print) -> None:
        self.steps, self.n, self.out = steps, 0, out
        self.failed: list[str] = []
        self.t0 = time.perf_counter()

    def step(self, title: str) -> None:
        self.n += 1
        self.out(f"\n[{self.n}/{self.steps}] {title}")

    def say(self, text: str) -> None:
        self.out(self.INDENT + text.replace("\n", "\n" + self.INDENT))

    def check(self, ok: bool, what: str) -> bool:
        """Print ``ok``/``FAIL`` and what was checked; a failure makes :meth:`end` return 1."""
        self.say(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failed.append(what)
        return ok

    def end(self, name: str = "demo") -> int:
        took = time.perf_counter() - self.t0
        verdict = f"{name} OK" if not self.failed else f"{name} FAILED: " + "; ".join(self.failed)
        self.out(f"\n{verdict} ({took:.0f}s)")
        return 1 if self.failed else 0
