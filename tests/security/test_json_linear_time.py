"""Every check before a JSON file is parsed is linear: a long run of escaped quotes (``"\\"\\"\\"…``, no closing
quote) stalled the old string-stripping regular expression quadratically (40 kB of manifest: 18 s)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_helpers import export_ckpt, fresh_copy  # noqa: F401

from fxforge import CheckpointError
from fxforge.graph import atomic
from fxforge.graph.atomic import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, loads_json

# Linear work on this takes milliseconds; the quadratic scan took about an hour.
ESCAPE_RUN = b'{"a": "' + b'\\"' * ((MAX_MANIFEST_BYTES - 16) // 2)


@pytest.fixture
def ckpt(export_ckpt: Path, tmp_path: Path) -> Path:  # noqa: F811 (pytest fixture)
    return fresh_copy(export_ckpt, tmp_path)


def test_escaped_quote_run_manifest_is_refused_in_linear_time(ckpt: Path) -> None:
    """A 1 MiB manifest of escaped quotes is refused as invalid JSON within a budget hundreds of times what
    the linear scan needs (a fresh interpreter, killed at the budget, so a regression cannot hang the suite)."""
    (ckpt / "manifest.json").write_bytes(ESCAPE_RUN)
    code = textwrap.dedent(f"""
        from fxforge import CheckpointError, ForgeGraph
        try:
            ForgeGraph.from_checkpoint({str(ckpt)!r})
        except CheckpointError as exc:
            print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "manifest.json: unreadable or corrupt manifest: invalid JSON" in proc.stdout


@pytest.mark.parametrize("text,deepest", [
    (b'["\\\\", [[1]]]', 3),                       # an escaped backslash ends before the closing quote
    (b'["[[[[\\"]]]]", {"{": [[]]}]', 4),          # brackets inside strings (with escaped quotes) do not count
    (b'"\\u005b\\"" ', 0),
])
def test_depth_counts_only_brackets_outside_strings(text: bytes, deepest: int) -> None:
    loads_json(text, "doc")  # valid and shallow
    deep = b"[" * (MAX_JSON_DEPTH - deepest + 1) + text + b"]" * (MAX_JSON_DEPTH - deepest + 1)
    with pytest.raises(CheckpointError, match=f"doc: JSON nested {MAX_JSON_DEPTH + 1} deep"):
        loads_json(deep, "doc")


def test_unterminated_string_still_counts_the_brackets_before_it() -> None:
    with pytest.raises(CheckpointError, match="nested 100 deep"):
        loads_json(b"[" * 100 + b'"\\"\\"\\"', "doc")


def _reference_depth(data: bytes) -> int:
    """The rule, one byte at a time: brackets outside strings, a backslash escapes the next byte."""
    depth = deepest = 0
    inside = escaped = False
    for ch in data:
        if escaped:
            escaped = False
        elif ch == ord("\\"):
            escaped = True
        elif ch == ord('"'):
            inside = not inside
        elif not inside and ch in b"[{]}":
            depth += 1 if ch in b"[{" else -1
            deepest = max(deepest, depth)
    return deepest


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=60) | st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a"]),
                                             max_size=60).map(b"".join),
       chunk=st.integers(1, 7))
def test_depth_scan_matches_the_byte_by_byte_rule_across_chunks(data: bytes, chunk: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "_SCAN_CHUNK", chunk)  # carries between chunks on every few bytes
    assert atomic.json_depth(data) == _reference_depth(data)
