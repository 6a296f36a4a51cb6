"""Engines the generation loop can drive: ``cuda`` (the JIT runtime, runtime/session.py) and ``reference``
(the numpy INT4 simulation of nanoqwen/reference.py on the CPU: the same numbers the GPU is tested
against, slowly). ``auto`` picks cuda when a CUDA device answers and says so when it falls back."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from . import NanoqwenError
from .runtime.drafters import DraftModel, SpeculateError, Speculation
from .runtime.generate import check_request
from .runtime.prefix_cache import PrefixCache
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
    """The numpy INT4 simulation behind the same engine contract as the CUDA engine, prefix reuse
    included: the same policy (runtime/prefix_cache.py) over a pool of ``kv_tokens`` positions in pages of
    the config's size; a kept sequence carries its K/V rows, copied back into the simulation when a
    request continues it.

    ``speculate`` (a drafter setting, runtime/drafters.py; None = plain decoding) turns on speculative
    decoding for greedy requests: a verify step runs the last token and k drafts at positions p..p+k in one
    ``extend`` (row invariant: each row is computed as a single decode step would compute it, so the
    output is plain greedy's bit for bit), accepts the drafts equal to the argmax before them plus the
    model's own next token, and
    moves the position back past the rejected ones (their K/V rows are overwritten later). Sampled
    requests (temperature > 0) decode plainly: drafting switches off rather than rejection-sample.
    ``drafted_tokens`` / ``accepted_tokens`` count the most recent request's drafts, like ``cached_tokens``."""

    name = "reference (numpy INT4 simulation, CPU)"

    def __init__(self, path: str | Path, context: int, kv_tokens: int | None = None, verify: bool = True,
                 speculate=None):
        from .config import default
        from .nqfile import NanoqwenFile
        from .reference import Fp32Weights, Reference

        f = NanoqwenFile(path)
        if verify:
            f.verify()
        self.dims, self.context = f.dims, min(int(context), f.dims.max_positions)
        kv_tokens = self.context if kv_tokens is None else int(kv_tokens)
        if kv_tokens < self.context:
            raise NanoqwenError(f"kv_tokens ({kv_tokens}) must hold at least one request of {self.context} tokens")
        page = default().kv_cache.page_size
        self.cache = PrefixCache(-(-kv_tokens // page), page)
        self.ref = Reference(Fp32Weights.from_file(f), max_seq=self.context)
        self.speculate, self.spec = speculate, Speculation()
        self.cached_tokens = 0

    @property
    def drafted_tokens(self) -> int:
        return self.spec.drafted

    @property
    def accepted_tokens(self) -> int:
        return self.spec.accepted

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 logits: bool = False):
        check_request(self.dims, prompt, max_new_tokens, self.context)
        return self._run([int(t) for t in prompt], max_new_tokens, sampling, logits)

    def _run(self, prompt, max_new_tokens, sampling, logits):
        ref, P, sample, gen = self.ref, len(prompt), HostSampler(sampling, prompt), []
        with self.cache.request(prompt, P + max_new_tokens - 1) as lease:
            self.cached_tokens = lease.reused
            self.spec = spec = Speculation(self.speculate(prompt) if self.speculate and sampling.greedy else None)
            if lease.reused:
                ref.resume(*([rows[:lease.reused] for rows in kv] for kv in lease.payload))
            else:
                ref.reset()
            try:
                rows, drafts = ref.extend(prompt[lease.reused:])[-1:], []
                while True:   # rows[i] chooses the token after drafts[:i]; without drafts, one plain step
                    block = spec.accept(drafts, [sample(row) for row in rows])
                    ref.pos -= len(drafts) + 1 - len(block)   # back past the rejected drafts
                    gen += block
                    for tok, row in zip(block, rows):
                        yield (tok, row.copy()) if logits else tok
                    if len(gen) == max_new_tokens:
                        break
                    drafts = spec.draft(max_new_tokens - len(gen) - 1)
                    rows = ref.extend([gen[-1]] + drafts)
            finally:   # positions 0..pos-1 have their K/V, however the request ended
                lease.tokens = (prompt + gen)[:ref.pos]
                lease.payload = [[ref.kv(i)[j].copy() for i in range(self.dims.layers)] for j in (0, 1)]

    def close(self) -> None:
        self.cache.clear()
        if self.speculate is not None:
            self.speculate.close()


def open_engine(backend: str, path: str | Path, context: int, eager: bool = False, log=None,
                kv_tokens: int | None = None, verify: bool = True, speculate=None):
    """An engine for the .nanoqwen file ``path`` taking requests of up to ``context`` tokens, keeping
    recent sequences for prefix reuse in a KV pool of ``kv_tokens`` (default ``context``); ``verify`` checks
    every payload's checksum while loading (a corrupt file is an error naming the file and the tensor);
    ``speculate`` is a drafter setting (runtime/drafters.py) for speculative greedy decoding; a draft model
    is opened here, as an engine of the same backend and context (no drafter of its own)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if backend not in BACKENDS:
        raise NanoqwenError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if cuda_available() else "reference"
        if backend == "reference":
            log("no CUDA device found: running the numpy reference backend on the CPU (slow)")
    if backend == "cuda" and not cuda_available():
        raise NanoqwenError("--backend cuda: no CUDA device available (no driver, or no GPU visible)")
    if isinstance(speculate, DraftModel):   # first: the model's memory check then counts the draft's
        speculate = dataclasses.replace(speculate, engine=_open_draft(backend, path, speculate.path, context, eager,
                                                                      log, verify))
    try:
        if backend == "reference":
            return ReferenceEngine(path, context, kv_tokens, verify, speculate)
        from .runtime.session import CudaSession
        return CudaSession(path, context, eager=eager, log=log, kv_tokens=kv_tokens, verify=verify,
                           speculate=speculate)
    except BaseException:
        if speculate is not None:
            speculate.close()
        raise


def _open_draft(backend: str, target: str | Path, draft: str, context: int, eager: bool, log, verify: bool):
    """The draft model's engine; its vocabulary must be the target's (drafts are token ids)."""
    from .modelcache import resolve
    from .nqfile import NanoqwenFile
    path = resolve(draft, log=log)
    vocab, draft_vocab = NanoqwenFile(target).dims.vocab, NanoqwenFile(path).dims.vocab
    if draft_vocab != vocab:
        raise SpeculateError(f"--speculate draft:{draft}: its vocabulary has {draft_vocab} tokens, the model's "
                             f"{vocab}: a draft model must share the model's tokenizer")
    log(f"draft model {draft}: {backend} engine, context {context}")
    return open_engine(backend, path, context, eager=eager, log=log, verify=verify)
