"""The HTML report rendered by a real headless Chromium: no JS errors, one table row per node, a drawn SVG,
working sort, embedded search plots, and a screenshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_support import make_checkpoint  # noqa: E402


def chromium() -> str:
    """Path of Debian's chromium, installing it with apt-get when missing (fails if impossible)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.fail("chromium is not installed and apt-get is not available to install it")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                              env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        if proc.returncode != 0:
            pytest.fail(f"chromium could not be installed ({' '.join(cmd)}: {proc.stderr.strip()[-200:]})")
    found = shutil.which("chromium")
    if not found:
        pytest.fail("apt-get installed chromium but no chromium executable is on PATH")
    return found


def headless(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=300)


SEARCH = {"study": "demo", "objectives": ["accuracy", "latency_ms", "avg_weight_bits"],
          "directions": ["maximize", "minimize", "minimize"], "baseline": {"accuracy": 0.86, "avg_weight_bits": 32},
          "front": [{"trial": 1, "accuracy": 0.85, "latency_ms": 3.0, "avg_weight_bits": 8.0, "feasible": True,
                     "params": {"w": 8}},
                    {"trial": 2, "accuracy": 0.80, "latency_ms": 2.0, "avg_weight_bits": 4.0, "feasible": True,
                     "params": {"w": 4}}],
          "trials": [{"trial": i, "accuracy": 0.7 + 0.03 * i, "latency_ms": 1.0 + i, "avg_weight_bits": 2.0 + 2 * i}
                     for i in range(5)]}


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    browser = chromium()
    from fxforge import ForgeGraph
    from fxforge.report import write_report

    nodes = make_checkpoint(tmp_path / "ckpt")
    mg = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    html = write_report(mg, tmp_path / "report.html", search_results=json.loads(json.dumps(SEARCH)))

    dom = headless(browser, tmp_path / "profile", "--dump-dom", f"{html.resolve().as_uri()}#selftest")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert 'data-ready="1"' in page, "the inline script did not finish"
    errors = re.search(r'<pre id="js-errors">(.*?)</pre>', page, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors
    assert re.search(r'<div id="selftest"[^>]*>sorted-ok</div>', page), "sorting the node table failed"
    assert page.count('<tr class="node-row">') == nodes
    assert page.count('<g class="node"') == nodes and page.count("<rect class=\"node-box\"") == nodes
    assert page.count('<tr class="quant-row">') > 0 and page.count('<tr class="history-row">') == len(mg.history)
    assert page.count('class="plot"') == 2  # Pareto front and accuracy vs bits
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")

    shot = tmp_path / "report.png"
    proc = headless(browser, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,1600",
                    html.resolve().as_uri())
    assert proc.returncode == 0 and shot.is_file() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    keep = Path("/tmp/fxforge-report-screenshot.png")
    shutil.copy(shot, keep)  # for a human to look at
