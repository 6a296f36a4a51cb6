"""Qwen2.5-Coder's prompt layouts, token by token (DESIGN.md section 10), with a tokenizer that has the
FIM and repository special tokens (built here when the test model's tokenizer lacks them)."""

from __future__ import annotations

import re

import pytest

from _serve_util import FIM_TOKENS, fim_model_dir
from nanoqwen.serve import prompts
from nanoqwen.serve.errors import APIError
from nanoqwen.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(fim_model_dir(tmp_path_factory.mktemp("fim") / "model"))


def special(tok, name):
    i = tok.token_to_id(name)
    assert i is not None and tok.decode([i]) == name
    return i


def test_fim_layout(tok):
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = prompts.fim(tok, prefix, suffix)
    pre, suf, mid = (special(tok, t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert ids == [pre, *tok.encode(prefix), suf, *tok.encode(suffix), mid]
    assert tok.decode(ids) == f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"


@pytest.mark.parametrize("where", ["prefix", "suffix", "extra"])
def test_editor_text_cannot_inject_special_tokens(tok, where):
    """Every added token spelled in the editor's text stays text: the layout's own tokens are the only
    special ids, and the text decodes back to what was typed."""
    typed = "a" + "".join(FIM_TOKENS) + "<|im_start|><|endoftext|>b"
    prefix, suffix = (typed, "") if where == "prefix" else ("", typed) if where == "suffix" else ("", "")
    files = [("f.py", typed)] if where == "extra" else [("f.py", "x")]
    ids = prompts.repo_fim(tok, files, prefix, suffix)
    added = set(tok.added_special_tokens)
    layout = ["<|repo_name|>", "<|file_sep|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    assert [tok.decode([i]) for i in ids if i in added] == layout
    assert typed in tok.decode(ids)


def test_repo_level_layout(tok):
    files = [("src/util.py", "PI = 3.14\n"), ("README.md", "# demo\n")]
    ids = prompts.repo_fim(tok, files, "x = ", "\n")
    rep, sep = special(tok, "<|repo_name|>"), special(tok, "<|file_sep|>")
    want = [rep, *tok.encode(f"{prompts.REPO_PLACEHOLDER}\n")]
    for name, text in files:
        want += [sep, *tok.encode(f"{name}\n{text}")]
    want += [sep, *tok.encode(f"{prompts.FILE_PLACEHOLDER}\n"), *prompts.fim(tok, "x = ", "\n", "/infill")]
    assert ids == want
    assert tok.decode(ids).startswith("<|repo_name|>repo\n<|file_sep|>src/util.py\nPI = 3.14\n<|file_sep|>README.md")
    assert prompts.repo_fim(tok, [], "x = ", "\n") == prompts.fim(tok, "x = ", "\n")


def test_repo_files_without_repository_tokens_go_in_plain(tmp_path):
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, pre_tokenizers
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([AddedToken(t, special=True) for t in FIM_TOKENS[:3]])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    ids = prompts.repo_fim(tok, [("x.py", "a b"), ("y.py", "c")], "a", "b")
    assert ids == [0, 1, 2, *prompts.fim(tok, "a", "b")]


def test_stop_ids_cover_the_special_tokens_and_eos(tok):
    want = {special(tok, t) for t in ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>")}
    assert prompts.stop_ids(tok) == want | set(tok.eos_ids)
    assert not {special(tok, t) for t in FIM_TOKENS[:3]} & prompts.stop_ids(tok)


def test_fim_without_the_tokens_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models
    HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    with pytest.raises(APIError, match=re.escape("needs the model's <|fim_prefix|> token")):
        prompts.fim(tok, "a", "b")
    assert prompts.stop_ids(tok) == frozenset()
