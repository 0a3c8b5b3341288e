"""One short Hugging Face hub reachability probe per process, so offline machines never wait on retries.

``hub_reachable()`` is False at once when ``HF_HUB_OFFLINE`` is set; otherwise it opens one TCP
connection to the hub endpoint (``HF_ENDPOINT``, default huggingface.co:443) with a ~2 s budget,
caches the answer for the process, and when the hub is unreachable says so once. fxforge's loaders
then use local files only instead of spending tens of seconds retrying.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlparse

__all__ = ["PROBE_SECONDS", "hub_reachable", "reset_probe"]

PROBE_SECONDS = 2.0
_TRUE = {"1", "true", "yes", "on"}
_state: dict[str, bool] = {}


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def _probe(host: str, port: int, timeout: float) -> bool:
    """True when a TCP connection opens within ``timeout`` (DNS included: runs in a daemon thread)."""
    result: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """Whether the hub can be used in this process (probed once; offline env vars short-cut to False)."""
    if any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    if "reachable" not in _state:
        host, port = _endpoint()
        _state["reachable"] = _probe(host, port, timeout)
        if not _state["reachable"]:
            print(f"[fxforge] the Hugging Face hub ({host}) is not reachable; working offline for this process.",
                  file=sys.stderr)
    return _state["reachable"]


def reset_probe() -> None:
    """Forget the cached answer (tests; a process whose network came back)."""
    _state.clear()
