"""The examples' Story: numbered steps, indented lines, and a failed check turning into exit code 1."""

from __future__ import annotations

from fxforge.examples.story import Story


def test_steps_lines_and_passing_checks_exit_zero() -> None:
    lines: list[str] = []
    story = Story(2, out=lines.append)
    story.step("Capture")
    story.say("two\nlines")
    assert story.check(True, "graph equals model")
    story.step("Export")
    assert story.end() == 0
    assert lines[0] == "\n[1/2] Capture"
    assert lines[1] == f"{Story.INDENT}two\n{Story.INDENT}lines"
    assert lines[2] == f"{Story.INDENT}ok   graph equals model"
    assert lines[3] == "\n[2/2] Export"
    assert lines[4].startswith("\ndemo OK (")


def test_a_failed_check_is_named_at_the_end_and_exits_one() -> None:
    lines: list[str] = []
    story = Story(1, out=lines.append)
    story.step("Verify")
    assert not story.check(False, "checkpoint verified")
    assert story.check(True, "outputs equal")
    assert story.end("tour") == 1
    assert lines[1] == f"{Story.INDENT}FAIL checkpoint verified"
    assert lines[-1].startswith("\ntour FAILED: checkpoint verified (")
