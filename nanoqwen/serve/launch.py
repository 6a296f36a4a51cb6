"""A server as a child process, for the tests and the server benchmarks: `nanoqwen serve` (``ServerProcess``)
or another server that the benchmarks compare with (bench/llamacpp.py's llama-server). Each binds 127.0.0.1,
is ready once /health says 200, and is stopped with SIGTERM; its output goes to a log file."""

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


class ChildServer:
    """``argv`` started with ``env``; its URL is ``url``, or the first match of ``bound`` in its output (a
    regular expression whose group 1 is the port: the server picks a free port itself and names it)."""

    def __init__(self, argv: list[str], *, name: str, log_dir: Path, env: dict | None = None,
                 url: str | None = None, bound: str | None = None, timeout: float = 180):
        fd, path = tempfile.mkstemp(dir=log_dir, prefix=f"{name.replace(' ', '-')}-", suffix=".log")
        os.close(fd)
        self.log = open(path, "a+")   # O_APPEND: the child's writes never land where ``output`` seeks
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = url
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} not ready in {timeout:.0f} s:\n{self.output()}")
            if self.url is None:
                m = re.search(bound, self.output(), re.M)
                if m:
                    self.url = f"http://127.0.0.1:{int(m[1])}"
            try:
                if self.url is not None and httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
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


class ServerProcess(ChildServer):
    """`nanoqwen serve MODEL ARGS` on ``--port 0``: it binds a free port and names it in its first log line,
    so no other process can take the port in between."""

    def __init__(self, model: str | Path, *args: str, backend: str = "reference", log_dir: Path,
                 env: dict | None = None, timeout: float = 180):
        inherited = {k: v for k, v in os.environ.items() if k != "NANOQWEN_API_KEY"}   # a key only when given
        env = dict(inherited, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")])),
                   **(env or {}))
        super().__init__([sys.executable, "-m", "nanoqwen.cli.main", "serve", str(model), "--backend", backend,
                          "--host", "127.0.0.1", "--port", "0", *args],
                         name="nanoqwen serve", log_dir=log_dir, env=env, timeout=timeout,
                         bound=r"^nanoqwen serve: .* on http://127\.0\.0\.1:(\d+) ")
        self.port = int(self.url.rsplit(":", 1)[1])


def read_metric(url: str, name: str, **labels) -> float:
    """One sample of the /metrics of the server at ``url`` (0 when the series does not exist yet)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.rsplit(" ", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
