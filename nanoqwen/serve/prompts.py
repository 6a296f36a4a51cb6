"""Prompt layouts of Qwen2.5-Coder (DESIGN.md section 10), built as token ids: the special tokens are
spliced in by id and the user's text is encoded as text (``Tokenizer.encode_text``), so an editor buffer
that happens to contain ``<|fim_middle|>`` cannot change the layout.

    fill in the middle:  <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>
    repository level:    <|repo_name|>{name}\\n<|file_sep|>{path}\\n{text} ... <|file_sep|>{path}\\n<|fim_prefix|>...

Generation stops at the end-of-text / FIM / repository / chat-turn tokens and the model's eos ids."""

from __future__ import annotations

from .errors import APIError

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
REPO_NAME, FILE_SEP = "<|repo_name|>", "<|file_sep|>"
STOP_TOKENS = ("<|endoftext|>", "<|fim_pad|>", FILE_SEP, REPO_NAME, "<|im_end|>")
# /infill names neither the repository nor the file being edited (llama-server uses placeholders too)
REPO_PLACEHOLDER, FILE_PLACEHOLDER = "repo", "current"


def stop_ids(tok) -> frozenset[int]:
    """Token ids that end a generation: the named special tokens the tokenizer has, plus its eos ids."""
    named = (tok.token_to_id(t) for t in STOP_TOKENS)
    return frozenset(i for i in named if i is not None) | frozenset(tok.eos_ids)


def _special(tok, token: str, what: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise APIError(f"{what} needs the model's {token} token, and this model's tokenizer has none "
                       f"(not a fill-in-the-middle model)", param="suffix" if what == "suffix" else None)
    return i


def fim(tok, prefix: str, suffix: str, what: str = "suffix") -> list[int]:
    ids = [_special(tok, t, what) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
    return [ids[0], *tok.encode_text(prefix), ids[1], *tok.encode_text(suffix), ids[2]]


def repo_fim(tok, files: list[tuple[str, str]], prefix: str, suffix: str) -> list[int]:
    """FIM with other files of the repository first. Without the repository tokens the files' text goes
    in plain, one after another, before the FIM prompt (what llama-server does)."""
    head: list[int] = []
    rep, sep = tok.token_to_id(REPO_NAME), tok.token_to_id(FILE_SEP)
    if files and rep is not None and sep is not None:
        head = [rep, *tok.encode_text(f"{REPO_PLACEHOLDER}\n")]
        for name, text in files:
            head += [sep, *tok.encode_text(f"{name}\n{text}")]
        head += [sep, *tok.encode_text(f"{FILE_PLACEHOLDER}\n")]
    else:
        for _name, text in files:
            head += tok.encode_text(text)
    return head + fim(tok, prefix, suffix, "/infill")
