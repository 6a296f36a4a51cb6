"""llama.cpp on the same GPU in the same device call as nanoqwen (`python -m nanoqwen.bench.llamacpp --json
OUT`), on the synthetic 7B at Q4_K_M (bench/gguf.py: random weights at the 7B's shapes, each tensor of llama.cpp's
own Q4_K_M type; 4.68 GB, the size of the real model's Q4_K_M file):

  (a) llama-bench, every layer on the GPU, flash attention on: pp512 at depth 0 (a cold 512-token prompt, the
      TTFT nanoqwen's bench reports) and tg128 at depths 512, 4096 and 16384 (ms/token after that many
      tokens of context, nanoqwen's decode protocol);
  (b) bench/concurrency.py's table against llama-server: the same clients, prompts (token ids) and levels as
      nanoqwen's, with ``ignore_eos`` (llama-server's field: the random model may sample an end token, which
      nanoqwen's word tokenizer does not have) and ``-np 8`` slots of continuous batching (issue 24), so
      16 clients queue for a slot there. (b)'s TTFT under load is at the client, with llama-server's own
      prompt-processing time beside it (its ``timings.prompt_ms``; it has no time-to-first-token histogram);
  (c) bench/serve.py's editor requests (a cold 512 prompt, the 4096-token re-request after a keystroke, the
      warm-ups) against llama-server with one slot, as an editor's server runs: the time at the client, the
      prompt processing and the tokens it reused (``timings.cache_n``).

The binaries come from tools/build_llama.sh (a pinned llama.cpp built for sm_90 into .llama/, git-ignored, and
packed into .llama.tar.xz for the device call's carry, which tools/gpu_check.sh unpacks) or from the folder
$NANOQWEN_LLAMA_CPP. They take cuBLAS and the CUDA runtime from the running Python's NVIDIA wheels (torch's,
on the GPU machine)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from .. import NanoqwenError, extras
from ..dims import QWEN25_7B
from ..paths import PACKAGE_DIR
from ..serve.launch import ChildServer
from . import concurrency, gguf, protocol
from .kernels import git_commit
from .serve import GEN_TOKENS, Editor, editor_cases, ttft_summary

PARALLEL = 8                      # llama-server's slots (-np), as issue 24 names
PROMPT = 512                      # (a)'s prompt and (b)'s
DEPTHS = (512, 4096, 16384)       # (a)'s decode contexts
GEN = 128                         # (a)'s decode tokens, and the editor's room to generate
REPETITIONS = 5


def llama_dir() -> Path:
    return Path(os.environ.get("NANOQWEN_LLAMA_CPP") or PACKAGE_DIR.parent / ".llama")


def binary(name: str) -> Path:
    path = llama_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build llama.cpp with tools/build_llama.sh (or set "
                                "NANOQWEN_LLAMA_CPP to a folder with llama-server and llama-bench)")
    return path


def environment() -> dict:
    """The environment with the NVIDIA wheels' library folders (cuBLAS, the CUDA runtime) on the loader's path."""
    spec = importlib.util.find_spec("nvidia")
    dirs = sorted({str(lib.parent) for root in (spec.submodule_search_locations if spec else [])
                   for pattern in ("**/libcublas.so.*", "**/libcudart.so.*") for lib in Path(root).glob(pattern)})
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [*dirs, os.environ.get("LD_LIBRARY_PATH")])))


def free_port() -> int:
    """A port that was free a moment ago (llama-server takes a port number, not 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer(ChildServer):
    """llama-server on the synthetic GGUF: every layer on the GPU, flash attention, ``args`` after."""

    def __init__(self, model: Path, *args: str, log_dir: Path, timeout: float = 600):
        port = free_port()
        super().__init__([str(binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                          "-ngl", "99", "-fa", "on", "--no-webui", *args], name="llama-server", log_dir=log_dir,
                         env=environment(), url=f"http://127.0.0.1:{port}", timeout=timeout)


def model_path(log) -> Path:
    """The synthetic 7B's GGUF, written once into the cache."""
    from .. import config
    path = config.cache_root(config.default().codegen) / "models" / "random-7b-q4_k_m.gguf"
    if not path.exists():
        log(f"writing the synthetic 7B at Q4_K_M (random weights) -> {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        gguf.write(QWEN25_7B, path, seed=protocol.SYNTHETIC_SEED)
    return path


def cuda_devices() -> list[str]:
    """The CUDA devices llama.cpp sees (`llama-bench --list-devices`). None where its CUDA backend did not
    load (no driver, a library missing): llama.cpp then runs on the CPU without a word, hours for the 7B."""
    out = subprocess.run([str(binary("llama-bench")), "--list-devices"], env=environment(), capture_output=True,
                         text=True, timeout=120)
    listed = out.stdout.split("Available devices:", 1)[-1].splitlines()
    return [line.strip() for line in listed if line.strip().startswith("CUDA")]


def llama_bench(model: Path, *args: str) -> list[dict]:
    """llama-bench's JSON records of one run."""
    out = subprocess.run([str(binary("llama-bench")), "-m", str(model), "-ngl", "99", "-fa", "1",
                          "-r", str(REPETITIONS), "-o", "json", *args],
                         env=environment(), capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"llama-bench exited with {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def bench(model: Path) -> dict:
    """(a): TTFT of the cold prompt and ms/token at each depth, from llama-bench's mean times."""
    records = (llama_bench(model, "-p", str(PROMPT), "-n", "0")
               + llama_bench(model, "-p", "0", "-n", str(GEN), "-d", ",".join(map(str, DEPTHS))))
    pp = next(r for r in records if r["n_prompt"] == PROMPT)
    return {"ttft_ms": pp["avg_ns"] / 1e6, "pp_tokens_per_s": pp["avg_ts"],
            "ms_per_token": {str(r["n_depth"]): 1e3 / r["avg_ts"] for r in records if r["n_gen"] == GEN},
            "build_commit": pp["build_commit"], "records": records}


def timed(url: str, client, prompt: list[int]) -> dict:
    """One request of one token: llama-server's prompt processing, the time at the client, the reused tokens."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    wall = time.perf_counter() - t0
    r.raise_for_status()
    t = r.json()["timings"]
    return {"prompt_ms": t["prompt_ms"], "client_ms": 1e3 * wall, "cached_tokens": t["cache_n"]}


def clients_at_once(model: Path, vocab: int, log, tmp: Path, prompt_len: int = PROMPT,
                    gen: int = GEN_TOKENS) -> dict:
    """(b) on one llama-server process."""
    context = prompt_len + max(gen, concurrency.LOAD_TOKENS)
    flags = f"-np {PARALLEL} -c {PARALLEL * context}"   # each slot's context is -c / -np
    srv = LlamaServer(model, *flags.split(), log_dir=tmp)
    try:
        res = concurrency.measure(srv.url, vocab, prompt_len, gen, PARALLEL,
                                  lambda client, prompt: timed(srv.url, client, prompt), log, {"ignore_eos": True})
    finally:
        srv.close()
    return res | {"protocol": concurrency.protocol_fields(prompt_len, gen, context, flags + " -fa on -ngl 99")}


def editor(model: Path, vocab: int, log, tmp: Path, reps: int = 10, sizes: Editor = Editor()) -> dict:
    """(c) on one llama-server process with one slot."""
    rng = np.random.default_rng(protocol.SYNTHETIC_SEED)

    def rand(n):
        return rng.integers(0, vocab, n).tolist()
    flags = f"-np 1 -c {sizes.long + GEN}"
    srv = LlamaServer(model, *flags.split(), log_dir=tmp)
    try:
        with httpx.Client(timeout=300) as client:   # one kept-alive connection, as an editor keeps

            def warm_up(prompt):   # not serve.warm_up: llama-server answers max_tokens 0 with one token
                client.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0}).raise_for_status()
            timed(srv.url, client, rand(sizes.cold))   # the first request through every path
            cases = editor_cases(lambda p: timed(srv.url, client, p), warm_up, rand, sizes, reps, vocab)
    finally:
        srv.close()
    return {case: ttft_summary(xs) for case, xs in cases.items()} | {
        "protocol": {"repetitions": reps, "sizes": asdict(sizes), "server": flags + " -fa on -ngl 99",
                     "warm_up": "POST /v1/completions with max_tokens 0"}}


def run(log=None) -> dict:
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    gpu = protocol.gpu_info("cuda")   # no device: one clear error before gigabytes are written
    devices = cuda_devices()
    if not devices:
        raise NanoqwenError("llama.cpp sees no CUDA device (its CUDA backend did not load: run "
                            f"`{binary('llama-bench')} --list-devices` for the loader's message)")
    log(f"llama.cpp sees {devices[0]}")
    model = model_path(log)
    log("llama-bench: pp512, tg128 at depths " + ", ".join(map(str, DEPTHS)))
    res = {"kind": "nanoqwen-bench-llamacpp", "schema": 1,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "gpu": gpu,
           "model": {"gguf": model.name, "bytes": model.stat().st_size,
                     "weights": f"random, seed {protocol.SYNTHETIC_SEED}, llama.cpp's Q4_K_M tensor types"},
           "llama_bench": bench(model)}
    with tempfile.TemporaryDirectory() as tmp:
        log(f"llama-server: the concurrency table, -np {PARALLEL}")
        res["llama_server_concurrency"] = clients_at_once(model, QWEN25_7B.vocab, log, Path(tmp))
        log("llama-server: the editor's requests, -np 1")
        res["llama_server_editor"] = editor(model, QWEN25_7B.vocab, log, Path(tmp))
    return res


def report(res: dict) -> str:
    b, e = res["llama_bench"], res["llama_server_editor"]
    sz = e["protocol"]["sizes"]

    def line(what, case):
        t = e[case]
        return (f"  {what}: {t['prompt_ms']['median']:.2f} ms prompt processing, {t['client_ms']['median']:.2f} ms "
                f"at the client (cached {t['cached_tokens'][0]})")
    return "\n".join([f"llama.cpp {b['build_commit']}: pp{PROMPT} TTFT {b['ttft_ms']:.2f} ms; ms/token "
                      + ", ".join(f"{v:.3f} at {k}" for k, v in b["ms_per_token"].items()),
                      f"llama-server -np {PARALLEL}:", concurrency.report(res["llama_server_concurrency"]),
                      "llama-server -np 1, an editor's requests:",
                      line(f"cold {sz['cold']}", "ttft_cold"),
                      line(f"{sz['long']} re-requested after a keystroke", "ttft_rerequest"),
                      line(f"{sz['long']} after a warm-up", "ttft_after_warm_up"),
                      line(f"{sz['long']} after a warm-up between keystrokes", "ttft_warm_up_between_keystrokes")])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    try:
        for name in ("llama-server", "llama-bench"):
            binary(name)
        extras.require("llamacpp", "the synthetic GGUF")
    except (FileNotFoundError, extras.MissingExtra) as e:
        p.error(str(e))
    try:
        res = run()
    except NanoqwenError as e:   # no CUDA device, most likely
        p.exit(1, f"{p.prog}: error: {e}\n")
    print(report(res))
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
