"""Write the tutorial examples as Jupyter notebooks (examples/notebooks/*.ipynb), generated from the examples
themselves so they cannot drift: the example's docstring, a ``QUICK`` switch (tiny settings that run in seconds
to minutes; ``False``: the tutorial's own settings), the call of its ``main`` and, where the example leaves a
graph, search or before / after behind, a cell that displays it (``_repr_html_``: self-contained, offline).

    python examples/notebooks/make_notebooks.py          # (re)write the notebooks (needs only nbformat)
    python examples/notebooks/make_notebooks.py --check  # exit 1 when a notebook is not up to date
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent


@dataclass(frozen=True)
class Tutorial:
    """One example: its module, the args it always gets (paths under WORK), the QUICK settings, a display cell."""

    module: str
    paths: str = "[]"
    quick: tuple[str, ...] = ()
    show: str = ""


SHOW_SEARCH = ('import fxforge.report  # registers the notebook views\n'
               'from IPython.display import HTML\n'
               'from fxforge.report.notebook import framed\n'
               'from fxforge.report.search_json import load_search_results\n'
               'from fxforge.report.search_pages import search_page\n\n'
               'HTML(framed(search_page(load_search_results(WORK / "pareto.json"))))  # interactive, offline')

TUTORIALS: tuple[Tutorial, ...] = (
    Tutorial("demo", '["--out", str(WORK)]',
             ("--trials", "2", "--train", "16", "--eval", "16", "--max-length", "16", "--rounds", "1"),
             'import fxforge.report  # registers the notebook views\n'
             'from fxforge import ForgeGraph\n'
             'from fxforge.report.compare import compare_graphs\n'
             'from fxforge.search.objectives import weight_bits\n\n'
             'before, after = WORK / "minilm-lora", WORK / "best"  # the fine-tuned fp32 model and the shipped point\n'
             'compare_graphs(ForgeGraph.from_checkpoint(before), ForgeGraph.from_checkpoint(after),\n'
             '               names=("fine-tuned fp32", "shipped point"), checkpoints=(before, after),\n'
             '               weight_bits=weight_bits)'),
    Tutorial("lora_finetune", "[]", ("--train", "16", "--test", "16", "--max-length", "16", "--epochs", "1",
                                     "--repeats", "3")),
    Tutorial("pipeline_minilm", '["--out", str(WORK / "int8.ckpt")]', ("--batch", "2", "--length", "16"),
             'import fxforge.report  # registers the notebook views\n'
             'from fxforge import ForgeGraph\n\n'
             'ForgeGraph.from_checkpoint(WORK / "int8.ckpt")  # the graph shows its report'),
    Tutorial("prune_minilm", '["--cache-dir", str(WORK)]',
             ("--train", "16", "--ft-train", "16", "--test", "16", "--length", "16", "--epochs", "1",
              "--rows", "elementwise,structured")),
    Tutorial("quantization", '["--cache-dir", str(WORK)]',
             ("--train", "16", "--test", "16", "--length", "16", "--epochs", "1", "--widths", "8", "--no-qat",
              "--calib-batches", "1", "--rounds", "1", "--threads", "1")),
    Tutorial("search_joint", '["--run-dir", str(WORK)]',
             ("--trials", "2", "--train-size", "16", "--eval-size", "16", "--max-length", "16",
              "--export-trials", "0"), SHOW_SEARCH),
    Tutorial("search_mixed_precision", '["--run-dir", str(WORK)]',
             ("--trials", "2", "--train-size", "16", "--eval-size", "16"), SHOW_SEARCH),
    Tutorial("search_nas", '["--run-dir", str(WORK)]',
             ("--trials", "1", "--train-size", "32", "--eval-size", "16", "--max-length", "16", "--epochs", "1",
              "--report-every", "1", "--sizes", "16", "--ffn-sizes", "32")),
    Tutorial("train_agru", "[]", ("--epochs", "1", "--hidden_size", "32", "--num_layers", "1")),
)


def notebook(t: Tutorial) -> nbformat.NotebookNode:
    """The notebook of tutorial ``t``, built from its example's current docstring."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / f"{t.module}.py").read_text(encoding="utf-8"))) or t.module
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    setup = ("import tempfile\nfrom pathlib import Path\n\n"
             "QUICK = True  # tiny settings (seconds to minutes); False: the tutorial's own settings (long)\n"
             f"WORK = Path(tempfile.mkdtemp(prefix='fxforge-{t.module}-')) if QUICK else Path('out/{t.module}')\n"
             f"ARGS = {t.paths} + ({list(t.quick)!r} if QUICK else [])")
    cells = [nbformat.v4.new_markdown_cell(f"# `fxforge.examples.{t.module}`\n\n"
                                           f"*Generated from examples/{t.module}.py by "
                                           "examples/notebooks/make_notebooks.py: edit the example, not this "
                                           f"notebook.*\n\n{doc}"),
             nbformat.v4.new_code_cell(setup),
             nbformat.v4.new_code_cell(f"from fxforge.examples.{t.module} import main\n\nmain(ARGS)")]
    if t.show:
        cells.append(nbformat.v4.new_code_cell(t.show))
    for i, cell in enumerate(cells):
        cell.id = f"{t.module.replace('_', '-')}-{i}"  # stable ids: regenerating changes nothing
    nb.cells = cells
    return nb


def path_of(t: Tutorial) -> Path:
    return HERE / f"{t.module}.ipynb"


def text_of(t: Tutorial) -> str:
    return nbformat.writes(notebook(t)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that every notebook is up to date")
    args = parser.parse_args(argv)
    stale = [t for t in TUTORIALS if not path_of(t).is_file() or path_of(t).read_text(encoding="utf-8") != text_of(t)]
    if args.check:
        for t in stale:
            print(f"{path_of(t)} is not up to date: run python examples/notebooks/make_notebooks.py")
        return 1 if stale else 0
    for t in stale:
        path_of(t).write_text(text_of(t), encoding="utf-8")
        print(f"wrote {path_of(t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
