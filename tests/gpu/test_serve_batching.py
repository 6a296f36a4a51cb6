"""The several-clients-at-once tests of tests/test_serve_batching.py against the CUDA backend: a real
`nanoqwen serve --backend cuda` process (the CUDA engine's multi-sequence step, runtime/batchstep.py) and
the expected answers from a CUDA engine in this process running each request alone (runtime/runner.py).

Class (a) of docs/architecture.md: a decode row is bitwise the single-row step whatever else is in the step
(row invariance, tests/gpu/test_rowstep_sequences.py), a prompt position is bitwise the same whatever
chunk computed it (chunk invariance, tests/gpu/test_chunk_invariance.py), so tokens and logprobs compare
exactly. The in-process fault test stays on the reference: on a GPU engine a step fault ends the worker
by design (the device state may be corrupt). Needs the server stack (tools/gpu_check.sh's wheels)."""

from __future__ import annotations

import pytest

from test_serve_batching import (ids, local, model, server, test_a_sequence_short_of_pages_waits_and_others_run,  # noqa: F401
                                 test_seeded_sampling_and_penalties_are_per_request,
                                 test_sixteen_concurrent_streams_are_each_bitwise_alone,
                                 test_speculative_streams_beside_others_are_plain_greedy)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    return "cuda"
