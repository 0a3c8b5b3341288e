"""The one way checkpoint directories are written and read: manifest, atomic replace, no symlinks.

Both checkpoint kinds (graph checkpoints and LoRA adapter checkpoints) are a directory of a few regular
files plus ``manifest.json`` (format, schema version, SHA-256 and size of each file). Writing fills a
fresh sibling directory, fsyncs it, and swaps it into place with one ``renameat2(RENAME_EXCHANGE)``,
so a crash at any point leaves either the old or the new checkpoint at the path. Reading opens every
file with ``O_NOFOLLOW``, checks it is a regular file of the declared size before reading a byte, and
parses JSON with bounded size and depth, refusing duplicate keys.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .limits import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_MANIFEST_BYTES
from .targets import CheckpointError

__all__ = ["MANIFEST", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_MANIFEST_BYTES", "json_depth", "loads_json",
           "manifest_sha256", "read_verified", "write_checkpoint_dir"]

MANIFEST = "manifest.json"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_SCAN_CHUNK = 1 << 20  # bytes per step of json_depth
_STEPS = np.zeros(256, dtype=np.int8)
_STEPS[list(b"[{")], _STEPS[list(b"]}")] = 1, -1
# Test hook: called with the name of each step of a write (crash tests kill the writer there).
STEP_HOOK: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if STEP_HOOK is not None:
        STEP_HOOK(name)


# -- JSON -------------------------------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def json_depth(data: bytes) -> int:
    """How deep the brackets of JSON text nest outside its strings: one linear pass, in chunks, in numpy.

    A byte is escaped when an odd run of backslashes precedes it; an unescaped quote toggles "inside a
    string"; brackets count outside strings only. Nothing backtracks or restarts (a regular expression
    stripping strings was quadratic on a long unterminated run of escaped quotes), and memory stays at a
    few chunk-sized arrays whatever the input holds.
    """
    deepest = depth = run = quotes = 0  # carried across chunks: depth, backslash-run parity, quote parity
    for start in range(0, len(data), _SCAN_CHUNK):
        x = np.frombuffer(data, dtype=np.uint8, count=min(_SCAN_CHUNK, len(data) - start), offset=start)
        quote, step = x == ord('"'), _STEPS[x]
        backslash = x == ord("\\")
        if run or backslash.any():
            index = np.arange(len(x), dtype=np.int32)
            last_plain = np.maximum.accumulate(np.where(backslash, np.int32(-1 - run), index))
            escaped = (index - np.concatenate(([np.int32(-1 - run)], last_plain[:-1]))) & 1 == 0
            quote &= ~escaped  # odd run of backslashes just before: index - 1 - last_plain_before is odd
            step[escaped] = 0
            run = (len(x) - 1 - int(last_plain[-1])) & 1
        inside = (np.cumsum(quote, dtype=np.int32) + quotes) & 1 == 1
        step[inside | quote] = 0
        levels = np.cumsum(step, dtype=np.int64) + depth
        deepest, depth, quotes = max(deepest, int(levels.max())), int(levels[-1]), int(inside[-1])
    return deepest


def loads_json(data: bytes, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse JSON bytes with bounded size and nesting depth; duplicate keys and NaN literals refused."""
    if len(data) > max_bytes:
        raise CheckpointError(f"{what}: {len(data)} bytes is larger than the {max_bytes} allowed")
    deepest = json_depth(data)
    if deepest > MAX_JSON_DEPTH:
        raise CheckpointError(f"{what}: JSON nested {deepest} deep (at most {MAX_JSON_DEPTH} allowed)")

    def constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=constant)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{what}: invalid JSON ({exc})") from None


def dumps_json(doc: Any, what: str) -> bytes:
    """Strict JSON bytes (no NaN/inf); CheckpointError when ``doc`` is not JSON data."""
    try:
        return json.dumps(doc, indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} is not JSON-serialisable: {exc}") from exc


# -- reading ----------------------------------------------------------------------------------------------
def _read_file(path: Path, size: int | None, limit: int) -> bytes:
    """Read a regular file (never through a symlink), checking its size before reading anything."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: is a symbolic link; checkpoint files must be regular files") from None
        raise CheckpointError(f"{path}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if (size is not None and st.st_size != size) or st.st_size > limit:
            raise CheckpointError(f"{path}: size/SHA-256 does not match {MANIFEST} ({st.st_size} bytes on disk); "
                                  "the file is corrupt or was modified after export")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _digest_form(expected_sha256: Any) -> str:
    if not isinstance(expected_sha256, str) or not _HEX64.fullmatch(expected_sha256):
        raise CheckpointError(f"expected_sha256 must be 64 hexadecimal digits (the SHA-256 of {MANIFEST} that "
                              f"`fxforge verify` prints), got {str(expected_sha256)[:80]!r}")
    return expected_sha256.lower()


def check_digest(data: bytes, expected_sha256: Any, what: Path | str) -> None:
    """Refuse ``data`` (a manifest) unless its SHA-256 is the pinned ``expected_sha256`` (64 hex digits)."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != _digest_form(expected_sha256):
        raise CheckpointError(f"{what}: SHA-256 {actual} is not the expected {expected_sha256.lower()}: this is not "
                              "the checkpoint that digest was published for")


def manifest_sha256(root: str | Path) -> str:
    """The SHA-256 of a checkpoint's manifest: the digest to publish or pin (it covers every file's hash)."""
    return hashlib.sha256(_read_file(Path(root) / MANIFEST, None, MAX_MANIFEST_BYTES)).hexdigest()


def read_verified(root: Path, fmt: str, versions: Iterable[int], required: Iterable[str],
                  optional: Iterable[str] = (), expected_sha256: str | None = None) -> tuple[dict[str, bytes], int]:
    """Every file the manifest lists, read once and checked (size, SHA-256) before anything is parsed,
    and the manifest's schema version (exactly one of ``versions``). With ``expected_sha256`` the
    manifest's own bytes must have that digest before they are parsed (provenance, not just integrity)."""
    root = Path(root)
    if expected_sha256 is not None:
        _digest_form(expected_sha256)  # the argument's form, before touching the file system
    if root.is_symlink():
        raise CheckpointError(f"{root}: is a symbolic link; give the checkpoint directory itself")
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    mpath = root / MANIFEST
    if not os.path.lexists(mpath):
        raise CheckpointError(f"{mpath}: missing; {root} is not a complete checkpoint")
    raw = _read_file(mpath, None, MAX_MANIFEST_BYTES)
    if expected_sha256 is not None:
        check_digest(raw, expected_sha256, mpath)
    manifest = loads_json(raw, f"{mpath}: unreadable or corrupt manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: unreadable or corrupt manifest (not a {fmt} manifest)")
    got, versions = manifest.get("schema_version"), tuple(versions)
    if type(got) is not int or got not in versions:
        raise CheckpointError(f"{mpath}: schema version {got!r} is not supported: this fxforge reads exactly "
                              f"version(s) {list(versions)} (re-export the checkpoint with this fxforge)"[:300])
    files, required, optional = manifest["files"], tuple(required), tuple(optional)
    if any(f not in files for f in required) or set(files) - {*required, *optional}:
        raise CheckpointError(f"{mpath}: must list {list(required)} (and optionally {list(optional)}), "
                              f"lists {sorted(files)[:8]}")
    payloads: dict[str, bytes] = {}
    for name, info in files.items():
        if not isinstance(info, dict) or set(info) != {"sha256", "size"} or type(info["size"]) is not int \
                or not isinstance(info["sha256"], str):
            raise CheckpointError(f"{mpath}: entry for {name} must be {{'sha256': hex, 'size': int}}")
        data = _read_file(root / name, info["size"], info["size"])
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(f"{root / name}: size/SHA-256 does not match {MANIFEST}; the file is corrupt "
                                  "or was modified after export")
        payloads[name] = data
    return payloads, got


# -- writing ----------------------------------------------------------------------------------------------
def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise CheckpointError(f"{b}: cannot replace the checkpoint ({os.strerror(err)})")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_target(path: Path, allowed: set[str]) -> bool:
    """Refuse targets the writer must not replace; True when an old checkpoint is there."""
    if str(path) in ("", ".") or path.name in ("", ".", ".."):
        raise CheckpointError(f"{str(path)!r}: not a valid checkpoint path; name a directory, e.g. 'run/ckpt'")
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link; export to a real directory path")
    if not os.path.lexists(path):
        return False
    if not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory; choose another checkpoint path")
    foreign = []
    for entry in os.scandir(path):
        if entry.name not in allowed or not entry.is_file(follow_symlinks=False):
            foreign.append(entry.name)
    if foreign:
        raise CheckpointError(f"{path}: holds entries that are not files of an fxforge checkpoint "
                              f"({sorted(foreign)[:3]}); nothing was changed: choose another path")
    return True


def write_checkpoint_dir(path: str | Path, files: dict[str, bytes], fmt: str, version: int,
                         allowed: Iterable[str] = ()) -> Path:
    """Write ``files`` plus a manifest as a checkpoint directory at ``path``, replacing an old one atomically.

    ``allowed`` names every file a checkpoint of this kind may hold: an existing directory holding
    anything else (or a non-regular file) is refused, and nothing else is ever deleted.
    """
    path = Path(path)
    names = {*files, *allowed, MANIFEST}
    replacing = _check_target(path, names)
    manifest = {"format": fmt, "schema_version": version, "files": {
        k: {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)} for k, v in files.items()}}
    files = {**files, MANIFEST: dumps_json(manifest, "manifest")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    os.mkdir(tmp, 0o777)  # the umask decides the final permissions, as for any directory the user makes
    written: list[Path] = []
    _step("tmp_created")
    try:
        for name, data in files.items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            written.append(tmp / name)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            _step(f"wrote:{name}")
        _fsync_dir(tmp)
        _step("synced")
        if not replacing:
            os.rename(tmp, path)  # fails (never overwrites) if someone created the path meanwhile
            _step("renamed")
            _fsync_dir(path.parent)
            return path
        if not _renameat2_exchange(tmp, path):
            raise CheckpointError(f"{path}: this filesystem cannot swap directories atomically; export to a new "
                                  "path (or remove the old checkpoint first)")
        _step("swapped")
        _fsync_dir(path.parent)
    except BaseException:
        for p in written:  # only what this call wrote
            p.unlink(missing_ok=True)
        if tmp.is_dir() and not tmp.is_symlink():
            _remove_checkpoint_files(tmp, names)
        raise
    _remove_checkpoint_files(tmp, names)  # the old checkpoint, now at the temporary name
    _step("cleaned")
    return path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _remove_checkpoint_files(directory: Path, names: set[str]) -> None:
    """Delete a checkpoint directory's own regular files, then the directory if that left it empty."""
    for entry in os.scandir(directory):
        if entry.name in names and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # something else is in there: not ours to delete
