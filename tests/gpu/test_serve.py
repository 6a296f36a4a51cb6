"""The server suite of tests/test_serve.py against the CUDA backend: the same requests to a real
`nanoqwen serve --backend cuda` process, with the expected answers from a CUDA engine in this process
(same kernels, same context, so greedy text and usage match exactly). Needs fastapi, uvicorn, openai and
their dependencies on the GPU machine (wheels: see tools/gpu_check.sh)."""

from __future__ import annotations

import pytest

from test_serve import *  # noqa: F401,F403 - every test and fixture of the CPU suite, re-run here

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    return "cuda"
