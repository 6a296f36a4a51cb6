"""Programmatic Dependent Launch ordering, read off the SASS (no GPU): a decode kernel may load weights
before griddepcontrol.wait (SASS ACQBULK) but nothing the previous kernel wrote. ptxas treats `.nc` data
as invariant for the whole kernel and has been seen hoisting such a load above the wait (the QKV GEMV read
a stale residual; H200, 2026-12-02), so activations are read with coherent loads that must stay below it.

- kernels without weights (rope_append, attention, embed): no global load at all before the wait, except the
  M = 1 tensor-core attention's 32-bit reads of the position and the page table, which kernels that completed
  before the one ahead of it (the QKV GEMV with the rope, or rope_append) wrote (its producer copies the older
  K/V pages under that kernel); its q_rot, which that kernel writes, comes after its consumers' wait (64-bit
  loads: none above the first);
- GEMVs: the activation loads (ld_act_*: LDG...STRONG) all after the wait, weight loads (.nc) may precede it;
  the QKV GEMV with the rope lets its dependents start only after its wait (what the attention relies on).
"""

from __future__ import annotations

import re

import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen import resources, tuned
from nanoqwen.codegen.kernels import attention, embed, gemm, gemv
from nanoqwen.dims import QWEN25_7B

CFG = config.default()
NO_WEIGHTS = [*attention.decode_specs(QWEN25_7B, CFG), embed.specs_for_model(QWEN25_7B, CFG)[0]]
# the config's tiles and each tuned GPU's one-row ones, the QKV GEMV with the rope (the position: a coherent load) too
GEMVS = list(dict.fromkeys(gemv.specs_for_model(QWEN25_7B, CFG) + [s for s in tuned.tuned_specs(QWEN25_7B, CFG)
                                                                     if s.m == 1]))


def _sass(spec) -> list[str]:
    if resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed (pip install '.[tools]'): cannot read SASS")
    return [ln for ln in resources.sass(codegen.build(spec).cubin).splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]


def _before_wait(spec) -> list[str]:
    lines = _sass(spec)
    waits = [i for i, ln in enumerate(lines) if "ACQBULK" in ln]
    assert waits, f"{spec.uri}: no griddepcontrol.wait in the SASS"
    return lines[:waits[0]]


def _reads_pages_early(spec) -> bool:
    return isinstance(spec, attention.AttentionDecodeSpec) and spec.pipeline == "mma" and spec.m == 1


@pytest.mark.parametrize("spec", NO_WEIGHTS, ids=lambda s: s.uri)
def test_no_global_load_before_the_wait(spec):
    early = [ln.strip() for ln in _before_wait(spec) if re.search(r"\bLDG\b|\bLDG\.", ln)]
    if _reads_pages_early(spec):   # the position and the page table: 32-bit loads, nothing wider, none coherent
        early = [ln for ln in early if not re.search(r"\bLDG\.E\.CONSTANT\b", ln)]
    assert not early, f"{spec.uri}: global loads before griddepcontrol.wait: {early[:4]}"


@pytest.mark.parametrize("spec", GEMVS, ids=lambda s: s.uri)
def test_gemv_activations_after_the_wait(spec):
    early = _before_wait(spec)
    assert any("LDG.E.NA.128.CONSTANT" in ln for ln in early), f"{spec.uri}: no weight load issued before the wait"
    strong = [ln.strip() for ln in early if "LDG" in ln and "STRONG" in ln]
    assert not strong, f"{spec.uri}: activation loads before griddepcontrol.wait: {strong[:4]}"


def test_rmsnorm_prefill_reads_h_after_the_wait():
    """The prefill norm reads the residual the previous kernel wrote: coherent loads, none above the wait."""
    spec = gemm.RmsnormPrefillSpec(hidden=QWEN25_7B.hidden, eps=QWEN25_7B.rms_eps)
    early = [ln.strip() for ln in _before_wait(spec) if "LDG" in ln]
    assert not early, f"{spec.uri}: global loads before griddepcontrol.wait: {early[:4]}"
    sass = resources.sass(codegen.build(spec).cubin)
    assert "STRONG" in sass, f"{spec.uri}: h not read with coherent (ld_act) loads"


@pytest.mark.parametrize("spec", [s for s in GEMVS if s.epilogue == "rope"], ids=lambda s: s.uri)
def test_the_rope_gemv_lets_its_dependents_start_after_its_wait(spec):
    """The decode attention after the QKV GEMV with the rope reads the position and the older pages before its
    own wait, which is right only if every kernel before the GEMV has completed when the attention starts: the
    GEMV's griddepcontrol.launch_dependents (SASS PREEXIT) comes after its wait (ACQBULK)."""
    lines = _sass(spec)
    wait = next(i for i, ln in enumerate(lines) if "ACQBULK" in ln)
    trigger = [i for i, ln in enumerate(lines) if "PREEXIT" in ln]
    assert trigger and min(trigger) > wait, f"{spec.uri}: launch_dependents before griddepcontrol.wait"
