"""The CUDA engine: one model on one GPU, ready to generate. Start-up in the order that fails fastest:
open and validate the file, check the device and that everything fits in its free memory (one line
naming the bytes), build (or fetch from the cache) every kernel of the decode step, upload the weights
once, allocate the KV cache, then warm up one eager step and one prefill and capture the step graph.
Reports load time, compile time and cache hits like gpt-fast. ``prefill="chunked"`` (the default) runs
prompts through the tensor-core prefill in chunks of ``prefill.chunk_tokens``; ``prefill="decode"`` feeds
them token by token through the decode step (a debugging baseline, bit-identical to teacher forcing)."""

from __future__ import annotations

import time
from pathlib import Path

from .. import NanoqwenError, codegen, config
from ..codegen.cache import STATS
from ..nqfile import NanoqwenFile
from ..progress import Progress
from ..reference import rope_tables
from ..units import size
from . import driver
from .decoder import Decoder, step_specs
from .generate import check_request
from .paged_kv import KVLayout, PagedKVCache
from .prefill import Prefiller, by_steps, prefill_specs, buffer_bytes as prefill_bytes
from .sampler import Sampling
from .weights import Weights, plan

PREFILL_MODES = ("chunked", "decode")


class DeviceError(NanoqwenError):
    pass


def scratch_bytes(dims, capacity: int) -> int:
    """Upper bound of the decoder's own buffers (activations, partials, tokens, rope tables), for the
    up-front memory check; a few MB even for 7B."""
    d = dims
    acts = 4 * (2 * d.hidden + 2 * d.q_dim + 2 * d.kv_dim + 2 * d.intermediate + 2 * d.vocab)
    return acts + 4 * d.heads * 1024 * (d.head_dim + 2) + 8 * capacity + 4 * capacity * d.head_dim + (1 << 20)


class CudaSession:
    def __init__(self, path: str | Path, context: int, eager: bool = False, log=print,
                 cfg: config.Config | None = None, ahead: int = 8, prefill: str = "chunked", verify: bool = True):
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
        layout = KVLayout.for_model(d, cfg, context)
        self.context = layout.capacity_tokens
        w_bytes, kv_bytes = plan(f).nbytes, layout.total_bytes
        chunked, chunk = prefill == "chunked", min(cfg.prefill.chunk_tokens, self.context)
        acts = scratch_bytes(d, self.context) + (prefill_bytes(d, chunk, self.context) if chunked else 0)
        need = w_bytes + kv_bytes + acts
        if need > props.free_mem:
            raise DeviceError(f"not enough GPU memory: {size(need)} needed (weights {size(w_bytes)}, KV cache for "
                              f"{self.context} tokens {size(kv_bytes)}), {size(props.free_mem)} free of "
                              f"{size(props.total_mem)} on {props.name}")
        gpu = codegen.GpuProfile.from_props(props)
        specs = step_specs(d, cfg, props.name, gpu) | (prefill_specs(d, cfg, gpu) if chunked else {})
        hits0, t1 = STATS.hits, time.perf_counter()
        built = codegen.build_many(specs.values(), progress=codegen.ProgressLine(), cfg=cfg.codegen)
        kernels = {role: (spec, driver.load(b)) for (role, spec), b in zip(specs.items(), built)}
        t2 = time.perf_counter()
        bar = Progress(w_bytes, "upload")
        self.weights = Weights(f, progress=bar, verify=verify)
        bar.close()
        self.kv = PagedKVCache(layout)
        self.prefiller = Prefiller(d, kernels, chunk, self.context) if chunked else None
        self.decoder = Decoder(d, self.weights, self.kv, kernels, rope_tables(d, self.context), self.context,
                               graphs=not eager, ahead=ahead, prefill=self.prefiller or by_steps)
        self.decoder.warm_up()
        self.name = f"cuda {props.name}, {'eager' if eager else 'graph'}{'' if self.prefiller else ', decode prefill'}"
        # weight bytes one token streams (the embedding table is read one row at a time unless tied)
        self.bytes_per_token = w_bytes - (0 if d.tie_embeddings else self.weights.plan.regions["embed"].nbytes)
        log(f"loaded {f.path.name} in {time.perf_counter() - t0:.1f} s: {len(specs)} kernels "
            f"({STATS.hits - hits0} cached, {t2 - t1:.1f} s), weights {size(w_bytes)}, "
            f"KV cache {self.context} tokens")

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling()):
        check_request(self.dims, prompt, max_new_tokens, self.context)
        return self.decoder.generate(prompt, max_new_tokens, sampling)

    def close(self) -> None:
        """Give the GPU memory back (tests open several sessions in one process)."""
        self.decoder.close()
        if self.prefiller is not None:
            self.prefiller.close()
        self.kv.free()
        self.weights.buffer.free()
