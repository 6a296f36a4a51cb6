"""nanoqwen.tokenizer against transformers' AutoTokenizer on the committed small-py model directory:
encode/decode, the ChatML template (Qwen2.5's, with tools), eos ids, streaming detokenization."""

from __future__ import annotations

import json

import pytest

from nanoqwen import testmodels
from nanoqwen.tokenizer import Tokenizer, TokenizerError

DIR = testmodels.SMALL_PY_DIR
TEXTS = ["def f(x):\n    return x + 1\n", "naïve café — 中文字符 and emoji 😀👍🏽 ∑ ≠ €",
         "<|im_start|>user\nhi<|im_end|>\n", "<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>x<|endoftext|>",
         "  leading spaces\ttabs\r\nCRLF", ""]
CHATS = [
    [{"role": "user", "content": "Write a function that reverses a list."}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "sort a dict"},
     {"role": "assistant", "content": "sorted(d.items())"}, {"role": "user", "content": "by value?"}],
    [{"role": "user", "content": "weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DIR)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(DIR))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    for t in testmodels.SPECIAL_TOKENS:
        assert tok.encode(t) == [tok.token_to_id(t)]
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_matches_transformers(tok, hf, chat, gen):
    ours = tok.apply_chat_template(CHATS[chat], add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(CHATS[chat], tokenize=False, add_generation_prompt=gen)
    assert ours.startswith("<|im_start|>system\n") and ours.endswith("<|im_start|>assistant\n") == gen
    hf_ids = hf.apply_chat_template(CHATS[chat], tokenize=True, add_generation_prompt=gen)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert tok.encode_chat(CHATS[chat], add_generation_prompt=gen) == hf_ids


def test_chat_template_with_tools_matches_transformers(tok, hf):
    ours = tok.apply_chat_template(CHATS[0], tools=TOOLS)
    assert ours == hf.apply_chat_template(CHATS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "# Tools" in ours and '"name": "get_weather"' in ours


def test_eos_ids(tok):
    gen = json.loads((DIR / "generation_config.json").read_text())["eos_token_id"]
    assert set(tok.eos_ids) == set(gen) | {tok.token_to_id("<|im_end|>")}
    assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>")


@pytest.mark.parametrize("text", TEXTS[:2] + ["😀" * 5 + "x" + "中" * 3])
def test_stream_deltas_concatenate_to_decode(tok, text):
    ids = tok.encode(text)
    stream = tok.stream()
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_split_characters(tok):
    """A 4-byte emoji spread over several byte tokens shows up once, whole, on the token completing it."""
    ids = tok.encode("😀")
    assert len(ids) > 1  # the BPE was trained on ASCII-heavy code, so the emoji is several byte tokens
    stream = tok.stream()
    deltas = [stream.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: not found"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer(tmp_path)
