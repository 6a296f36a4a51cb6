"""bench/llamacpp.py against a real llama-server: the build of tools/build_llama.sh, whose CUDA backend is a
module that does not load without a driver, so here it runs on the CPU backend over a tiny GGUF of bench/gguf.py.
Skipped where llama.cpp is not built (.llama/ or $NANOQWEN_LLAMA_CPP; CI does not build it: an hour on 2
cores); on the GPU machine tools/gpu_check.sh runs the benchmark itself (GPU_CHECK_LLAMA=1)."""

from __future__ import annotations

import ctypes.util

import pytest

from nanoqwen import NanoqwenError
from nanoqwen.bench import concurrency, gguf, llamacpp
from nanoqwen.bench.serve import Editor
from nanoqwen.dims import ModelDims

pytestmark = pytest.mark.skipif(not (llamacpp.llama_dir() / "llama-server").is_file(),
                                reason="llama.cpp not built (tools/build_llama.sh writes .llama/)")

TINY = ModelDims(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000,
                 max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return gguf.write(TINY, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_clients_at_once_on_llama_server(model, tmp_path):
    res = llamacpp.clients_at_once(model, TINY.vocab, print, tmp_path, prompt_len=16, gen=8)
    assert [lv["clients"] for lv in res["levels"]] == list(concurrency.LEVELS)
    for lv in res["levels"]:   # every token one text chunk: ignore_eos held and the vocabulary is all text
        assert lv["tokens"] == 8 * lv["clients"] and 0 < lv["itl_ms"]["p50"] <= lv["itl_ms"]["p99"]
    t = res["ttft_with_7_decoding"]
    assert 0 < t["prompt_ms"] <= t["client_ms"] and t["cached_tokens"] == 0
    assert res["max_running"] == llamacpp.PARALLEL and "-np 8" in res["protocol"]["server"]


def test_editor_requests_on_llama_server(model, tmp_path):
    sizes = Editor(cold=16, long=96, tail=8, extra=64)
    res = llamacpp.editor(model, TINY.vocab, print, tmp_path, reps=2, sizes=sizes)
    assert res["ttft_cold"]["cached_tokens"] == [0, 0]
    assert res["ttft_rerequest"]["cached_tokens"] == [sizes.long - sizes.tail] * 2   # its prompt cache
    assert res["ttft_after_warm_up"]["cached_tokens"] == [sizes.long - sizes.tail] * 2
    for case in ("ttft_cold", "ttft_rerequest", "ttft_after_warm_up", "ttft_warm_up_between_keystrokes"):
        assert 0 < res[case]["prompt_ms"]["median"] <= res[case]["client_ms"]["median"]


def test_no_cuda_backend_is_one_error_before_the_model_is_written(monkeypatch, tmp_path):
    # here the CUDA module cannot load (no driver): llama.cpp would run the 7B on the CPU for hours
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver library is installed here")
    assert llamacpp.cuda_devices() == []
    monkeypatch.setattr(llamacpp.protocol, "gpu_info", lambda backend: {"name": "stand-in"})
    monkeypatch.setattr(llamacpp, "model_path", lambda log: pytest.fail("the GGUF must not be written"))
    with pytest.raises(NanoqwenError, match="llama.cpp sees no CUDA device"):
        llamacpp.run(log=print)
