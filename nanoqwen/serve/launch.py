"""`nanoqwen serve` as a child process, for the tests and the server benchmark: started with ``--port 0`` on
127.0.0.1 (the server binds a free port itself and names it in its first log line, so no other process can
take the port in between), ready once /health says 200, read through /metrics, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ..paths import PACKAGE_DIR


class ServerProcess:
    def __init__(self, model: str | Path, *args: str, backend: str = "reference", log_dir: Path,
                 env: dict | None = None, timeout: float = 180):
        inherited = {k: v for k, v in os.environ.items() if k != "NANOQWEN_API_KEY"}   # a key only when given
        env = dict(inherited, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")])),
                   **(env or {}))
        fd, path = tempfile.mkstemp(dir=log_dir, prefix="serve-", suffix=".log")
        os.close(fd)
        self.log = open(path, "a+")   # O_APPEND: the child's writes never land where ``output`` seeks
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoqwen.cli.main", "serve", str(model),
                                      "--backend", backend, "--host", "127.0.0.1", "--port", "0", *args],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        self.port = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nanoqwen serve exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"nanoqwen serve not ready in {timeout:.0f} s:\n{self.output()}")
            if self.port is None:
                bound = re.search(r"^nanoqwen serve: .* on http://127\.0\.0\.1:(\d+) ", self.output(), re.M)
                if bound:
                    self.port = int(bound[1])
                    self.url = f"http://127.0.0.1:{self.port}"
            try:
                if self.port is not None and httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, **labels) -> float:
        return read_metric(self.url, name, **labels)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def read_metric(url: str, name: str, **labels) -> float:
    """One sample of the /metrics of the server at ``url`` (0 when the series does not exist yet)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.rsplit(" ", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
