"""HF checkpoint (or random weights) -> .nanoqwen, streaming tensor by tensor and row block by row block.

Peak memory is one output tensor (at most the fp16 embedding / lm_head, vocab x hidden x 2 bytes) plus a
few row blocks in flight; the checkpoint is never loaded whole. Row blocks are quantized on a thread pool
(numpy releases the GIL in its kernels), one block per core.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from . import quant, tokenizer
from .config import Config, default
from .dims import ModelDims
from .hf import HFCheckpoint
from .nqfile import INT4, Writer, expected_tensors, payload_bytes, weight_tensors

BLOCK_ELEMS = 1 << 22  # elements per row block: 16 MB of fp32, small enough for a few in flight per core

Progress = Callable[[int], None]


def _rows2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor as (rows, elements per row) for row-block streaming; a 1-D tensor is one row."""
    rows = shape[0] if len(shape) > 1 else 1
    return rows, int(np.prod(shape, dtype=np.int64)) // rows


class _Pool(ThreadPoolExecutor):
    def __init__(self, workers: int | None):
        self.workers = workers or os.cpu_count() or 1
        super().__init__(self.workers)


class _WriteBehind:
    """Writes (and checksums) one tensor on its own thread while the next is computed; one write in flight,
    so at most two finished tensors are alive."""

    def __init__(self):
        self._ex = ThreadPoolExecutor(1)
        self._pending = None

    def submit(self, fn, *args) -> None:
        self.wait()
        self._pending = self._ex.submit(fn, *args)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "_WriteBehind":
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                self.wait()
        finally:
            self._ex.shutdown(wait=True)  # never let the Writer close its file under a running write


def _blocks(pool: _Pool, shape: tuple[int, ...], work: Callable[[int, int], int],
            progress: Progress | None) -> None:
    """Run ``work(r0, r1)`` over row blocks on the pool in order, at most two blocks per worker in flight."""
    rows, row_elems = _rows2d(shape)
    step = max(1, BLOCK_ELEMS // row_elems)
    starts = list(range(0, rows, step))
    ahead = 2 * pool.workers
    futures = [pool.submit(work, r, min(r + step, rows)) for r in starts[:ahead]]
    for i in range(len(starts)):
        done = futures[i].result()
        if i + ahead < len(starts):
            r = starts[i + ahead]
            futures.append(pool.submit(work, r, min(r + step, rows)))
        if progress:
            progress(done)


def _int4_rows(shape: tuple[int, int], cfg: Config, pool, progress,
               rows_fn: Callable[[int, int], tuple[np.ndarray, np.ndarray, int]]):
    """Fill packed [N, K/8] and scales [N, K/g] from ``rows_fn(r0, r1) -> (packed, scales, bytes_done)``."""
    n, k = shape
    packed = np.empty((n, k // 8), dtype=np.uint32)
    scales = np.empty((n, k // cfg.quant.group_size), dtype=np.float16)

    def work(r0, r1):
        p, s, done = rows_fn(r0, r1)
        assert p.shape == packed[r0:r1].shape and s.shape == scales[r0:r1].shape  # no silent broadcasting
        packed[r0:r1], scales[r0:r1] = p, s
        return done

    _blocks(pool, shape, work, progress)
    return packed, scales


def _fp16_rows(shape: tuple[int, ...], pool, progress, rows_fn: Callable[[int, int], tuple[np.ndarray, int]]):
    out = np.empty(shape, dtype=np.float16)
    flat = out.reshape(_rows2d(shape))

    def work(r0, r1):
        block, done = rows_fn(r0, r1)
        assert block.shape == flat[r0:r1].shape  # no silent broadcasting
        flat[r0:r1] = block
        return done

    _blocks(pool, shape, work, progress)
    return out


def _source_itemsize(ckpt: HFCheckpoint, name: str) -> int:
    return 4 if ckpt.tensors[name].dtype == "F32" else 2


def total_source_bytes(ckpt: HFCheckpoint, cfg: Config | None = None) -> int:
    """Checkpoint bytes pack_hf reads (the progress total)."""
    return sum(int(np.prod(s, dtype=np.int64)) * _source_itemsize(ckpt, n)
               for n, (_, s) in weight_tensors(ckpt.dims, cfg or default()).items())


def pack_hf(ckpt: HFCheckpoint, out: str | Path, progress: Progress | None = None, cfg: Config | None = None,
            workers: int | None = None) -> Path:
    """Quantize ``ckpt`` into ``out``: INT4 for cfg.quant.int4_tensors, fp16 (range-checked) for the rest, and
    the directory's tokenizer files as blobs, so the file runs with nothing beside it.
    ``progress(n)`` is called with checkpoint bytes consumed."""
    cfg = cfg or default()
    sources = weight_tensors(ckpt.dims, cfg)
    ckpt.check({n: s for n, (_, s) in sources.items()})
    blobs = tokenizer.files_to_store(ckpt.path, ckpt.dims)
    with _Pool(workers) as pool, Writer(out, ckpt.dims, cfg=cfg, blobs=blobs) as w, _WriteBehind() as wb:
        for name, (tag, shape) in sources.items():
            row_bytes = _rows2d(shape)[1] * _source_itemsize(ckpt, name)
            if tag == INT4:
                def rows(r0, r1, name=name):
                    q, s = quant.quantize(ckpt.read(name, r0, r1), name=f"{name}[{r0}:{r1}]", quant=cfg.quant)
                    return quant.pack(q), s, (r1 - r0) * row_bytes
                wb.submit(w.add_int4, name, *_int4_rows(shape, cfg, pool, progress, rows))
            else:
                def rows(r0, r1, name=name):
                    x = ckpt.read(name, r0, r1) if len(shape) > 1 else ckpt.read(name)  # 1-D: one row
                    x = x.reshape(r1 - r0, -1)
                    return quant.to_fp16(x, f"{name}[{r0}:{r1}]"), (r1 - r0) * row_bytes
                wb.submit(w.add_fp16, name, _fp16_rows(shape, pool, progress, rows))
    return Path(out)


# Random weights: statistics of a trained Qwen2.5 checkpoint, roughly (not its values).
_EMBED_STD = 0.02
_BIAS_STD = 0.02
_NORM_STD = 0.02


def _raw_bits(key: list[int], n: int, dtype) -> np.ndarray:
    """n random words of ``dtype`` from PCG64's raw output: ~1.5 GB/s, 3-10x faster than Generator.integers."""
    per = 8 // np.dtype(dtype).itemsize
    return np.random.PCG64(key).random_raw(-(-n // per)).view(dtype)[:n]


def _random_nibble_words(key: list[int], shape: tuple[int, int]) -> np.ndarray:
    """Uniform random nibbles with -8 (0b1000) turned into 0, as the quantizer never emits -8. In place:
    fresh temporaries per step would cost more in page faults than the bit operations themselves."""
    w = _raw_bits(key, shape[0] * shape[1], np.uint32).reshape(shape)
    t = w >> np.uint32(1)
    t |= w
    u = w >> np.uint32(2)
    t |= u
    np.invert(t, out=t)  # bit 0 of each nibble: its low three bits are all zero
    np.right_shift(w, np.uint32(3), out=u)
    u &= t
    u &= np.uint32(0x11111111)  # bit 0 of each nibble set iff the nibble is 0b1000
    u <<= np.uint32(3)
    w ^= u
    return w


def _normal_table(key: list[int], center: float, std: float) -> np.ndarray:
    """65536 fp16 samples of N(center, std): indexing it with random uint16 draws from (nearly) that normal
    at ~0.7 GB/s, where Generator.standard_normal + cast manages ~0.05 GB/s."""
    return (center + std * np.random.default_rng(key).standard_normal(1 << 16)).astype(np.float16)


def pack_random(dims: ModelDims, out: str | Path, seed: int = 0, progress: Progress | None = None,
                cfg: Config | None = None, workers: int | None = None) -> Path:
    """Random weights at ``dims``, written directly in packed form (no float weights), synthetic flag set.
    Deterministic in ``seed`` (each row block has its own generator, so the thread count does not matter).
    INT4 weights: uniform nibbles in -7..7 and per-group scales ~ 1/sqrt(K) so W x keeps x's scale;
    norms ~ 1, biases and embeddings ~ N(0, 0.02). ``progress(n)`` is called with output bytes written."""
    cfg = cfg or default()
    g = cfg.quant.group_size
    mean_q2 = 2 * sum(i * i for i in range(1, 8)) / 16  # E[q^2] of the nibble distribution above
    with _Pool(workers) as pool, Writer(out, dims, synthetic=True, cfg=cfg) as w, _WriteBehind() as wb:
        for idx, (name, (tag, shape)) in enumerate(weight_tensors(dims, cfg).items()):
            if tag == INT4:
                n, k = shape

                def rows(r0, r1, idx=idx, k=k):
                    packed = _random_nibble_words([seed, idx, r0, 0], (r1 - r0, k // 8))
                    rng = np.random.default_rng([seed, idx, r0, 1])
                    jitter = np.exp(np.float32(0.1) * rng.standard_normal((r1 - r0, k // g), dtype=np.float32))
                    scales = (jitter / np.float32(np.sqrt(k * mean_q2))).astype(np.float16)
                    return packed, scales, packed.nbytes + scales.nbytes
                wb.submit(w.add_int4, name, *_int4_rows(shape, cfg, pool, progress, rows))
            else:
                center, std = (1.0, _NORM_STD) if name.endswith("norm.weight") else \
                    (0.0, _BIAS_STD if name.endswith(".bias") else _EMBED_STD)
                table = _normal_table([seed, idx], center, std)
                row_elems = _rows2d(shape)[1]

                def rows(r0, r1, idx=idx, table=table, row_elems=row_elems):
                    x = table[_raw_bits([seed, idx, r0], (r1 - r0) * row_elems, np.uint16)]
                    return x.reshape(r1 - r0, row_elems), x.nbytes
                wb.submit(w.add_fp16, name, _fp16_rows(shape, pool, progress, rows))
    return Path(out)


def total_random_bytes(dims: ModelDims, cfg: Config | None = None) -> int:
    """Payload bytes pack_random writes (the progress total)."""
    return sum(payload_bytes(t, s) for t, s in expected_tensors(dims, cfg or default()).values())
