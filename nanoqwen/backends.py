"""Engines the generation loop can drive: ``cuda`` (the JIT runtime, runtime/session.py) and ``reference``
(the numpy INT4 simulation of nanoqwen/reference.py on the CPU: the same numbers the GPU is tested
against, slowly). ``auto`` picks cuda when a CUDA device answers and says so when it falls back."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from . import NanoqwenError
from .runtime.batch import Decoding, PagesShort, Rows, Sequence
from .runtime.drafters import DraftModel, SpeculateError, Speculation
from .runtime.generate import check_request
from .runtime.prefix_cache import PrefixCache
from .runtime.sampler import Sampling

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


class ReferenceBatch:
    """The multi-sequence step (runtime/batch.py) on the reference: each sequence a ``Reference`` of its own
    K/V over the shared weights (``Reference.sequence``), sized for its positions; a step computes every
    row as one decode step (``Reference.extend``), so nothing beside a row can change its bits. The pages
    of ``cache`` are the accounting; a kept sequence's K/V rows travel as its payload."""

    max_rows = None   # a verify of any length is one ``extend``
    costs = None      # steps are not timed: a drafter's k stands

    def __init__(self, cache: PrefixCache, ref):
        self.cache, self.ref = cache, ref

    def open(self, prompt: list[int], total: int) -> Sequence:
        if not self.cache.can_start(total):
            raise PagesShort(f"KV cache: {total} positions wait for pages held by running sequences")
        lease = self.cache.start(prompt, total)
        state = self.ref.sequence(total)
        if lease.reused:
            state.resume(*([rows[:lease.reused] for rows in kv] for kv in lease.payload))
        return Sequence(lease, state, len(prompt), total)

    def step(self, work: list) -> list[Rows]:
        """Every row's logits, whether asked for or not: they are computed anyway."""
        out = []
        for seq, tokens in work:
            seq.state.pos = seq.pos
            logits = seq.state.extend(tokens)
            out.append(Rows([int(np.argmax(row)) for row in logits], logits))
            seq.pos = seq.state.pos
        return out

    def close(self, seq: Sequence, tokens: list[int]) -> None:
        ref = seq.state
        ref.pos = seq.pos
        self.cache.keep(seq.lease, list(tokens[:seq.pos]),
                        [[ref.kv(i)[j].copy() for i in range(ref.dims.layers)] for j in (0, 1)])

    def pages(self) -> tuple[int, int, int]:
        return self.cache.usage()


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
    ``drafted_tokens`` / ``accepted_tokens`` count the most recent request's drafts, like ``cached_tokens``.

    ``batch`` is its multi-sequence step (runtime/batch.py), which the server schedules several requests
    over; ``generate`` is one request alone, run as a batch of one sequence."""

    name = "reference (numpy INT4 simulation, CPU)"
    prompt_logits = True   # its step returns every prompt row's logits (echo's prompt logprobs, serve/echo.py)

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
        self.batch = ReferenceBatch(self.cache, self.ref)
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
        """One request alone: a batch of one sequence (so alone and batched are one computation)."""
        with self.cache.alone():
            seq = self.batch.open(prompt, len(prompt) + max_new_tokens - 1)
            self.cached_tokens = seq.reused
            d = Decoding(seq, prompt, max_new_tokens, sampling, self.speculate, logits=logits)
            self.spec = d.spec
            try:
                while not d.done:
                    for tok, row in d.advance(self.batch.step([(seq, d.rows(len(prompt)))])[0]):
                        yield (tok, row.copy()) if logits else tok
            finally:   # positions 0..pos-1 have their K/V, however the request ended
                self.batch.close(seq, prompt + d.gen)

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
