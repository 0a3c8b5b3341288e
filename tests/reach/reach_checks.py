"""The two checks every reach case runs (test_reach.py and test_reach_second.py parametrize them): capture through
every stage or raw export fails too; train mode equals eager under the same seed or refuses."""

from __future__ import annotations

from typing import Any

import pytest
from reach_stages import STAGES, Run, first_line, raw_export
from tiny_archs import REPRESENTATIVE


def cases(names: list[str] | tuple[str, ...]) -> list[Any]:
    """One xdist group per architecture (`make test-reach`'s --dist loadgroup keeps its two tests on one worker, so
    the train-mode test reuses the graph the reach test captured); all but the representative ones are reach-marked."""
    return [pytest.param(name, marks=[pytest.mark.xdist_group(name),
                                      *(() if name in REPRESENTATIVE else [pytest.mark.reach])]) for name in names]


def check_reach(runs: dict[str, Run], name: str) -> None:
    """Run ``name`` through every stage; a failure passes only where raw torch.export fails as well."""
    run = runs[name] = Run(name)
    for stage in STAGES:
        try:
            run.stage(stage)()
        except Exception as exc:
            # Only a model raw torch.export also fails on is exempt (checked here, after the fact, to save
            # the export's time when fxforge succeeds: the verdict is the same as checking it first).
            try:
                raw_export(name)
            except Exception as raw_exc:  # noqa: BLE001 - the exemption: raw export fails as well
                print(f"{name}: not expected (raw torch.export fails: {first_line(raw_exc)})")
                return
            raise AssertionError(f"{name}: raw torch.export takes it, fxforge fails at {stage!r}: "
                                 f"{first_line(exc)}") from exc


def check_train(runs: dict[str, Run], name: str) -> None:
    """Train mode equals eager under the same seed, or capture refuses it by name."""
    run = runs.get(name)
    if run is None or run.graph is None:  # test_reach did not run or capture: capture here (all this needs)
        run = Run(name)
        try:
            run.capture()
        except Exception as exc:
            try:
                raw_export(name)
            except Exception:  # noqa: BLE001 - not expected: raw export fails as well
                return
            raise AssertionError(f"{name}: raw torch.export takes it, fxforge cannot capture it: "
                                 f"{first_line(exc)}") from exc
    result = run.train_check()
    assert result.startswith(("equal", "refused:")), f"{name}: train mode {result}"
