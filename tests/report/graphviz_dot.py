"""Debian's Graphviz for the drawing tests: ``dot`` found on PATH, else installed with apt-get under the file lock
the chromium helper (browser.py) takes, failing the test loudly when that is impossible. (Not graphviz.py: that
name is a PyPI package's.)"""

from __future__ import annotations

import fcntl
import shutil
import subprocess

import pytest


def dot() -> str:
    """Path of Graphviz's ``dot``, installing Debian's ``graphviz`` when missing (fails if impossible)."""
    found = shutil.which("dot")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.fail("Graphviz's dot is not installed and apt-get is not available to install it")
    with open("/tmp/fxforge-apt-get.lock", "w") as lock:  # one installer at a time (xdist workers, other helpers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shutil.which("dot"):
            for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "graphviz"]):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={
                    "DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
                if proc.returncode != 0:
                    pytest.fail(f"graphviz could not be installed ({' '.join(cmd)}: {proc.stderr.strip()[-200:]})")
    found = shutil.which("dot")
    if not found:
        pytest.fail("apt-get installed graphviz but no dot executable is on PATH")
    return found
