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


# H200 SXM: 132 SMs, 227 KB of opt-in shared memory per block (sm_90).
H200 = GpuProfile("NVIDIA H200", sm_count=132, max_smem=227 * 1024)
DEFAULT = H200
