"""The project's own test models, made here, never downloaded: a byte-level BPE tokenizer trained on the
Python standard library's source, Qwen2.5-style ChatML chat template, and real Hugging Face model
directories (config.json, bf16 model.safetensors, tokenizer files, generation_config.json) holding
either random weights (`make_tiny_model`) or a small trained model (tools/train_small_model.py,
committed under tests/data/small-py/).

Dims follow the kernels' needs and the 7B's shape: head_dim 128, GQA 7:1, every GEMV input dimension a
multiple of the quant group (128)."""

from __future__ import annotations

import collections
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from . import extras, paths
from .dims import ModelDims

SMALL_PY_DIR = paths.PACKAGE_DIR.parent / "tests" / "data" / "small-py"  # in a source checkout only
# Qwen2.5-Coder's special tokens by name, in its relative order (ids 0..8 here): end of text, ChatML turns,
# fill-in-the-middle (prefix-suffix-middle order) and repository-level file separators.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                  "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Qwen2.5-Instruct's ChatML template (system default, tools block, tool calls and tool responses), so the
# tokenizer module is exercised on the same template shape it meets in real checkpoints.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen2's pre-tokenizer split (contractions, letter runs, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def stdlib_sources(root: str | Path | None = None, tests: bool = False) -> list[Path]:
    """The standard library's .py files (by default this interpreter's, without its test suites), sorted, so
    the corpus order is fixed."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "idlelib", "__pycache__"}
    if not tests:
        skip |= {"test", "tests", "idle_test"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def read_sources(paths) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def _byte_level(model):
    """A `tokenizers.Tokenizer` of ``model`` (a BPE) set up like Qwen2's: NFC, Qwen2 split regex, byte-level."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int = 2048):
    """Byte-level BPE like Qwen2's (NFC, Qwen2 split regex, byte-level alphabet); the special tokens take
    ids 0..8. Deterministic for a fixed corpus."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def sized_tokenizer(texts: list[str], size: int, seed: int = 0, max_len: int = 16):
    """A byte-level BPE of ``size`` tokens (special tokens at ids 0..8) where no real tokenizer of that size
    is at hand: a grammar engine's cost per token grows with the vocabulary it walks. After the specials
    and the byte alphabet, every substring (2..max_len characters) of a pre-tokenized chunk of ``texts``,
    most frequent first; then, to reach ``size`` (a corpus of a few hundred KB gives tens of thousands),
    seeded random one-character extensions of the tokens so far, the characters drawn with the corpus's
    frequencies. Every token is a merge of a shorter one and a character, so it is a valid BPE."""
    from tokenizers import models, pre_tokenizers

    pre = _byte_level(models.BPE()).pre_tokenizer
    chunks = [c for t in texts for c, _ in pre.pre_tokenize_str(t)]
    counts = collections.Counter(c[i:j] for c in chunks for i in range(len(c))
                                 for j in range(i + 2, min(len(c), i + max_len) + 1))
    # most frequent first, then shorter: a token's prefix (as frequent at least) always comes before it
    tokens = list(SPECIAL_TOKENS) + pre_tokenizers.ByteLevel.alphabet() + sorted(counts, key=lambda t: (-counts[t],
                                                                                                     len(t), t))
    if len(tokens) > size:
        tokens = tokens[:size]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    chars = collections.Counter("".join(chunks))
    alphabet, weights = list(chars), np.array(list(chars.values()), np.float64)
    rng = np.random.default_rng(seed)
    words = list(vocab)[len(SPECIAL_TOKENS):]
    while len(vocab) < size:   # in batches: each draws parents among the tokens made before it
        parents = rng.integers(0, len(words), 4096)
        for p, c in zip(parents, rng.choice(len(alphabet), 4096, p=weights / weights.sum())):
            t = words[p] + alphabet[c]
            if t not in vocab and len(vocab) < size:
                vocab[t] = len(vocab)
                words.append(t)
    merges = [(t[:-1], t[-1]) for t in list(vocab)[len(SPECIAL_TOKENS) + 256:]]
    tok = _byte_level(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def tokenizer_config() -> dict:
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in ids.items()},
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 32768, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_hf_dir(path: str | Path, dims: ModelDims, weights: dict[str, np.ndarray], tokenizer=None,
                 tokenizer_dir: str | Path | None = None) -> Path:
    """A real HF Qwen2 directory: config.json, model.safetensors (bf16, like the released checkpoints),
    generation_config.json and the tokenizer (a `tokenizers.Tokenizer`, or files copied from tokenizer_dir).
    `weights` maps HF tensor names to float arrays."""
    extras.require("torch", "writing a Hugging Face model directory")  # bf16 safetensors come from torch
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = [SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")]
    cfg = dims.to_hf_config() | {"bos_token_id": None, "eos_token_id": eos[0]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}, indent=2) + "\n")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(torch.bfloat16)
               for k, v in sorted(weights.items())}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    elif tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    return path


def tiny_dims(vocab: int = 2048, layers: int = 2) -> ModelDims:
    """hidden 256, 7 query heads and 1 KV head of 128 (GQA 7:1 like the 7B), q_dim 896, intermediate 512."""
    return ModelDims(hidden=256, layers=layers, heads=7, kv_heads=1, head_dim=128, intermediate=512,
                     vocab=vocab, max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


def random_weights(dims: ModelDims, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights at 1/sqrt(fan_in) scale, so activations are O(1) through every layer; norm weights
    near 1 and small biases, so that no parameter is trivially zero or one."""
    rng = np.random.default_rng(seed)

    def lin(n, k):
        return rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)

    H, Q, KV, I = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    w = {"model.embed_tokens.weight": rng.standard_normal((dims.vocab, H), dtype=np.float32),
         "model.norm.weight": norm(H)}
    if not dims.tie_embeddings:
        w["lm_head.weight"] = lin(dims.vocab, H)
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
              p + "self_attn.q_proj.weight": lin(Q, H), p + "self_attn.k_proj.weight": lin(KV, H),
              p + "self_attn.v_proj.weight": lin(KV, H), p + "self_attn.o_proj.weight": lin(H, Q),
              p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
              p + "mlp.down_proj.weight": lin(H, I)}
        for name, n in (("q", Q), ("k", KV), ("v", KV)):
            w[p + f"self_attn.{name}_proj.bias"] = 0.1 * rng.standard_normal(n, dtype=np.float32)
    return w


def plant_massive_activations(dims: ModelDims, w: dict[str, np.ndarray], channels=(3, 77),
                              neurons=(5, 6, 7, 8), layer: int = 0) -> dict[str, np.ndarray]:
    """Qwen2-style massive activations: a few MLP neurons of `layer` fire hard for every token (their
    gate/up rows lock onto residual `channels`, which the embedding keeps large) and down_proj routes them
    into those channels only, driving |h| to ~1e5 there for the rest of the network. silu(g)*u exceeds
    the fp16 range at those neurons, so the saturating f16 cast is exercised (an unsaturated cast is inf)."""
    w = dict(w)
    p = f"model.layers.{layer}.mlp."
    emb = w["model.embed_tokens.weight"].copy()
    emb[:, list(channels)] = 2.0e3
    gate, up, down = (w[p + n].copy() for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    for j in neurons:
        gate[j, :] = 0.0
        up[j, :] = 0.0
        gate[j, list(channels)] = 40.0
        up[j, list(channels)] = 40.0
    down[:, list(neurons)] = 0.0
    for c in channels:
        down[c, list(neurons)] = 0.4
    w |= {"model.embed_tokens.weight": emb, p + "gate_proj.weight": gate, p + "up_proj.weight": up,
          p + "down_proj.weight": down}
    return w


def make_tiny_model(path: str | Path, seed: int = 0, layers: int = 2, massive: bool = False,
                    tokenizer_dir: str | Path = SMALL_PY_DIR) -> Path:
    """A random tiny Qwen2 HF directory sharing the committed small-py tokenizer (so no tokenizer training
    at test time). `massive=True` plants Qwen2-style massive residual activations."""
    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    dims = tiny_dims(vocab=vocab, layers=layers)
    w = random_weights(dims, seed)
    if massive:
        w = plant_massive_activations(dims, w)
    return write_hf_dir(path, dims, w, tokenizer_dir=tokenizer_dir)
