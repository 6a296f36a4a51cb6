"""Engines the generation loop can drive: ``cuda`` (the JIT runtime, runtime/session.py) and ``reference``
(the numpy INT4 simulation of nanoqwen/reference.py on the CPU: the same numbers the GPU is tested
against, slowly). ``auto`` picks cuda when a CUDA device answers and says so when it falls back."""

from __future__ import annotations

import sys
from pathlib import Path

from . import NanoqwenError
from .runtime.generate import check_request
from .runtime.sampler import HostSampler, Sampling

BACKENDS = ("auto", "cuda", "reference")


def cuda_available() -> bool:
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, n = driver.cuDeviceGetCount()
    except Exception:  # noqa: BLE001 - no bindings, or no libcuda at all (the bindings raise when loading it)
        return False
    return err == driver.CUresult.CUDA_SUCCESS and n > 0


class ReferenceEngine:
    """The numpy INT4 simulation behind the same ``generate`` iterator as the CUDA engine."""

    name = "reference (numpy INT4 simulation, CPU)"

    def __init__(self, path: str | Path, context: int):
        from .nqfile import NanoqwenFile
        from .reference import Fp32Weights, Reference

        f = NanoqwenFile(path)
        self.dims, self.context = f.dims, context
        self.ref = Reference(Fp32Weights.from_file(f), max_seq=context)

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling):
        check_request(self.dims, prompt, max_new_tokens, self.context)
        sample = HostSampler(sampling)
        logits = self.ref.prefill(prompt)[-1]
        for i in range(max_new_tokens):
            tok = sample(logits)
            yield tok
            if i + 1 < max_new_tokens:
                logits = self.ref.decode(tok)


def open_engine(backend: str, path: str | Path, context: int, eager: bool = False, log=None):
    """An engine for the .nanoqwen file ``path`` with a KV cache of ``context`` tokens."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if backend not in BACKENDS:
        raise NanoqwenError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if cuda_available() else "reference"
        if backend == "reference":
            log("no CUDA device found: running the numpy reference backend on the CPU (slow)")
    if backend == "reference":
        return ReferenceEngine(path, context)
    if not cuda_available():
        raise NanoqwenError("--backend cuda: no CUDA device available (no driver, or no GPU visible)")
    from .runtime.session import CudaSession
    return CudaSession(path, context, eager=eager, log=log)
