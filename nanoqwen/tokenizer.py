"""Tokenizer and chat template of a Hugging Face model directory, without transformers: tokenizer.json via
the `tokenizers` library, the Jinja chat template of tokenizer_config.json rendered the way transformers
renders it (sandboxed, trim_blocks + lstrip_blocks, its `tojson`/`raise_exception` helpers), eos ids from
generation_config.json and tokenizer_config.json, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from . import NanoqwenError


class TokenizerError(NanoqwenError):
    pass


def _read_json(path: Path, required: bool = True) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise TokenizerError(f"{path}: not found") from None
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from None


def _token_text(tok) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: no HTML escaping, json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.dir = Path(model_dir)
        path = self.dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise TokenizerError(f"{path}: cannot load: {e}") from None
        self.config = _read_json(self.dir / "tokenizer_config.json", required=False)
        gen = _read_json(self.dir / "generation_config.json", required=False)
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = None
        self.special_tokens = {name: _token_text(self.config.get(name)) for name in
                               ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos = gen.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.special_tokens["eos_token"] is not None:
            ids.append(self._tok.token_to_id(self.special_tokens["eos_token"]))
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in transformers."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.dir / 'tokenizer_config.json'}: no chat_template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Token ids in, text deltas out. A byte-level token may end inside a multi-byte UTF-8 character; its
    text then ends in U+FFFD and is held back until later tokens complete the character. Decoding a short
    window (from the last emitted boundary) instead of the whole sequence keeps each step O(1), and
    decoding the window with its prefix keeps merges across the boundary right.
    The concatenated deltas (after `flush()`) equal `decode(all ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and final
        self._read = 0    # ids before it have been emitted as text

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end stays U+FFFD, as in decode)."""
        done = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(done):]
