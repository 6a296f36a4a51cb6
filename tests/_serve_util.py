"""Helpers of the server tests: the test model with Qwen2.5-Coder's FIM and repository tokens, a real
`nanoqwen serve` process on a free port, and the greedy answer of the reference engine in-process (what
the server must return)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nanoqwen import testmodels
from nanoqwen.serve.launch import ServerProcess

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


def model_and_cache(tmp_path_factory, name: str) -> tuple[Path, Path]:
    """(the small-py model directory with FIM tokens, an empty cache root) for one test module's server."""
    root = tmp_path_factory.mktemp(name)
    (root / "cache").mkdir()
    return fim_model_dir(root / "small-py-fim"), root / "cache"


def model_fixtures(name: str):
    """(model, local, backend) module fixtures: the small model packed under ``name`` (model_and_cache), an
    engine of it in this process, (engine, tokenizer, stop ids), and its backend ("reference"; a GPU module
    that imports the tests redefines ``backend``). In a test module:
    ``model, local, backend = model_fixtures(..)``."""
    import pytest

    @pytest.fixture(scope="module")
    def model(tmp_path_factory):
        return model_and_cache(tmp_path_factory, name)

    @pytest.fixture(scope="module")
    def backend():
        return "reference"

    @pytest.fixture(scope="module")
    def local(model, backend):
        engine, tok, stop = open_local(*model, backend=backend)
        yield engine, tok, stop
        engine.close()

    return model, local, backend


def server(model: Path, *args: str, backend: str = "reference", cache_dir: Path) -> ServerProcess:
    """A real `nanoqwen serve` on a free port with its own kernel / model cache."""
    return ServerProcess(model, *args, backend=backend, log_dir=cache_dir, env={"NANOQWEN_CACHE_DIR": str(cache_dir)})


def open_local(model_dir: Path, cache_dir: Path, backend: str = "reference", context: int = 4096):
    """(engine, tokenizer, stop ids): the server's backend in this process, for the expected answers."""
    import pytest
    from nanoqwen import tokenizer
    from nanoqwen.backends import open_engine
    from nanoqwen.modelcache import resolve
    from nanoqwen.serve import prompts
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(cache_dir))
        path = resolve(model_dir, log=lambda m: None)
        engine = open_engine(backend, path, context, log=lambda m: None)
    tok = tokenizer.load(path)
    return engine, tok, prompts.stop_ids(tok)


def greedy(engine, stop: frozenset[int], prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's greedy tokens for ``prompt``, a final stop token included (what usage counts)."""
    from nanoqwen.runtime.sampler import Sampling
    out = []
    for t in engine.generate(prompt, max_tokens, Sampling()):
        out.append(t)
        if t in stop:
            break
    return out


class ScriptedEngine:
    """A stand-in engine that answers every request with ``script`` (token ids), then its last id
    repeated, ``delay_s`` per token; it records each request's prompt, length and sampling. Its logits
    (when asked for) put 0 on the scripted token and -10 elsewhere."""
    name, cached_tokens, speculate = "scripted stand-in engine", 0, None

    def __init__(self, script: list[int], context: int = 64, vocab: int | None = None, delay_s: float = 0.0):
        import dataclasses
        from nanoqwen.testmodels import tiny_dims
        self.script, self.context, self.requests, self.delay_s = list(script), context, [], delay_s
        dims = tiny_dims()
        self.dims = dataclasses.replace(dims, max_positions=context, vocab=vocab or dims.vocab)

    def generate(self, prompt, max_new_tokens, sampling, logits=False):
        import time
        import numpy as np
        from nanoqwen.runtime.generate import check_request
        check_request(self.dims, prompt, max_new_tokens, self.context)
        self.requests.append((list(prompt), max_new_tokens, sampling))
        for i in range(max_new_tokens):
            tok = self.script[min(i, len(self.script) - 1)]
            time.sleep(self.delay_s)
            if logits:
                row = np.full(self.dims.vocab, -10.0, np.float32)
                row[tok] = 0.0
                yield tok, row
            else:
                yield tok


def in_worker(engine, tok, backend: str):
    """serve_in_process's ``load`` for an engine opened in this thread: a CUDA engine's context is made
    current in the worker thread that runs it (``nanoqwen serve`` opens its engine there)."""
    def load():
        if backend == "cuda":
            from nanoqwen.runtime import driver
            driver.device().make_current()
        return engine, tok
    return load


def serve_in_process(load, model_id: str = "m", **worker_kw):
    """The app with a worker over ``load()`` -> (engine, tokenizer), in this process; ready on return
    (``client.worker`` is the worker; ``worker_kw`` go to it)."""
    import time
    from starlette.testclient import TestClient
    from nanoqwen.serve.app import Server, create_app
    from nanoqwen.serve.metrics import Metrics
    from nanoqwen.serve.worker import Worker
    metrics = Metrics()
    worker = Worker(load, metrics, **{"max_queue": 4, "log": lambda m: None, **worker_kw})
    client = TestClient(create_app(Server(worker, metrics, model_id)))
    worker.start()
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, client.get("/health").text
        time.sleep(0.02)
    client.worker = worker
    return client
