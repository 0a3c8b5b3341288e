"""The package's import graph: no import cycle at module level, and every top-level unit (package or module)
imports only what it builds on (the table below, read transitively)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fxforge

ROOT = Path(fxforge.__file__).parent
SKIP_DIRS = {"tests", ".venv", ".lock-check", "build", "dist"}  # venvs inside the checkout: `make venv`, `make lock`

# What each top-level unit builds on directly; a unit may import these, what they build on, and itself.
# "" is the package itself (fxforge/__init__.py, the ForgeGraph/passes facade). The application layer (hub,
# quiet, reviews, distill, models, data) sits below pipelines/search; graph never reaches passes; passes never
# reach pipelines, search or the application layer; benchmarks never reach examples.
FOUNDATION = frozenset({"hub", "quiet", "reviews", "distill"})  # stdlib and third-party imports only
BUILDS_ON: dict[str, frozenset[str]] = {
    **{unit: frozenset() for unit in FOUNDATION},
    "kernels": FOUNDATION,
    "models": frozenset({"kernels"}),
    "graph": frozenset({"kernels"}),
    "passes": frozenset({"graph"}),
    "data": frozenset({"graph", "models"}),
    "": frozenset({"passes", "hardware"}),
    "pipelines": frozenset({"", "data"}),
    "distributed": frozenset({"pipelines"}),
    "search": frozenset({"pipelines", "distributed"}),
    "deploy": frozenset({"pipelines"}),
    "hardware": frozenset({"passes"}),
    "report": frozenset({"passes"}),
    "cli": frozenset({"search", "report", "deploy", "hardware"}),
    "benchmarks": frozenset({"search", "deploy"}),
    "examples": frozenset({"benchmarks", "report"}),
    "__main__": frozenset({"cli"}),
}
# A call whose first argument names a module (importlib.import_module("fxforge.search"), the CLI's feature
# lookup) is an import too.
_MODULE_NAME = re.compile(r"^fxforge(\.\w+)+$")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or any(p.startswith(".") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom | ast.Import, mods: set[str]) -> list[str]:
    """Modules an import statement loads: each imported submodule, and the package it reads names from
    (``from . import kernels`` only loads ``kernels``; ``from fxforge import ForgeGraph`` reads the package)."""
    if isinstance(node, ast.Import):
        return [a.name.removeprefix("fxforge.") for a in node.names if a.name.startswith("fxforge.")]
    if node.level == 0:
        if node.module is None or not (node.module == "fxforge" or node.module.startswith("fxforge.")):
            return []
        base = node.module.removeprefix("fxforge").lstrip(".")
    else:
        parts = module.split(".") if module else []
        parts = parts if is_pkg else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    names = [f"{base}.{a.name}".strip(".") for a in node.names]
    return names if all(n in mods for n in names) else [*names, base]


def _dynamic(node: ast.AST) -> list[str]:
    """The module a call names in its first argument (``import_module("fxforge.search")``), if any."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        if isinstance(value, str) and _MODULE_NAME.match(value):
            return [value.removeprefix("fxforge.")]
    return []


def _imports(module_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    names = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        found: set[str] = set()
        body = tree.body if module_level_only else list(ast.walk(tree))
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.update(t for t in _resolve(name, is_pkg, node, names) if t in mods)
            elif not module_level_only:
                found.update(t for t in _dynamic(node) if t in mods)
        if not module_level_only:  # drop what only TYPE_CHECKING blocks import
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Import | ast.ImportFrom):
                            found.difference_update(_resolve(name, is_pkg, sub, names))
        found.discard(name)
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle through submodules (a package importing its own submodules is not one), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if n.startswith(m + ".") or not m:  # a submodule importing its parent package's __init__
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_at_module_level() -> None:
    graph = _imports(module_level_only=True)
    assert "passes.rewrite" in graph and "graph.metadata" in graph  # the walk sees the package
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def _unit(module: str) -> str:
    return module.split(".")[0]


def _allowed(unit: str) -> set[str]:
    """Everything ``unit`` builds on, directly or through what it builds on."""
    seen: set[str] = set()
    todo = list(BUILDS_ON[unit])
    while todo:
        dep = todo.pop()
        if dep not in seen:
            seen.add(dep)
            todo.extend(BUILDS_ON[dep])
    return seen


def _violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if _unit(target) != _unit(module) and _unit(target) not in _allowed(_unit(module))]


def test_every_unit_has_a_place_in_the_layering() -> None:
    units = {_unit(m) for m in _modules()}
    assert {"graph", "passes", "pipelines", "search", "kernels", "models", "examples", "benchmarks", "cli",
            "report", "data", "distill", "hub", "quiet", "reviews"} <= units  # the walk sees the package
    assert not units - BUILDS_ON.keys(), f"units missing from BUILDS_ON: {sorted(units - BUILDS_ON.keys())}"
    assert not {d for deps in BUILDS_ON.values() for d in deps} - BUILDS_ON.keys()
    assert all(unit not in _allowed(unit) for unit in BUILDS_ON), "BUILDS_ON has a cycle"


def test_layering() -> None:
    """Function-level (lazy) imports count: a lazy import still makes the lower layer depend on the upper."""
    bad = _violations(_imports(module_level_only=False))
    assert not bad, f"layering violations: {bad}"


def test_the_layering_rules_that_matter() -> None:
    """The table keeps the rules the architecture states (a table edit that breaks one fails here)."""
    app = {*FOUNDATION, "models", "data"}  # the foundation is below everything; models and data are not
    assert not _allowed("graph") & {"passes", "pipelines", "search", "models", "data"}
    assert not _allowed("passes") & {"pipelines", "search", "models", "data"}
    assert not _allowed("models") & {"data", "graph", "passes", "pipelines", "search"}
    assert not _allowed("data") & {"passes", "pipelines", "search"}
    for unit in app:
        assert not _allowed(unit) & {"pipelines", "search", "cli", "examples", "benchmarks"}, unit
    assert "examples" not in _allowed("benchmarks") and not _allowed("kernels") - FOUNDATION


def test_layering_check_catches_lazy_and_dynamic_crossings() -> None:
    graph = {"graph.capture": {"passes.base"}, "models.bert": {"data"}, "cli.commands": {"search"},
             "passes.base": {"graph.metadata"}}
    assert _violations(graph) == ["graph.capture -> passes.base", "models.bert -> data"]
    tree = ast.parse("def f():\n    import_module('fxforge.search.runner')\n    g('fxforge is nice')\n")
    assert [t for node in ast.walk(tree) for t in _dynamic(node)] == ["search.runner"]


def test_cycle_detector_finds_a_cycle() -> None:
    assert _cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]
    assert _cycle({"a": {"a.x"}, "a.x": {"a"}}) is None  # package <-> its submodule: Python handles it


def test_importing_fxforge_does_not_import_triton() -> None:
    """TRITON_INTERPRET must be settable after `import fxforge` (benchmarks run as `python -m fxforge...`):
    triton is imported only where a kernel runs."""
    import subprocess
    import sys

    code = "import sys, fxforge, fxforge.passes, fxforge.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_package_is_imported_once_under_its_own_name() -> None:
    """pytest must not import the repository root a second time under the checkout directory's name (a second
    fxforge re-registers its custom ops and checkpoint targets; tests/pytest.ini keeps the rootdir in tests/)."""
    import sys

    def in_package(mod: object) -> bool:
        path = Path(str(getattr(mod, "__file__", None) or "/"))  # torch.ops & co. have relative pseudo-paths
        if not path.is_absolute() or not path.resolve().is_relative_to(ROOT):
            return False
        return path.resolve().relative_to(ROOT).parts[0] not in SKIP_DIRS

    copies = sorted(name for name, mod in list(sys.modules.items())
                    if not (name == "fxforge" or name.startswith("fxforge.")) and in_package(mod))
    assert not copies, f"a second copy of the package is imported: {copies[:5]}"


def test_capture_stand_in_ops_are_recognised_by_name() -> None:
    import torch

    from fxforge.graph.dropout_tracing import stand_in_kind

    assert stand_in_kind(torch.ops.fxforge.dropout.default) == "dropout"
    assert stand_in_kind(torch.ops.fxforge.sdpa_dropout.default) == "sdpa"
    assert stand_in_kind(torch.ops.aten.dropout.default) is None and stand_in_kind(print) is None
