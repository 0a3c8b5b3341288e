"""The venv is exactly the lock: every installed distribution is pinned there at its version, and pip
finds no broken requirement (a fresh machine installs requirements.lock alone, hashes checked)."""

from __future__ import annotations

import re
import site
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(text: str) -> dict[str, str]:
    """name -> version of every requirement line of a hashed lock; refuses a line that is not an exact pin."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] in "# " or line.startswith("--"):
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"requirements.lock: not an exact pin: {line!r}")
        pins[_norm(match.group(1))] = match.group(2)
    return pins


def test_lock_pins_every_line_exactly_with_hashes() -> None:
    text = LOCK.read_text()
    pins = lock_pins(text)
    assert len(pins) > 50  # torch, transformers, optuna, ... and their dependencies
    entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2])
    unhashed = [e.split()[0] for e in entries if e.strip() and "--hash=sha256:" not in e]
    assert not unhashed, f"lock entries without hashes: {unhashed}"
    assert pins["torch"] == "2.13.0+cpu"


def test_lock_pins_refuse_loose_lines() -> None:
    with pytest.raises(ValueError, match="not an exact pin"):
        lock_pins("torch>=2\n")
    assert lock_pins("# c\nFoo_Bar==1.2 \\\n    --hash=sha256:ab\n") == {"foo-bar": "1.2"}


def test_installed_distributions_are_all_locked_at_their_version() -> None:
    pins = lock_pins(LOCK.read_text())
    # the venv's own site-packages: once a test imports something that loads pkg_resources (executorch does),
    # setuptools puts its vendored copies (setuptools/_vendor: wheel, zipp, ...) on sys.path, and distributions()
    # would list them as if installed
    installed = {_norm(d.metadata["Name"]): d.version for d in distributions(path=site.getsitepackages())}
    installed.pop("fxforge", None)  # the project itself, installed editable from this tree
    unlocked = {n: v for n, v in installed.items() if n not in pins}
    wrong = {n: (v, pins[n]) for n, v in installed.items() if n in pins and pins[n] != v}
    assert not unlocked, f"installed but not in requirements.lock: {unlocked}"
    assert not wrong, f"installed version differs from the lock (installed, locked): {wrong}"


def test_direct_requirements_are_all_locked() -> None:
    pins = lock_pins(LOCK.read_text())
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    direct = [re.split(r"[\s\[=<>!~;]", line, maxsplit=1)[0]
              for line in lines if line.strip() and not line.startswith("#")]
    assert direct and all(_norm(name) in pins for name in direct), [n for n in direct if _norm(n) not in pins]


def test_pip_check_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
