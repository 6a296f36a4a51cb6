"""The GPU a kernel set is built for: the hardware facts specs depend on (SM count -> grid sizes that fill
the device, opt-in shared memory per block -> which tiles fit). A spec carries what it derived from them
(attention_decode.splits, lm_head_argmax.ctas, gemm_int4 / attention_prefill.max_smem), so they are part
of its cache key. The runtime reads the profile from its device (runtime/session.py); compiling without
one (CI, nanoqwen-gen, the tests) uses DEFAULT."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProfile:
    name: str
    sm_count: int
    max_smem: int   # dynamic shared memory one block may opt into (bytes)

    @classmethod
    def from_props(cls, props) -> "GpuProfile":
        """From the runtime's DeviceProps (name, sm_count, max_smem_optin)."""
        return cls(props.name, props.sm_count, props.max_smem_optin)


# sm_90's per-SM limits (every Hopper part): threads, registers (allocated per warp in units of 256) and CTAs.
THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
CTAS_PER_SM = 32
SMEM_PER_SM = 228 * 1024     # shared memory an SM holds, of which each resident CTA takes SMEM_PER_CTA_RESERVED
SMEM_PER_CTA_RESERVED = 1024


def ctas_an_sm_holds(threads: int, registers: int, smem_ctas: int) -> int:
    """CTAs of ``threads`` threads at ``registers`` registers a thread that one SM holds at once, at most
    ``smem_ctas`` (what their shared memory allows). What the hardware allows, not what a spec's grid is fitted
    to (GemvInt4Spec.resident_ctas)."""
    per_warp = -(-registers * 32 // 256) * 256
    return max(0, min(THREADS_PER_SM // threads, REGISTERS_PER_SM // (per_warp * (threads // 32)), smem_ctas,
                      CTAS_PER_SM))


# H200 SXM: 132 SMs, 227 KB of opt-in shared memory per block (sm_90).
H200 = GpuProfile("NVIDIA H200", sm_count=132, max_smem=227 * 1024)
DEFAULT = H200
