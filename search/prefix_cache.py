"""The prefix cache: a plan's expensive prefix (e.g. pruned + distilled weights) computed once and reused
by every trial that differs only later (e.g. in bit widths), stored without pickle.

An entry is a directory ``<root>/<key>/`` (key from :mod:`fxforge.search.prefix_key`) holding the graph
after the prefix as a fxforge checkpoint (``graph/``, float weights kept: ``export(pack=False)``) and
``prefix.json``: the key, the SHA-256 and size of every file, its own SHA-256, and the values the fine-tune reported to
its trial (replayed to a trial served from the entry, so pruners see what a recompute would report).
Loading checks the key, the exact file set (nothing missing, nothing extra, no symbolic link) and every
hash before the checkpoint loader (which checks its own manifest) reads anything; an entry that fails
is refused with a warning and recomputed, never loaded. Entries are written to a temporary directory
and renamed into place, so workers racing on one key each compute it and the first rename wins.

Under a multi-fidelity schedule (search/fidelity.py) the key holds the schedule, and the rung walk, not
the fine-tune, reports: a served trial, already trained to the last rung's steps, is measured and
reported at that rung only (the pruner cannot stop it early, but it costs a measurement, not a training).

Reproducibility: the HF Trainer seeds itself, so a fine-tune recomputed gives the entry's weights again.
A prefix that draws from the global random state (pruning method ``random``) is one draw, reused by
every trial sharing the prefix. A hit skips the fine-tune, so the global random state after the prefix
differs from a recompute's; the later steps (fuse, quantize, calibrate, lower) draw none.

Size: entries' files are at most ``max_bytes`` together (default 2 GiB; one entry is about the size of
the model's float checkpoint); after each write the least recently used entries (a hit refreshes an
entry) are removed until the rest fit, and temporaries older than an hour (a killed writer's) go too.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .prefix_key import LAYOUT_VERSION, Unkeyable, graph_fingerprint, prefix_key, task_fingerprint

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph
    from .space import TrialPlan
    from .task import Task

__all__ = ["PrefixCache", "PrefixCacheWarning", "open_prefix_cache"]

FORMAT = "fxforge-prefix-cache"
ENTRY_MANIFEST, CHECKPOINT = "prefix.json", "graph"
DEFAULT_MAX_BYTES = 2 * 2**30
MAX_MANIFEST_BYTES = 1 << 20
STALE_TMP_S = 3600.0  # a temporary directory this old was left by a killed writer


class PrefixCacheWarning(UserWarning):
    """A cache entry was refused (edited, incomplete) or could not be written; the prefix is recomputed."""


class RefusedEntry(Exception):
    pass


@dataclass(frozen=True)
class Entry:
    graph: ForgeGraph
    reports: tuple[tuple[int, float], ...]


class _Recorder:
    """Forwards a fine-tune's reports to the trial and keeps them for the entry."""

    def __init__(self, trial: optuna.Trial) -> None:
        self._trial = trial
        self.reports: list[tuple[int, float]] = []

    def report(self, value: float, step: int) -> None:
        self.reports.append((int(step), float(value)))
        self._trial.report(value, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trial, name)


class PrefixCache:
    """Prefix entries under ``root`` for trials that start from ``base`` (fingerprinted once, on first use)."""

    def __init__(self, root: str | Path, base: ForgeGraph | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root, self.base, self.max_bytes = Path(root), base, int(max_bytes)
        self._base_fp: str | None = None
        self._task_fp: dict[tuple[int, bool, str], tuple[Any, Any]] = {}  # holds the task: ids stay unique
        self._write_failed = False

    # -- keys -----------------------------------------------------------------------------------------
    def key(self, plan: TrialPlan, task: Task | None, reports: bool, extra: Any = None) -> str | None:
        """The entry key of ``plan``'s prefix, or None when the prefix is empty or cannot be keyed by content."""
        if not plan.before_training() and not plan.train or self.base is None:
            return None
        try:
            if self._base_fp is None:
                self._base_fp = graph_fingerprint(self.base)
            # once per task (a multi-fidelity view is made per trial: once per its inner task and schedule)
            inner = getattr(task, "inner", task)
            memo = (id(inner), plan.train, repr(getattr(task, "fidelity", None)))
            if memo not in self._task_fp:
                try:
                    self._task_fp[memo] = (inner, task_fingerprint(task, plan.train))
                except Unkeyable as exc:
                    self._task_fp[memo] = (inner, exc)
            task_doc = self._task_fp[memo][1]
            if isinstance(task_doc, Unkeyable):
                raise task_doc
            return prefix_key(self._base_fp, plan, task_doc, reports, extra)
        except Unkeyable:
            return None

    # -- running a prefix -----------------------------------------------------------------------------
    def run(self, graph: ForgeGraph, plan: TrialPlan, task: Task | None, trial: optuna.Trial | None,
            compute: Callable[[ForgeGraph, Any], ForgeGraph], notes: dict[str, Any] | None = None) -> ForgeGraph:
        """The graph after ``plan``'s prefix: from the cache (replaying its reports to ``trial``), or
        ``compute(graph, trial)`` and stored. ``notes["prefix_cache"]`` says "hit", "miss" or "skip"
        (a prefix that cannot be keyed); nothing for an empty prefix."""
        key = self.key(plan, task, trial is not None)
        if key is None:
            if notes is not None and (plan.before_training() or plan.train):
                notes["prefix_cache"] = "skip"
            return compute(graph, trial)
        entry = self.load(key)
        if entry is not None:
            if notes is not None:
                notes["prefix_cache"] = "hit"
            _replay(trial, entry.reports)
            return entry.graph
        recorder = None if trial is None else _Recorder(trial)
        graph = compute(graph, recorder)
        self.store(key, graph, () if recorder is None else recorder.reports)
        if notes is not None:
            notes["prefix_cache"] = "miss"
        return graph

    # -- entries --------------------------------------------------------------------------------------
    def load(self, key: str) -> Entry | None:
        """The verified entry of ``key``; None (with a PrefixCacheWarning if one exists but is refused)."""
        from ..graph.forge_graph import ForgeGraph

        path = self.root / key
        if not os.path.lexists(path):
            return None
        try:
            doc = _verified(path, key)
            graph = ForgeGraph.from_checkpoint(path / CHECKPOINT)
            reports = tuple((int(s), float(v)) for s, v in doc["reports"])
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with an entry, it is recomputed, not loaded
            warnings.warn(f"prefix cache entry {path} refused ({exc}); recomputing the prefix", PrefixCacheWarning,
                          stacklevel=3)
            return None
        try:
            os.utime(path / ENTRY_MANIFEST)  # recently used: evicted last
        except OSError:
            pass
        return Entry(graph, reports)

    def store(self, key: str, graph: ForgeGraph, reports: Any = ()) -> Path | None:
        """Write ``graph`` as the entry of ``key`` (atomically); None when it could not be written."""
        if self._write_failed:
            return None
        path, tmp = self.root / key, self.root / f".{key}.{secrets.token_hex(6)}.tmp"
        try:
            if os.path.lexists(path):  # refused when loaded, or a racing worker's: keep a valid one
                try:
                    _verified(path, key)
                    return path
                except Exception:  # noqa: BLE001 - the old entry is bad: moved aside, replaced below
                    _remove(path, self.root)
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            graph.export(tmp / CHECKPOINT, pack=False)
            files = {rel: _file_entry(tmp / rel) for rel in _listing(tmp)}
            doc: dict[str, Any] = {"format": FORMAT, "version": LAYOUT_VERSION, "key": key, "files": files,
                                   "reports": [[int(s), float(v)] for s, v in reports]}
            doc["sha256"] = _doc_digest(doc)
            (tmp / ENTRY_MANIFEST).write_text(json.dumps(doc, sort_keys=True, indent=1))
            try:
                os.rename(tmp, path)  # never replaces a non-empty directory: a racing worker's entry stays
            except OSError:
                return path if os.path.isdir(path) else None
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail the trial
            self._write_failed = True
            warnings.warn(f"prefix cache: cannot write {path} ({type(exc).__name__}: {exc}); trials run uncached "
                          "from here on", PrefixCacheWarning, stacklevel=3)
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep=key)
        return path

    def entries(self) -> list[Path]:
        """The entry directories under ``root`` (names that are keys)."""
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if len(p.name) == 64 and all(c in "0123456789abcdef" for c in p.name)]

    def evict(self, keep: str | None = None) -> None:
        """Remove least recently used entries until the rest hold at most ``max_bytes``; stale temporaries too."""
        now = time.time()
        for p in self.root.glob(".*.tmp"):
            try:
                if now - p.lstat().st_mtime > STALE_TMP_S:
                    _remove(p, self.root)
            except OSError:
                pass
        sized = []
        for p in self.entries():
            try:
                used = (p / ENTRY_MANIFEST).lstat().st_mtime
                files = [os.lstat(f) for f in p.rglob("*")]
                sized.append((used, p, sum(st.st_size for st in files if stat.S_ISREG(st.st_mode))))
            except OSError:
                continue
        total = sum(s for _, _, s in sized)
        for _, p, size in sorted(sized):
            if total <= self.max_bytes:
                break
            if p.name != keep:
                _remove(p, self.root)
                total -= size


def open_prefix_cache(setting: Any, run_dir: Path, base: ForgeGraph | None) -> PrefixCache | None:
    """The cache a Search uses: True → ``<run_dir>/prefix-cache``, a path, a PrefixCache, or None/False (off)."""
    if setting is None or setting is False:
        return None
    if isinstance(setting, PrefixCache):
        if setting.base is None:
            setting.base = base
        return setting
    if setting is True:
        return PrefixCache(Path(run_dir) / "prefix-cache", base)
    if isinstance(setting, str | os.PathLike):
        return PrefixCache(Path(setting), base)
    from .errors import SearchError

    raise SearchError(f"prefix_cache must be a directory, True (in run_dir), or None, got {type(setting).__name__}")


def _replay(trial: optuna.Trial | None, reports: Any) -> None:
    """Report an entry's recorded values to ``trial`` as its fine-tune did, pruning where a recompute would."""
    if trial is None:
        return
    import optuna

    for step, value in reports:
        trial.report(value, step)
        if trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step} (accuracy {value:.3f}, replayed from the prefix cache)")


def _listing(root: Path) -> list[str]:
    """Every regular file under ``root`` as a relative POSIX path; RefusedEntry for anything else."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise RefusedEntry(f"{os.path.join(dirpath, name)} is not a regular file or directory")
        out.extend(Path(dirpath, f).relative_to(root).as_posix() for f in filenames)
    return sorted(out)


def _file_entry(path: Path) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return {"sha256": digest, "size": os.fstat(f.fileno()).st_size}


def _verified(path: Path, key: str) -> dict[str, Any]:
    """The manifest of the entry at ``path`` once the key, the file set and every file's hash check out."""
    if path.is_symlink() or not path.is_dir():
        raise RefusedEntry("not a directory")
    mpath = path / ENTRY_MANIFEST
    if mpath.is_symlink() or not mpath.is_file() or mpath.stat().st_size > MAX_MANIFEST_BYTES:
        raise RefusedEntry(f"{ENTRY_MANIFEST} missing or not a small regular file")
    doc = json.loads(mpath.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != LAYOUT_VERSION:
        raise RefusedEntry(f"not a version-{LAYOUT_VERSION} {FORMAT} manifest")
    if doc.get("sha256") != _doc_digest({k: v for k, v in doc.items() if k != "sha256"}):
        raise RefusedEntry(f"{ENTRY_MANIFEST} was edited after it was written (its own SHA-256 differs)")
    if doc.get("key") != key:
        raise RefusedEntry(f"manifest key {str(doc.get('key'))[:70]!r} is not the entry's key")
    files, reports = doc.get("files"), doc.get("reports")
    if not isinstance(files, dict) or not isinstance(reports, list) or \
            not all(isinstance(r, list) and len(r) == 2 for r in reports):
        raise RefusedEntry("manifest lacks its files or reports")
    present = set(_listing(path)) - {ENTRY_MANIFEST}
    if present != set(files):
        raise RefusedEntry(f"files differ from the manifest (missing {sorted(set(files) - present)[:3]}, "
                           f"extra {sorted(present - set(files))[:3]})")
    for rel, want in files.items():
        if not isinstance(want, dict) or os.lstat(path / rel).st_size != want.get("size") or \
                _file_entry(path / rel) != want:
            raise RefusedEntry(f"{rel}: size/SHA-256 differs from the manifest (edited after it was written)")
    return doc


def _doc_digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _remove(path: Path, root: Path) -> None:
    """Move ``path`` aside (one rename, so a reader never sees half of it), then delete it."""
    trash = root / f".trash-{secrets.token_hex(6)}.tmp"
    try:
        os.rename(path, trash)
    except OSError:
        return
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)
