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

    def __init__(self, path: str | Path, context: int, verify: bool = True):
        from .nqfile import NanoqwenFile
        from .reference import Fp32Weights, Reference

        f = NanoqwenFile(path)
        if verify:
            f.verify()
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


def open_engine(backend: str, path: str | Path, context: int, eager: bool = False, log=None, verify: bool = True):
    """An engine for the .nanoqwen file ``path`` with a KV cache of ``context`` tokens; ``verify`` checks every
    payload's checksum while loading (a corrupt file is an error naming the file and the tensor)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if backend not in BACKENDS:
        raise NanoqwenError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if cuda_available() else "reference"
        if backend == "reference":
            log("no CUDA device found: running the numpy reference backend on the CPU (slow)")
    if backend == "reference":
        return ReferenceEngine(path, context, verify)
    if not cuda_available():
        raise NanoqwenError("--backend cuda: no CUDA device available (no driver, or no GPU visible)")
    from .runtime.session import CudaSession
    return CudaSession(path, context, eager=eager, log=log, verify=verify)
