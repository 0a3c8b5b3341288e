"""Debian tools the report tests drive (chromium, Graphviz's dot): found on PATH, else installed with apt-get under
one file lock (pytest-xdist's workers may both get here: one installs while the other waits, then finds it),
failing the test loudly when that is impossible."""

from __future__ import annotations

import fcntl
import shutil
import subprocess

import pytest

LOCK = "/tmp/fxforge-apt-get.lock"


def apt_tool(package: str, *executables: str) -> str:
    """Path of the first of ``executables`` on PATH, installing Debian's ``package`` when none is."""
    def find() -> str | None:
        return next((p for p in map(shutil.which, executables) if p), None)

    found = find()
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.fail(f"{executables[0]} is not installed and apt-get is not available to install {package}")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not find():
            for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={
                    "DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
                if proc.returncode != 0:
                    pytest.fail(f"{package} could not be installed ({' '.join(cmd)}: {proc.stderr.strip()[-200:]})")
    found = find()
    if not found:
        pytest.fail(f"apt-get installed {package} but no {executables[0]} executable is on PATH")
    return found
