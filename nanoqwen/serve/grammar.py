"""Structured output: a grammar enforced while decoding, by llguidance (PyPI `llguidance`). Each step the
grammar's matcher masks the tokens that cannot continue a valid answer (runtime/sampler.py applies the
mask before any other step), and the chosen token advances it; once the answer is complete only the
end-of-generation tokens are left.

Why llguidance rather than xgrammar: one self-contained abi3 wheel with no Python dependencies (xgrammar
pulls in torch, transformers, triton and more) that installs on CPU for Python 3.11 and 3.12 alike; it
builds its token trie straight from the tokenizers JSON nanoqwen already holds (tens of ms for a small
vocabulary, about a second for Qwen2.5's 152k, once per server, on the engine thread); it compiles JSON
schemas, Lark (with inline JSON schemas) and llama.cpp's GBNF; and it computes a mask in well under a
millisecond, next to the host sampling's vocabulary-sized download.

Uses: response_format json_object / json_schema, and tool_choice required / named (serve/tools.py), whose
grammar is the ``<tool_call>`` block(s) with arguments following the function's parameter schema. JSON
is compact (", " and ": " separators, no free whitespace): a small model otherwise may pad without end."""

from __future__ import annotations

import json
import threading

import numpy as np

from ..runtime.generate import ContextError
from .errors import APIError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance(param: str):
    try:
        import llguidance
    except ImportError:
        raise APIError(f"{param} needs the grammar engine llguidance, which is not installed on this server "
                       f"(pip install 'nanoqwen[serve]')", param=param) from None
    return llguidance


class Grammars:
    """The server's grammar engine over one tokenizer; ``vocab`` is the model's (its logits' length),
    ``eos`` the ids a complete answer may end with."""

    def __init__(self, tokenizer, vocab: int, eos: frozenset[int]):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, sorted(eos)
        self._ll = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        """Built on first use (by the engine thread: it may take a second). A tokenizer llguidance cannot
        take (no byte-level or byte-fallback decoder: a word-level one, say) fails the request (ContextError,
        a 400), not the engine."""
        with self._lock:
            if self._ll is None:
                lg = _llguidance("response_format")
                try:
                    self._ll = lg.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab, eos_token=self.eos)
                except ValueError as e:
                    raise ContextError(f"the grammar engine cannot use this model's tokenizer: {e}") from None
            return self._ll

    def json_schema(self, schema: dict, param: str) -> "Constraint":
        lg = _llguidance(param)
        try:
            grammar = lg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise APIError(f"{param}: not a JSON schema: {e}", param=param) from None
        return self._checked(grammar, param)

    def tool_calls(self, functions: list, parallel: bool) -> "Constraint":
        """One ``<tool_call>`` block (or several, with parallel calls) calling one of ``functions`` with
        arguments that follow its parameters' schema."""
        lg = _llguidance("tool_choice")
        calls = [{"type": "object", "properties": {"name": {"const": f.name},
                                                   "arguments": f.parameters or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        open_, close = (self._literal(t) for t in ("<tool_call>", "</tool_call>"))
        more = ' ("\\n" call)*' if parallel else ""
        body = json.dumps(schema | {"x-guidance": JSON_OPTIONS})
        lark = f'start: call{more}\ncall: {open_} "\\n" %json{body} "\\n" {close}\n'
        return self._checked(lg.LLMatcher.grammar_from_lark(lark), "tools")

    def gbnf(self, grammar: str, param: str) -> "Constraint":
        """llama.cpp's GBNF (llama-server's ``grammar`` field)."""
        lg = _llguidance(param)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
        try:
            lark = gbnf_to_lark(grammar)
        except GbnfToLarkError as e:
            raise APIError(f"{param}: not a GBNF grammar: {e}", param=param) from None
        return self._checked(lg.LLMatcher.grammar_from_lark(lark), param)

    def for_request(self, body, forced: "Constraint | None") -> "Constraint | None":
        """The one grammar of a request: OpenAI's response_format, llama-server's json_schema or grammar,
        or a forced tool call; two of them on one answer are a 400."""
        found = []
        fmt = getattr(body, "response_format", None)
        if fmt is not None and fmt.get("type") != "text":
            kind = fmt.get("type")
            if kind == "json_object":   # llama-server also takes a "schema" here
                found.append(self.json_schema(fmt.get("schema") or {"type": "object"}, "response_format"))
            elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) and \
                    isinstance(fmt["json_schema"].get("schema", {}), dict):
                found.append(self.json_schema(fmt["json_schema"].get("schema") or {}, "response_format"))
            else:
                raise APIError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}} "
                               f"(json_schema with {{'name', 'schema'}}), got {fmt!r}", param="response_format")
        if getattr(body, "json_schema", None) is not None:
            found.append(self.json_schema(body.json_schema, "json_schema"))
        if getattr(body, "grammar", None):
            found.append(self.gbnf(body.grammar, "grammar"))
        if forced is not None:
            found.append(forced)
        if len(found) > 1:
            raise APIError("one answer takes one grammar: response_format, json_schema, grammar and a forced tool "
                           "call exclude each other", param="response_format")
        return found[0] if found else None

    def _literal(self, text: str) -> str:
        """A tag as the grammar must see it: its token when the vocabulary has one (Qwen2.5's has
        <tool_call>), else its text."""
        i = self.tokenizer.token_to_id(text)
        return f"<[{i}]>" if i is not None and i in self.tokenizer.added_special_tokens else json.dumps(text)

    def _checked(self, grammar: str, param: str) -> "Constraint":
        if err := _llguidance(param).LLMatcher.validate_grammar(grammar):
            raise APIError(f"{param}: the grammar engine rejects it: {err}", param=param)
        return Constraint(self, grammar)


class Constraint:
    """One request's grammar; ``start()`` makes the matcher the sampler steps (sampler.Sampling.constraint)."""

    def __init__(self, grammars: Grammars, grammar: str):
        self.grammars, self.grammar = grammars, grammar

    def start(self) -> "Matcher":
        return Matcher(self.grammars, _llguidance("response_format").LLMatcher(self.grammars.lltokenizer(),
                                                                               self.grammar, log_level=0))


class Matcher:
    def __init__(self, grammars: Grammars, matcher):
        self.vocab, self.m = grammars.vocab, matcher

    # A matcher in an error state (llguidance's parser limits, say) would allow only end-of-generation and
    # end the answer early in silence: it fails the request instead, with ContextError (a 400 from the
    # worker, which leaves the engine serving; any other exception is an engine fault).

    def mask(self, z: np.ndarray) -> None:
        """Cut (-inf) every token the grammar does not allow next."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), np.uint8), bitorder="little")[:z.size]
        if self.m.is_error():
            raise ContextError(f"the grammar failed: {self.m.get_error().splitlines()[0]}")
        z[~bits.astype(bool)] = -np.inf

    def accept(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise ContextError(f"the grammar refused token {token}: {self.m.get_error().splitlines()[0]}")
