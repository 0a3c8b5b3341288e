"""Print the reach sweep: per architecture whether raw torch.export takes it, the fxforge stage it reaches (or the
first failing stage with its error's first line) and the train-mode check; then the totals.

Run: ``cd /work/main && .venv/bin/python tests/reach/sweep.py [NAME ...] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_archs, reach_stages (also under python -P)

from reach_stages import STAGES, Run, first_line, raw_equal, raw_export  # noqa: E402
from tiny_archs import ARCHS  # noqa: E402


def sweep_one(name: str) -> tuple[bool, str, str, str]:
    """(raw export ok, fxforge result, train-mode result, raw export's error or whether its module equals eager)."""
    try:
        ep = raw_export(name)
    except Exception as exc:  # noqa: BLE001 - tabulated
        return False, "-", "-", first_line(exc)
    raw = raw_equal(name, ep)
    run = Run(name)
    for stage in STAGES:
        try:
            run.stage(stage)()
        except Exception as exc:  # noqa: BLE001 - tabulated
            train = run.train_check() if run.graph is not None else "-"
            return True, f"FAIL {stage}: {first_line(exc)}", train, raw
    caveats = sorted({n for n in run.notes if n.startswith("static dim")})
    return True, "ok" + (f" ({'; '.join(caveats)})" if caveats else ""), run.train_check(), raw


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures (default: all)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    names = args.names or list(ARCHS)
    lines, raw_ok, forge_ok = [], 0, 0
    for name in names:
        t0 = time.perf_counter()
        raw, forge, train, raw_info = sweep_one(name)
        raw_ok += raw
        forge_ok += forge.startswith("ok")
        raw_text = f"ok (vs eager: {raw_info})" if raw else f"FAIL {raw_info}"
        line = (f"{name:16} raw={raw_text}  fxforge={forge}  train={train}  "
                f"({time.perf_counter() - t0:.1f}s)")
        print(line, flush=True)
        lines.append(line)
    total = f"totals over {len(names)} architectures: raw export {raw_ok} / fxforge {forge_ok}"
    print(total)
    if args.out:
        args.out.write_text("\n".join([*lines, total]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
