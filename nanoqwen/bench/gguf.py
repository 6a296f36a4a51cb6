"""The synthetic model as llama.cpp reads it: a GGUF file of random Q4_K_M weights at the model's shapes, so that
llama-bench and llama-server (bench/llamacpp.py) run the same shapes as nanoqwen's synthetic 7B in the same
device call. Like nanoqwen's synthetic file, the weights are random: the comparison is of speed, not of text.

Each tensor gets the type that llama.cpp's quantizer gives it for Q4_K_M (src/llama-quant.cpp): Q6_K for the
output matrix and for attn_v and ffn_down in the layers where ``more_bits`` holds, Q4_K for the other
matrices, F32 for norms and biases. A block's scales ``d`` (and ``dmin``) are one small power of two so that the
activations stay finite; its other bytes are random.

The vocabulary stands in for Qwen's: every id is a plain text token (" t<id>", byte-level like Qwen's, as
nanoqwen's word tokenizer in bench/serve.py spells it), except the last two, the end tokens. Benchmarks send
token ids with ``ignore_eos``, so every generated token is one text chunk on both servers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import extras
from ..dims import ModelDims

QK_K = 256                        # values per K-quant block
BLOCK_BYTES = {"Q4_K": 144,       # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
               "Q6_K": 210}       # 128 bytes low nibbles, 64 high bits, 16 int8 scales, d (fp16)
SCALE = np.float16(2.0 ** -14)    # every block's d and dmin: |weight| <= 63 * 15 * 2^-14 < 0.06
END_TOKENS = ("<|endoftext|>", "<|im_end|>")   # the vocabulary's last two ids


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(d: ModelDims) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, type) of every tensor, in file order."""
    out = [("token_embd.weight", (d.vocab, d.hidden), "Q4_K")]
    for i in range(d.layers):
        b, wide = f"blk.{i}.", "Q6_K" if more_bits(i, d.layers) else "Q4_K"
        out += [(b + "attn_norm.weight", (d.hidden,), "F32"),
                (b + "attn_q.weight", (d.q_dim, d.hidden), "Q4_K"), (b + "attn_q.bias", (d.q_dim,), "F32"),
                (b + "attn_k.weight", (d.kv_dim, d.hidden), "Q4_K"), (b + "attn_k.bias", (d.kv_dim,), "F32"),
                (b + "attn_v.weight", (d.kv_dim, d.hidden), wide), (b + "attn_v.bias", (d.kv_dim,), "F32"),
                (b + "attn_output.weight", (d.hidden, d.q_dim), "Q4_K"),
                (b + "ffn_norm.weight", (d.hidden,), "F32"),
                (b + "ffn_gate.weight", (d.intermediate, d.hidden), "Q4_K"),
                (b + "ffn_up.weight", (d.intermediate, d.hidden), "Q4_K"),
                (b + "ffn_down.weight", (d.hidden, d.intermediate), wide)]
    out.append(("output_norm.weight", (d.hidden,), "F32"))
    if not d.tie_embeddings:
        out.append(("output.weight", (d.vocab, d.hidden), "Q6_K"))
    return out


def tensor_data(shape: tuple[int, ...], kind: str, name: str, rng: np.random.Generator) -> np.ndarray:
    """A norm's weights are ones; a bias is small noise; a K-quant matrix is random blocks (uint8, one row of
    blocks per output row) with the scales set to SCALE."""
    if kind == "F32":
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return rng.standard_normal(shape, np.float32) * np.float32(0.02)
    rows, cols = shape
    if cols % QK_K:
        raise ValueError(f"{name}: {cols} columns are not whole {QK_K}-value blocks")
    nb = BLOCK_BYTES[kind]
    blocks = np.frombuffer(rng.bytes(rows * cols // QK_K * nb), np.uint8).reshape(-1, nb).copy()
    scale = np.frombuffer(SCALE.tobytes(), np.uint8)
    if kind == "Q4_K":
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    else:
        blocks[:, nb - 2:] = scale
    return blocks.reshape(rows, cols // QK_K * nb)


def vocabulary(vocab: int) -> tuple[list[str], list[int]]:
    """Token texts (byte-level, 'Ġ' = a space) and types: normal, then the two end tokens as control."""
    extras.require("llamacpp", "a GGUF file for llama.cpp")
    import gguf
    texts = [f"\u0120t{i}" for i in range(vocab - len(END_TOKENS))] + list(END_TOKENS)
    kinds = [gguf.TokenType.NORMAL] * (vocab - len(END_TOKENS)) + [gguf.TokenType.CONTROL] * len(END_TOKENS)
    return texts, [int(k) for k in kinds]


def write(d: ModelDims, path: Path, seed: int = 0) -> Path:
    """Write the GGUF of ``d`` to ``path`` (through a temporary name, so a killed run leaves no half file)."""
    extras.require("llamacpp", "a GGUF file for llama.cpp")
    import gguf
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, "qwen2")
    w.add_name("nanoqwen synthetic (random weights)")
    w.add_context_length(d.max_positions)
    w.add_embedding_length(d.hidden)
    w.add_block_count(d.layers)
    w.add_feed_forward_length(d.intermediate)
    w.add_head_count(d.heads)
    w.add_head_count_kv(d.kv_heads)
    w.add_rope_freq_base(d.rope_theta)
    w.add_layer_norm_rms_eps(d.rms_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    texts, kinds = vocabulary(d.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(texts)
    w.add_token_types(kinds)
    w.add_token_merges(["\u0120 t"])
    w.add_add_bos_token(False)
    w.add_bos_token_id(d.vocab - 2)
    w.add_eos_token_id(d.vocab - 1)
    w.add_eot_token_id(d.vocab - 1)
    w.add_pad_token_id(d.vocab - 2)
    plan = tensors(d)
    for name, shape, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            nbytes = shape[0] * shape[1] // QK_K * BLOCK_BYTES[kind]
            w.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in plan:
        w.write_tensor_data(tensor_data(shape, kind, name, rng))
    w.close()
    tmp.replace(path)
    return path
