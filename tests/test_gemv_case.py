"""The GEMV test data on the CPU (bench/gemv_case.py, behind tests/gpu/test_gemv.py, the kernel bench and the
tuner), with device buffers replaced by host copies: ``GemvCase.seeded`` gives exactly the data that a
generator of the same seed gives, for every role, m = 1 and m-row specs, ordinary and massive inputs, so the
GPU tests' fixed-seed massive input did not change when its weights became drawn once per shape."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import config
from nanoqwen.bench import gemv_case
from nanoqwen.bench.gemv_case import GemvCase, bits
from nanoqwen.codegen.kernels import gemv
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
SEED = 2026


class HostBuffer:
    """A device buffer's stand-in: the array it was given."""

    def __init__(self, nbytes: int):
        self.nbytes, self.array, self.ptr = nbytes, None, 0

    @classmethod
    def from_array(cls, a: np.ndarray) -> "HostBuffer":
        b = cls(a.nbytes)
        b.array = a.copy()
        return b

    def free(self) -> None:
        pass


@pytest.fixture(autouse=True)
def host_buffers(monkeypatch):
    monkeypatch.setattr(gemv_case.driver, "DeviceBuffer", HostBuffer)


def data(case: GemvCase) -> list:
    return [b.array for b in case.bufs] + [case.expected, case.y0]


INPUTS = [(1, {}), (1, {"massive": True}), (8, {}), (8, {"massive": True}), (8, {"massive_rows": (1,)})]


@pytest.mark.parametrize("m,massive", INPUTS, ids=["m1", "m1-massive", "m8", "m8-massive", "m8-one-massive-row"])
@pytest.mark.parametrize("role", gemv.ROLES)
def test_seeded_case_is_the_seeds_generator_case(role, m, massive):
    spec = gemv.role_spec(role, tiny_dims(), CFG, m=m)
    want = data(GemvCase(spec, np.random.default_rng(SEED), **massive))
    for _ in range(2):   # the second time from the weights drawn once
        got = data(GemvCase.seeded(spec, SEED, **massive))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g is None and w is None) or (g.shape == w.shape and np.array_equal(bits(g), bits(w)))


def test_weights_are_drawn_once_per_seed_and_shape():
    spec = gemv.role_spec("gate_up", tiny_dims(), CFG)
    first = gemv_case.seeded_weights(SEED, spec.n, spec.k, spec.group, spec.mats)
    again = GemvCase.seeded(gemv.role_spec("gate_up", tiny_dims(), CFG, m=4), SEED)
    assert gemv_case.seeded_weights(SEED, spec.n, spec.k, spec.group, spec.mats) is first
    assert np.array_equal(again.bufs[0].array, first[0][0][0]), "the m-row case uploads the same weights"
    other = gemv_case.seeded_weights(SEED + 1, spec.n, spec.k, spec.group, spec.mats)
    assert not np.array_equal(other[0][0][0], first[0][0][0])
