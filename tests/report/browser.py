"""A small Chrome DevTools Protocol driver for the report tests: Debian's headless chromium on a free port,
one page, commands over its websocket (tornado's client, installed with ipykernel), console errors and
uncaught exceptions collected, real mouse clicks, screenshots."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from apt_tool import apt_tool


def chromium() -> str:
    """Path of Debian's chromium, installing it with apt-get when missing (fails if impossible)."""
    return apt_tool("chromium", "chromium", "chromium-browser")


class Browser:
    """Headless chromium with one page; use as a context manager (the process is ended on exit)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000) -> None:
        try:
            from tornado.websocket import websocket_connect
        except ImportError:  # pragma: no cover - tornado comes with ipykernel (requirements.txt)
            pytest.fail("the browser tests drive chromium over CDP with tornado's websocket client: install tornado")
        self.proc = subprocess.Popen(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = self._port()
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30))
        url = next(p["webSocketDebuggerUrl"] for p in pages if p.get("type") == "page")
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # tornado binds its client to the current loop
        self.ws = self.loop.run_until_complete(websocket_connect(url, max_message_size=256 * 2**20))
        self.next_id, self.errors = 0, []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _port(self) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found.group(1))
            if not line and self.proc.poll() is not None:
                break
        pytest.fail("chromium did not open its DevTools port")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one CDP command and return its result (events that arrive meanwhile are recorded)."""
        self.next_id += 1
        ident = self.next_id
        self.loop.run_until_complete(self.ws.write_message(json.dumps({"id": ident, "method": method,
                                                                       "params": params})))
        while True:
            raw = self.loop.run_until_complete(asyncio.wait_for(self.ws.read_message(), 120))
            if raw is None:
                pytest.fail(f"chromium closed the DevTools connection during {method}")
            msg = json.loads(raw)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(str(params.get("exceptionDetails", {}).get("exception", {}).get("description")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(str(params["entry"].get("text")))

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (JSON-serialisable values only)."""
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression[:80]}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def open(self, url: str, ready: str, timeout: float = 60) -> None:
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not self.js(f"!!({ready})"):
            if time.monotonic() > deadline:
                pytest.fail(f"the page never satisfied {ready!r}")
            time.sleep(0.1)

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the element ``selector`` (scrolled into view first)."""
        box = self.js(f"(function(){{var e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
                      "e.scrollIntoView({block: 'center'}); var r = e.getBoundingClientRect();"
                      "return [r.left + r.width / 2, r.top + r.height / 2];})()")
        assert box is not None, f"nothing matches {selector}"
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.ws.close()
            self.loop.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
