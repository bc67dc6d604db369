"""A real `kiln serve` process on 127.0.0.1 for the serving tests: free ports picked by the
server itself (port 0), read back from the line it prints once listening."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DIGITS = SRC / "kiln" / "data" / "digits_cnn.onnx"


class ServeProcess:
    """``kiln serve ARGS`` (or ``command``, a Python process that serves the same way) in a
    child process; ``http``/``grpc`` are its addresses."""

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        timeout: float = 90.0,
        command: list[str] | None = None,
    ):
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        argv = command or [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            *args,
        ]
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=full_env
        )
        deadline = time.monotonic() + timeout
        self.log: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"HTTP on ([\d.]+):(\d+)(?:, gRPC on [\d.]+:(\d+))?", line)
            if m:
                self.host = m.group(1)
                self.http = f"{m.group(1)}:{m.group(2)}"
                self.grpc = f"{m.group(1)}:{m.group(3)}" if m.group(3) else None
                # keep reading so the server never blocks on a full stderr pipe
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError(
            "kiln serve did not start:\n" + "".join(self.log) + (self.proc.stderr.read() or "")
        )

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def request(
        self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
    ) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one raw HTTP request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(
            f"http://{self.http}{path}", data=data, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
