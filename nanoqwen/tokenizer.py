"""Tokenizer and chat template of a model, without transformers: tokenizer.json via the `tokenizers` library,
the Jinja chat template of tokenizer_config.json rendered the way transformers renders it (sandboxed,
trim_blocks + lstrip_blocks, its `tojson`/`raise_exception` helpers), eos ids from generation_config.json and
tokenizer_config.json, and incremental detokenization for streaming.

The files come from a Hugging Face directory or from the blobs of a .nanoqwen file, which stores them as the
directory had them (``FILES``; `nanoqwen pack` puts them there). ``load`` is how every command gets a
model's tokenizer."""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from datetime import datetime
from functools import cached_property
from pathlib import Path

from . import NanoqwenError
from .dims import ModelDims
from .nqfile import NanoqwenFile
from .safefile import SIDE_FILE_LIMIT, lookup, parse_json, read_regular
from .tokenpieces import PieceCache, splits_lines

# What a .nanoqwen file stores of a HF directory, as blobs under these names; tokenizer.json is required.
# Recent transformers save the chat template in chat_template.jinja (which then wins, as in transformers)
# rather than in tokenizer_config.json.
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


class TokenizerError(NanoqwenError):
    pass


def read_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer FILES present in a HF directory, by name."""
    d = Path(model_dir)
    files = {name: read_regular(d / name, SIDE_FILE_LIMIT, optional=True) for name in FILES}
    return {name: data for name, data in files.items() if data is not None}


def _parse_json(files: dict[str, bytes], name: str, where: str) -> dict:
    """An optional JSON file holding an object; absent means {}."""
    if name not in files:
        return {}
    doc = parse_json(files[name], f"{where}{name}")
    if not isinstance(doc, dict):
        raise TokenizerError(f"{where}{name}: must hold a JSON object, not a {type(doc).__name__}")
    return doc


def _token_text(tok, where: str) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    text = tok.get("content") if isinstance(tok, dict) else tok
    if text is not None and not isinstance(text, str):
        raise TokenizerError(f"{where}: must be a string or an object with a string content, got {tok!r:.60}")
    return text


def _eos_ids(gen: dict, where: str) -> list[int]:
    """generation_config.json's eos_token_id: one id or a list of ids."""
    eos = gen.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else [] if eos is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{where}: must be a token id or a list of token ids, got {eos!r:.60}")
    return ids


def _template(template, where: str) -> str | None:
    """chat_template: a string, or named templates [{"name": "default", "template": ...}, ...]."""
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{where}: must be a string or a list of named templates, got {template!r:.60}")
    return template


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
    """``Tokenizer(model_dir)`` reads a HF directory; ``Tokenizer.from_files`` takes the FILES' bytes."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        self._init(read_files(d), f"{d}/")

    @classmethod
    def from_files(cls, files: dict[str, bytes], where: str) -> "Tokenizer":
        """``where`` prefixes each file's name in error messages (a directory and "/", or "FILE: ")."""
        tok = cls.__new__(cls)
        tok._init(files, where)
        return tok

    def _init(self, files: dict[str, bytes], where: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.where = where
        self._files = files
        if "tokenizer.json" not in files:
            raise TokenizerError(f"{where}tokenizer.json: not found")
        try:
            self._tok = HFTokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise TokenizerError(f"{where}tokenizer.json: cannot load: {e}") from None
        self.config = _parse_json(files, "tokenizer_config.json", where)
        self.generation_config = _parse_json(files, "generation_config.json", where)
        gen = self.generation_config
        template = _template(self.config.get("chat_template"), f"{where}tokenizer_config.json: chat_template")
        if "chat_template.jinja" in files:
            try:
                template = files["chat_template.jinja"].decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{where}chat_template.jinja: cannot read: {e}") from None
        self.chat_template: str | None = template
        self._template = None
        self.special_tokens = {name: _token_text(self.config.get(name), f"{where}tokenizer_config.json: {name}")
                               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        ids = _eos_ids(gen, f"{where}generation_config.json: eos_token_id")
        if self.special_tokens["eos_token"] is not None:
            ids.append(self._tok.token_to_id(self.special_tokens["eos_token"]))
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def added_special_tokens(self) -> dict[int, str]:
        """id -> text of every added token marked special (<|im_end|>, <|fim_prefix|>, ...)."""
        return {i: t.content for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}

    def to_json(self) -> str:
        """The tokenizers JSON (what a grammar engine builds its vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # The *_batch calls of `tokenizers` release the GIL (encode and decode hold it), so a server thread
    # tokenizing a long text leaves the event loop free.

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in transformers."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """User content as text: ``<|fim_middle|>`` typed in an editor buffer stays the characters it is
        (transformers' split_special_tokens, for every added token: Qwen's FIM tokens are not marked
        special). Equal to ``encode`` for text that holds no added token. Tokenized in pieces whose ids
        are kept (tokenpieces.py): an editor's resent text costs the pieces that changed."""
        return self._pieces.encode(text)

    @cached_property
    def _pieces(self) -> PieceCache:
        return PieceCache(lambda texts: [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)],
                          splits_lines(self._spec))

    @cached_property
    def _spec(self) -> dict:
        """tokenizer.json, parsed (Qwen's is ~7 MB: once)."""
        return json.loads(self._files["tokenizer.json"])

    @cached_property
    def _plain(self):
        """The same tokenizer without its added tokens: nothing in the text is taken for one."""
        from tokenizers import Tokenizer as HFTokenizer
        return HFTokenizer.from_str(json.dumps({**self._spec, "added_tokens": []}))

    @cached_property
    def _added(self) -> re.Pattern:
        """The added tokens' texts, longest first (the leftmost-longest match `tokenizers` makes)."""
        texts = sorted((t.content for t in self._tok.get_added_tokens_decoder().values()), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) or r"(?!)")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def pieces(self, ids) -> list[str]:
        """Each token's own text."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.where}tokenizer_config.json: no chat_template (and no chat_template.jinja)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """``kwargs`` go to the template (``tools=[...]``). The template's own special tokens are tokens;
        the messages' content is text (``encode_text``).
        The template renders with a marker in place of each content, and the text between two special
        tokens is encoded as one run, which is what ``encode`` of the plain rendering does (`tokenizers`
        splits at added tokens first), so a conversation without special-token text encodes the same."""
        contents = [m.get("content") for m in messages]
        marker = "\ue000" + secrets.token_hex(8)   # a private-use character and 64 random bits
        mark = re.compile(re.escape(marker) + r"(\d+)\ue001")
        marked = [m | {"content": f"{marker}{i}\ue001"} if isinstance(c, str) and c else m   # "" is falsy to a template
                  for i, (m, c) in enumerate(zip(messages, contents))]
        rendered = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        ids, run, pos = [], [], 0
        for m in [*mark.finditer(rendered), None]:
            template = rendered[pos:m.start() if m else len(rendered)]
            at = 0
            for t in self._added.finditer(template):
                run.append(template[at:t.start()])
                ids += self.encode_text("".join(run)) if any(run) else []
                run, at = [], t.end()
                ids.append(self._tok.token_to_id(t.group()))
            run.append(template[at:])
            if m:
                run.append(contents[int(m.group(1))])
                pos = m.end()
        return ids + (self.encode_text("".join(run)) if any(run) else [])

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


def _check_vocab(tok: Tokenizer, dims: ModelDims) -> None:
    if tok.vocab_size > dims.vocab:
        raise TokenizerError(f"{tok.where}tokenizer.json: {tok.vocab_size} tokens, more than the model's "
                             f"{dims.vocab} embedding rows")


def files_to_store(model_dir: str | Path, dims: ModelDims) -> dict[str, bytes]:
    """The tokenizer FILES `nanoqwen pack` stores for a HF directory ({} when it has no tokenizer.json), parsed
    and checked against ``dims`` first, so that a broken tokenizer fails the pack rather than the first run."""
    files = read_files(model_dir)
    if "tokenizer.json" in files:
        _check_vocab(Tokenizer.from_files(files, f"{model_dir}/"), dims)
        return files
    return {}


def load(model: str | Path, override_dir: str | Path | None = None) -> Tokenizer:
    """A model's tokenizer: the one way every command gets it. ``model`` is a .nanoqwen file (opened and
    validated before anything else, so a bad file reports its own error) or a HF directory; ``override_dir``, a
    HF directory, replaces the tokenizer the model brings (needed where a file stores none: format version 1,
    random weights)."""
    if override_dir is not None and not os.path.lexists(Path(override_dir) / "tokenizer.json"):
        raise TokenizerError(f"--tokenizer {override_dir}: no tokenizer.json in that directory")
    model = Path(model)
    if stat.S_ISDIR(lookup(model)):
        return Tokenizer(override_dir or model)
    f = NanoqwenFile(model)
    tok = Tokenizer(override_dir) if override_dir is not None else stored(f)
    _check_vocab(tok, f.dims)
    return tok


def stored(f: NanoqwenFile) -> Tokenizer:
    """The tokenizer an open .nanoqwen file stores; the error says why there is none and what to do."""
    files = {name: data for name in FILES if (data := f.blob(name)) is not None}
    if "tokenizer.json" not in files:
        why = (f"format version {f.version} stores none" if f.version < 2 else
               "random weights" if f.synthetic else "packed from a directory without tokenizer.json")
        raise TokenizerError(f"{f.path}: the file holds no tokenizer ({why}); pass --tokenizer DIR")
    return Tokenizer.from_files(files, f"{f.path}: ")


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
