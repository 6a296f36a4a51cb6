"""bench/gguf.py: the synthetic model as llama.cpp reads it, read back with the gguf package's own reader."""

from __future__ import annotations

import gguf   # the [llamacpp] extra, part of [test]
import numpy as np

from nanoqwen.bench import gguf as synth
from nanoqwen.dims import QWEN25_7B, ModelDims

TINY = ModelDims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000,
                 max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


def test_more_bits_is_llama_cpp_q4_k_m_rule_for_the_7b():
    # use_more_bits(i, 28): i < 3, i >= 24, or (i - 3) % 3 == 2
    assert [i for i in range(28) if synth.more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


def test_7b_tensor_types_and_bytes():
    plan = synth.tensors(QWEN25_7B)
    assert len(plan) == 2 + 28 * 12 + 1
    kinds = {name: kind for name, _, kind in plan}
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "Q4_K"
    assert sum(k == "Q6_K" for n, k in kinds.items() if n.endswith("ffn_down.weight")) == 14
    assert sum(k == "Q6_K" for n, k in kinds.items() if n.endswith("attn_v.weight")) == 14
    nbytes = sum(s[0] * s[1] // synth.QK_K * synth.BLOCK_BYTES[k] if k != "F32" else 4 * s[0] for _, s, k in plan)
    assert 4.67e9 < nbytes < 4.69e9   # a Q4_K_M 7B: 4.68 GB


def test_written_file_reads_back(tmp_path):
    path = synth.write(TINY, tmp_path / "tiny.gguf", seed=3)
    assert not (tmp_path / "tiny.gguf.part").exists()
    r = gguf.GGUFReader(str(path))

    def field(key):
        f = r.fields[key]
        return f.contents()
    assert field("general.architecture") == "qwen2"
    assert field("qwen2.block_count") == TINY.layers and field("qwen2.embedding_length") == TINY.hidden
    assert field("qwen2.attention.head_count_kv") == TINY.kv_heads
    assert field("qwen2.feed_forward_length") == TINY.intermediate
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert len(tokens) == len(set(tokens)) == TINY.vocab and tokens[7] == "\u0120t7"
    assert tokens[-2:] == list(synth.END_TOKENS) and field("tokenizer.ggml.eos_token_id") == TINY.vocab - 1
    assert types[-2:] == [int(gguf.TokenType.CONTROL)] * 2 and set(types[:-2]) == {int(gguf.TokenType.NORMAL)}

    plan = synth.tensors(TINY)
    assert [t.name for t in r.tensors] == [name for name, _, _ in plan]
    for t, (name, shape, kind) in zip(r.tensors, plan):
        assert t.tensor_type.name == kind, name
        assert [int(x) for x in t.shape] == list(reversed(shape)), name   # ggml lists the inner dimension first
        data = np.asarray(t.data)
        if kind == "F32":
            assert np.isfinite(data).all()
            if name.endswith("norm.weight"):
                assert (data == 1).all()
            continue
        blocks = data.reshape(-1, synth.BLOCK_BYTES[kind])
        scale = blocks[:, 0:2] if kind == "Q4_K" else blocks[:, -2:]
        assert (scale.copy().view(np.float16) == synth.SCALE).all(), name
        assert len(np.unique(blocks[:, 4:100])) > 200, name   # the rest is random bytes


def test_seeded_file_is_reproducible(tmp_path):
    a = synth.write(TINY, tmp_path / "a.gguf", seed=1).read_bytes()
    assert synth.write(TINY, tmp_path / "b.gguf", seed=1).read_bytes() == a
    assert synth.write(TINY, tmp_path / "c.gguf", seed=2).read_bytes() != a
