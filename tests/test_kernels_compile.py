"""Every kernel the 7B model and the test models need (the multi-row step's m = 2..16 kernels included)
renders and compiles for sm_90a with NVRTC (no GPU), with no register spills and no local memory. One session-scoped fixture builds them all in parallel
first (serial compilation would dominate the wall time), into a fresh cache so CI really compiles.

One exception, measured: the multi-row attention caps its registers so that multirow.attention_ctas_per_sm
CTAs fit an SM (a few spills, its 132 m CTAs in fewer waves: 8 rows at 577 keys 22.8 -> 13.9 us on the
H200); it must still fit that many CTAs, and its stack stays small."""

from __future__ import annotations

import os
import time

import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen import cache, gpu, kernels, resources
from nanoqwen.dims import QWEN25_7B, ModelDims
from nanoqwen.codegen import tuned


def _tiny_dims() -> ModelDims:
    try:
        from nanoqwen.testmodels import tiny_dims
    except ImportError:  # the test-model module is optional here: the dims are what matters
        return ModelDims(hidden=256, layers=2, heads=7, kv_heads=1, head_dim=128, intermediate=768, vocab=2048,
                         max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)
    return tiny_dims()


MODELS = {"7b": QWEN25_7B, "tiny": _tiny_dims()}
# the config defaults plus the multi-row step's m > 1 kernels (config multirow.buckets), plus every GEMV and
# decode attention the decoder builds from what tune/tuned.json holds for these dims (any GPU, m = 1 and each
# bucket)
SPECS = {name: list(dict.fromkeys(codegen.model_kernels(dims) + codegen.multirow_kernels(dims)
                                  + tuned.tuned_specs(dims, config.default())
                                  + tuned.tuned_attention_specs(dims, config.default())))
         for name, dims in MODELS.items()}
CASES = [(name, s) for name, specs in SPECS.items() for s in specs]


@pytest.fixture(scope="session")
def built(fresh_build):
    """{uri: Built} for every kernel of every model, compiled in parallel into a fresh cache."""
    specs = [s for _, s in CASES]
    t0 = time.perf_counter()
    results = fresh_build(specs, progress=codegen.ProgressLine(), return_exceptions=True)
    seconds = time.perf_counter() - t0
    print(f"\nbuilt {len(set(specs))} kernels in {seconds:.1f} s on {os.cpu_count()} cores "
          f"(NVRTC {codegen.nvrtc.version()}; compile {cache.STATS.compile_s:.1f} s summed over workers)")
    return {s.uri: b for s, b in zip(specs, results)}


def test_every_model_family_contributes():
    """A registered module with a specs_for_model hook must give the 7B model at least one kernel."""
    for name in kernels.modules():
        hook = getattr(kernels.module(name), "specs_for_model", None)
        if hook is not None:
            assert hook(QWEN25_7B, config.default()), f"kernels/{name}.py: specs_for_model is empty"


@pytest.mark.parametrize("model,spec", CASES, ids=[f"{m}-{s.uri}" for m, s in CASES])
def test_kernel_compiles_without_spills_or_local_memory(built, model, spec):
    b = built[spec.uri]
    if isinstance(b, Exception):
        raise b
    r = b.resources
    assert b.entry == spec.entry and b.cubin[:4] == b"\x7fELF"
    lt = b.launch
    ctas = getattr(spec, "ctas_per_sm", 1)
    if ctas > 1:   # registers capped on purpose: spills allowed, the occupancy they buy must hold
        assert r.local_bytes <= 256 and r.registers * lt.threads * ctas <= 65536, f"{spec.uri}: {r}"
    else:
        assert (r.spill_stores, r.spill_loads) == (0, 0), f"{spec.uri}: spills {r} (ptxas: {b.log.strip()})"
        assert r.local_bytes == 0 and r.max_stack == 0, f"{spec.uri}: local memory {r}"
    smem = r.shared_static + lt.smem  # shared_static includes the 1 KB system reservation
    assert smem <= gpu.DEFAULT.max_smem + gpu.SMEM_PER_CTA_RESERVED, f"{spec.uri}: {smem} B shared per block"
    assert r.registers * lt.threads <= 65536, f"{spec.uri}: {r.registers} regs x {lt.threads} threads"


@pytest.mark.skipif(resources.tool("cuobjdump") is None, reason="cuobjdump not installed (pip install '.[tools]')")
def test_elf_report_matches_cuobjdump(built):
    """The ELF reader (no NVIDIA tools needed) agrees with cuobjdump on every model kernel."""
    for uri, b in built.items():
        if isinstance(b, Exception):
            continue
        ref = resources.cuobjdump_resources(b.cubin)[b.entry]
        r = b.resources
        assert (ref["registers"], ref["stack"], ref["shared"], ref["constant0"]) == (
            r.registers, r.local_bytes, r.shared_static, r.constant0), uri
