"""Models and sessions shared by the GPU tiers. Every model is packed here from the project's own test
models (nothing downloaded): the trained small-py model (realistic top-1 margins), a tiny random model
with planted Qwen2-style massive activations, and a random model with the 7B's layer shapes (fewer
layers: the per-layer kernels are what is under test, and 28 layers of numpy simulation is slow)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from nanoqwen import testmodels
from nanoqwen.dims import QWEN25_7B
from nanoqwen.hf import HFCheckpoint
from nanoqwen.pack import pack_hf, pack_random

SEVEN_B_LAYERS = 2


@pytest.fixture(scope="session")
def packed(tmp_path_factory):
    """name -> .nanoqwen path, packed on first use."""
    root = tmp_path_factory.mktemp("gpu-models")
    made = {}

    def get(name: str):
        if name not in made:
            out = root / f"{name}.nanoqwen"
            if name == "small-py":
                pack_hf(HFCheckpoint(testmodels.SMALL_PY_DIR), out)
            elif name == "massive":
                pack_hf(HFCheckpoint(testmodels.make_tiny_model(root / "massive-hf", seed=2, massive=True)), out)
            elif name == "7b-shapes":
                pack_random(dataclasses.replace(QWEN25_7B, layers=SEVEN_B_LAYERS), out, seed=5)
            else:
                raise KeyError(name)
            made[name] = out
        return made[name]
    return get


@pytest.fixture(scope="session")
def sessions(packed):
    """(name, eager, context, kv_tokens, cfg) -> an open CudaSession (context 512 tokens, a KV pool of one
    context, the default config by default), closed at the end of the run."""
    from nanoqwen.runtime.session import CudaSession
    opened = {}

    def get(name: str, eager: bool = False, context: int = 512, kv_tokens: int | None = None, cfg=None):
        key = (name, eager, context, kv_tokens, cfg)
        if key not in opened:
            opened[key] = CudaSession(packed(name), context, eager=eager, kv_tokens=kv_tokens, cfg=cfg,
                                      log=lambda m: print(m, file=sys.stderr))
        return opened[key]
    yield get
    for s in opened.values():
        s.close()


@pytest.fixture(scope="session")
def references(packed):
    from nanoqwen.reference import Reference
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = Reference.from_file(packed(name), max_seq=1024)
        return made[name]
    return get
