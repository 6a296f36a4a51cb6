"""The CUDA engine: one model on one GPU, ready to generate. Start-up in the order that fails fastest:
open and validate the file, check the device and that every device buffer (runtime/memory.py) fits in its free
memory (one line naming the bytes), build (or fetch from the cache) every kernel, upload the weights once,
allocate the KV pool, then warm up with one request (eager prefill and step) and capture the step graph.
Reports load time, compile time and cache hits like gpt-fast. ``prefill="chunked"`` (the default) runs
prompts through the tensor-core prefill in chunks of ``prefill.chunk_tokens``; ``prefill="decode"`` feeds
them token by token through the decode step (a debugging baseline, bit-identical to teacher forcing).

Parts (docs/architecture.md, "Runtime seams"): a SequenceState owns what every launch shares, the Decoder
and the Prefiller run over it, the Runner orders them per request and keeps recent sequences in a KV pool
of ``kv_tokens`` positions (default: ``context``) for prefix reuse."""

from __future__ import annotations

import time
from pathlib import Path

from .. import NanoqwenError, codegen, config
from ..codegen.cache import STATS
from ..nqfile import NanoqwenFile
from ..progress import Progress
from ..reference import rope_tables
from ..units import size
from . import driver, memory
from . import decoder as decoder_mod
from . import prefill as prefill_mod
from . import rowstep as rowstep_mod
from . import state as state_mod
from .decoder import Decoder, step_specs
from .paged_kv import KVLayout, PagedKVCache
from .prefill import Prefiller, prefill_specs
from .prefix_cache import PrefixCache
from .batchstep import BatchStep
from .rowstep import RowStep
from .runner import Runner
from .sampler import Sampling
from .state import SequenceState
from .weights import Weights, plan

PREFILL_MODES = ("chunked", "decode")


class DeviceError(NanoqwenError):
    pass


class CudaSession:
    def __init__(self, path: str | Path, context: int, eager: bool = False, log=print,
                 cfg: config.Config | None = None, ahead: int = 8, prefill: str = "chunked",
                 kv_tokens: int | None = None, verify: bool = True, speculate=None):
        cfg = cfg or config.default()
        if prefill not in PREFILL_MODES:
            raise NanoqwenError(f"prefill mode must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        t0 = time.perf_counter()
        f = NanoqwenFile(path, cfg)
        self.dims = d = f.dims
        dev = driver.device()
        props = dev.props
        if props.compute_capability < (9, 0):
            raise DeviceError(f"{props.name} is sm_{props.compute_capability[0]}{props.compute_capability[1]}: "
                              f"nanoqwen's kernels need Hopper (sm_90)")
        self.context = min(int(context), d.max_positions)
        layout = KVLayout.for_model(d, cfg, self.context, kv_tokens)
        chunked, chunk = prefill == "chunked", min(cfg.prefill.chunk_tokens, self.context)
        gpu = codegen.GpuProfile.from_props(props)
        step = step_specs(d, cfg, props.name, gpu)
        specs = step | (prefill_specs(d, cfg, gpu) if chunked else {})
        # the multi-row step of each bucket above 1 (the speculative verify), roles prefixed "m<rows>."
        buckets = [m for m in cfg.multirow.buckets if m > 1]
        row_specs = {m: step_specs(d, cfg, props.name, gpu, m) for m in buckets}
        specs |= {f"m{m}.{role}": spec for m, roles in row_specs.items() for role, spec in roles.items()}
        w_bytes = plan(f).nbytes
        # The parts' buffer tables in their allocation order, which is not free: with the same kernels and
        # SASS the decode step ran 1.8% slower when its activations followed the shared state rather than
        # the prefill buffers, and 0.8% slower again when the prefill buffers grew; first, the decode
        # step's buffers no longer move with the other parts' sizes (docs/perf-notes.md, "Buffer placement").
        pc = cfg.prefill
        tables = {"decode": decoder_mod.buffer_bytes(d, specs)} | ({"prefill": prefill_mod.buffer_bytes(
            d, chunk, self.context, pc.small_m_tokens, pc.attention_block_keys, pc.graph_buckets)}
            if chunked else {}) | {"state": state_mod.buffer_bytes(d, self.context)}
        if buckets:   # last: the decode step's buffers keep their measured placement
            tables["rows"] = rowstep_mod.buffer_bytes(d, row_specs[buckets[-1]], layout.table_len)
        self.device_bytes = memory.merge(weights=w_bytes, kv=layout.total_bytes, **tables)
        memory.check_fits(self.device_bytes, props.free_mem, props.total_mem, props.name)
        hits0, t1 = STATS.hits, time.perf_counter()
        built = codegen.build_many(specs.values(), progress=codegen.ProgressLine(), cfg=cfg.codegen)
        # the one-row step's kernels take its shared-memory split; the m-row steps' and prefill's the driver's
        kernels = {role: (spec, driver.load(b, carveout=cfg.launch.smem_carveout if role in step else -1))
                   for (role, spec), b in zip(specs.items(), built)}
        t2 = time.perf_counter()
        bar = Progress(w_bytes, "upload")
        self.weights = Weights(f, progress=bar, verify=verify)
        bar.close()
        self.kv = PagedKVCache(layout)
        bufs = {part: memory.Buffers(table) for part, table in tables.items()}
        self.state = SequenceState(d, self.weights, self.kv, rope_tables(d, self.context), self.context,
                                   slots=ahead + 2, bufs=bufs["state"])
        self.decoder = Decoder(self.state, kernels, bufs=bufs["decode"])
        self.prefiller = (Prefiller(self.state, kernels, chunk, pc.small_m_tokens, bufs=bufs["prefill"],
                                    graph_buckets=pc.graph_buckets, row_tail_tokens=pc.row_tail_tokens)
                          if chunked else None)
        self.rows = RowStep(self.state, {m: {role: kernels[f"m{m}.{role}"] for role in row_specs[m]}
                                         for m in buckets}, bufs=bufs["rows"]) if buckets else None
        self.runner = Runner(self.state, self.decoder, self.prefiller,
                             PrefixCache(layout.num_pages, layout.page_size), self.context, ahead, rows=self.rows)
        list(self.runner.generate([0], 2))   # eager: loads every module, touches every buffer
        if self.rows is not None:   # each bucket once, eagerly, over the warm-up's page (positions 0..m-1)
            for m in buckets:
                self.rows.run([0] * m, list(range(m)))
        if self.prefiller is not None:   # each chunk graph's kernels once, over the warm-up's page
            self.prefiller.warm()
        self.runner.cache.clear()
        self.runner.speculate = speculate   # after the warm-up: that one request decodes plainly
        self.batch = BatchStep(self.runner)   # the server's several sequences at once (runtime/batch.py)
        # every prompt row's logits (echo): the prefill's final rows through the multi-row lm_head
        self.prompt_logits = self.prefiller is not None and self.rows is not None
        if not eager:
            self.decoder.capture()
            if self.rows is not None:
                self.rows.capture()
                self.rows.measure()
                # what a speculative request weighs its draft length by (runtime/drafters.py, best_draft)
                self.runner.costs = {1: self.decoder.measure(), **self.rows.ms}
            if self.prefiller is not None:
                self.prefiller.capture()
        self.name = f"cuda {props.name}, {'eager' if eager else 'graph'}{'' if self.prefiller else ', decode prefill'}"
        # weight bytes one token streams (the embedding table is read one row at a time unless tied)
        self.bytes_per_token = w_bytes - (0 if d.tie_embeddings else self.weights.plan.regions["embed"].nbytes)
        log(f"loaded {f.path.name} in {time.perf_counter() - t0:.1f} s: {len(specs)} kernels "
            f"({STATS.hits - hits0} cached, {t2 - t1:.1f} s), weights {size(w_bytes)}, "
            f"KV cache {layout.num_pages * layout.page_size} tokens")

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the most recent request reused from the prefix cache."""
        return self.runner.cached_tokens

    def pages(self) -> tuple[int, int, int]:
        """KV pages: (held by the running request, kept for prefix reuse, in the pool)."""
        return self.runner.cache.usage()

    @property
    def speculate(self):
        return self.runner.speculate

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens of the most recent request (speculative decoding), and those accepted."""
        return self.runner.spec.drafted

    @property
    def accepted_tokens(self) -> int:
        return self.runner.spec.accepted

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), logits: bool = False):
        return self.runner.generate(prompt, max_new_tokens, sampling, logits)

    def close(self) -> None:
        """Give the GPU memory back (tests open several sessions in one process), a draft model's too."""
        if self.runner.speculate is not None:
            self.runner.speculate.close()
        self.batch.free()
        self.decoder.close()
        for part in (self.prefiller, self.rows):
            if part is not None:
                part.close()
        self.state.close()
        self.kv.free()
        self.weights.buffer.free()
