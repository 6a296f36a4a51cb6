"""Helpers of the server tests: the test model with Qwen2.5-Coder's FIM and repository tokens, a real
`nanoqwen serve` process on a free port, and the greedy answer of the reference engine in-process (what
the server must return)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from nanoqwen import ROOT, testmodels

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def fim_model_dir(dst: Path) -> Path:
    """small-py with the FIM / repository special tokens. Tokens its tokenizer lacks are appended, and the
    embedding and lm_head grow to a multiple of 128 rows (kernel-friendly), the new rows copying
    <|im_start|>'s, which greedy decoding never prefers (ties go to the lower id)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(testmodels.SMALL_PY_DIR, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    missing = [t for t in FIM_TOKENS if tok.token_to_id(t) is None]
    if not missing:
        return dst
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "config.json").read_text())
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 128) * 128
    w = load_file(str(dst / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = w[name][1:2].expand(vocab - cfg["vocab_size"], -1)
        w[name] = torch.cat([w[name], extra]).contiguous()
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg | {"vocab_size": vocab}, indent=2))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m nanoqwen.cli.main serve MODEL ...` in a subprocess; ``url`` once /health says 200."""

    def __init__(self, model: Path, *args: str, backend: str = "reference", cache_dir: Path, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, NANOQWEN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
        self.log = open(cache_dir / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoqwen.cli.main", "serve", str(model),
                                      "--backend", backend, "--host", "127.0.0.1", "--port", str(self.port), *args],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.saw_loading = False
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"server not ready in {timeout} s:\n{self.output()}"
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] == "loading", r.text
                self.saw_loading = True
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when the series does not exist yet)."""
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.rsplit(" ", 1)[0] == want:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def greedy(engine, stop: frozenset[int], prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's greedy tokens for ``prompt``, a final stop token included (what usage counts)."""
    from nanoqwen.runtime.sampler import Sampling
    out = []
    for t in engine.generate(prompt, max_tokens, Sampling()):
        out.append(t)
        if t in stop:
            break
    return out
