"""The package's import graph: no import cycle at module level, and the layering holds (graph/ never
imports passes/, passes/ never imports pipelines/ or search/, benchmarks/ never import examples/)."""

from __future__ import annotations

import ast
from pathlib import Path

import fxforge

ROOT = Path(fxforge.__file__).parent
SKIP_DIRS = {"tests", ".venv", "build", "dist"}

# Lazy (function-level) imports that cross a layer today and who removes them.
# graph/checkpoint.py imports fxforge.passes so record types register: helper `sec` owns that fix.
KNOWN_LAZY_CROSSINGS = {("graph.checkpoint", "passes")}


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


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
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
    return [f"{base}.{a.name}".strip(".") for a in node.names] + [base]


def _imports(module_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
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
                found.update(t for t in _resolve(name, is_pkg, node) if t in mods)
        if not module_level_only:  # drop what only TYPE_CHECKING blocks import
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Import | ast.ImportFrom):
                            found.difference_update(_resolve(name, is_pkg, sub))
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


def test_layering() -> None:
    rules = [("graph", ("passes", "pipelines", "search")), ("passes", ("pipelines", "search")),
             ("benchmarks", ("examples",))]
    bad = []
    for module, targets in _imports(module_level_only=False).items():
        for layer, forbidden in rules:
            if module.split(".")[0] != layer:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top in forbidden and (module, top) not in KNOWN_LAZY_CROSSINGS:
                    bad.append(f"{module} -> {target}")
    assert not bad, f"layering violations: {bad}"


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
