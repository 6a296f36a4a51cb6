"""Tool calling in Qwen2.5's own format. The request's ``tools`` go to the model's chat template (the one
stored in the .nanoqwen file: Qwen2.5's lists them in the system turn and asks for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks); earlier assistant ``tool_calls`` and
``role: "tool"`` results go back into the history the same way. The answer's blocks become OpenAI
``tool_calls`` (arguments as a JSON string, finish_reason "tool_calls"); an answer whose blocks do not
parse, or name a function the request did not offer, comes back as plain text (the calls that do parse
stay calls).

tool_choice: "auto" (the default with tools) lets the model choose; "none" leaves the tools out of the
prompt; "required" and a named function are enforced while decoding by the grammar of serve/grammar.py."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from .errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class ToolUse:
    """One chat request's tools: what the template sees, the forced choice, and the answer's parser."""

    def __init__(self, tools: list[Tool] | None, tool_choice, parallel: bool | None, template: str | None):
        self.tools = tools or []
        self.parallel = parallel is not False
        self.forced: list[Function] = []   # the functions one of which the answer must call
        names = {t.function.name: t.function for t in self.tools}
        if tool_choice in (None, "auto"):
            self.mode = "auto" if self.tools else "none"
        elif tool_choice == "none":
            self.mode = "none"
        elif tool_choice == "required":
            self.mode, self.forced = "required", list(names.values())
        elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
            if name not in names:
                raise APIError(f"tool_choice names the function {name!r}, which is not among the tools",
                               param="tool_choice")
            self.mode, self.forced = "required", [names[name]]
        else:
            raise APIError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                           f"{{'name': ...}}}}, got {tool_choice!r}", param="tool_choice")
        if self.mode == "required" and not self.forced:
            raise APIError("tool_choice 'required' needs at least one tool", param="tool_choice")
        if self.mode != "none" and (template is None or "tools" not in template):
            raise APIError("this model's chat template has no tools section: it cannot be offered tools",
                           param="tools")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def constraint(self, grammars):
        """The grammar that forces a call (tool_choice required or named), else None."""
        return grammars.tool_calls(self.forced, self.parallel) if self.mode == "required" else None

    def template_kwargs(self) -> dict:
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools]} if self.active else {}

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer, as its stream would give them: the calls, and the
        text outside them (blocks that do not parse included; None if there are calls and it is blank)."""
        if not self.active:
            return text, []
        stream = self.stream(incremental=False)
        deltas = stream.push(text) + stream.flush()
        content = "".join(d.get("content", "") for d in deltas)
        return (content.strip() or None, stream.calls) if stream.calls else (content, [])

    def _call(self, block: str) -> dict | None:
        """The call of a whole ``<tool_call>...</tool_call>`` block, or None. Its arguments are the model's
        own JSON text when the block starts as the stream commits to a call (``HEAD``), so a whole answer's
        arguments are the streamed ones; otherwise (another key order, arguments nested as a string)
        re-serialized."""
        try:
            obj = json.loads(block[len(OPEN):-len(CLOSE)])
        except ValueError:
            return None
        if not isinstance(obj, dict) or not self.offers(obj.get("name")):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):   # some answers nest the arguments as a JSON string already
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        text = json.dumps(args, ensure_ascii=False)
        if m := HEAD.match(block):
            _, end = json.JSONDecoder().raw_decode(block, m.end() - 1)
            if json.loads(block[m.end() - 1:end]) == args:   # not a second "arguments" key
                text = block[m.end() - 1:end]
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": text}}

    def offers(self, name: str) -> bool:
        return any(t.function.name == name for t in self.tools)

    def stream(self, incremental: bool = True) -> "ToolStream":
        return ToolStream(self, incremental)


# How a block starts when the stream streams its arguments: the name of an offered function, then the
# arguments object's opening brace (the model's format, Qwen2.5's template asks for exactly this order).
HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{')
TAIL = re.compile(r"\s*\}\s*</tool_call>")
JSON_OUTSIDE_STRINGS = frozenset("{}[],:0123456789-+.eEtrufalsn \t\n\r")   # what else is no JSON


@dataclass
class _Streaming:
    """A call whose arguments are streaming, and where the scan of its JSON text stands."""
    call: dict
    index: int
    block: str              # the block's text so far
    depth: int = 0          # of brackets and braces
    in_str: bool = False
    esc: bool = False


class ToolStream:
    """Streamed text in, OpenAI chat deltas out. Text outside blocks passes as content (holding back a
    tail that may begin ``<tool_call>``). A block whose head names an offered function and opens its
    arguments object (``HEAD``) is a call from there on: a delta with its index, id, type, name and
    arguments "", then its arguments' text as it arrives (the fragments join to the final arguments).
    Any other block is held until its ``</tool_call>`` and comes out whole (two deltas) or, unparsable, as
    content. A streamed call cannot be taken back: if its block breaks after the head (no JSON, the answer
    ending inside it), it keeps the arguments sent and the rest of the block comes out as content (a whole
    answer, ``incremental=False``, knows the end and gives such a block as text). ``calls`` holds the calls
    sent; ``flush()`` at the end."""

    def __init__(self, tools: ToolUse, incremental: bool = True):
        self.tools, self.incremental = tools, incremental
        self.buf, self.calls = "", []
        self.call: _Streaming | None = None   # the call whose arguments are streaming
        self.tail = False  # its arguments are whole: "}" and </tool_call> expected

    def push(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self.buf:
            if self.call is not None:
                if not (self._tail(out) if self.tail else self._arguments(out)):
                    break
                continue
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                             if OPEN.startswith(self.buf[-k:])), 0)
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._content(out, self.buf[:start])
            self.buf = self.buf[start:]
            if self.incremental and self._commit(out):
                continue
            end = self.buf.find(CLOSE)
            if end < 0:
                break
            block, self.buf = self.buf[:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            call = self.tools._call(block)
            if call is None:
                self._content(out, block)
            elif self.tools.parallel or not self.calls:   # without parallel calls, the first one only
                fn, i = call["function"], len(self.calls)
                out.append(self._head(i, call))
                out.append(self._args(i, fn["arguments"]))
                self.calls.append(call)
        return out

    @staticmethod
    def _head(i: int, call: dict) -> dict:
        return {"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""}}]}

    @staticmethod
    def _args(i: int, text: str) -> dict:
        return {"tool_calls": [{"index": i, "function": {"arguments": text}}]}

    def _commit(self, out: list) -> bool:
        """Start streaming the block at the head of ``buf`` if its head is a call's."""
        m = HEAD.match(self.buf)
        if m is None or not (self.tools.parallel or not self.calls):
            return False
        try:
            name = json.loads(f'"{m[1]}"')
        except ValueError:
            return False
        if not self.tools.offers(name):
            return False
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": ""}}
        out.append(self._head(len(self.calls), call))
        self.calls.append(call)
        self.call, self.tail = _Streaming(call, len(self.calls) - 1, self.buf[:m.end() - 1]), False
        self.buf = self.buf[m.end() - 1:]
        return True

    def _arguments(self, out: list) -> bool:
        """Send the arguments' text in ``buf`` up to the object's end; False when ``buf`` is used up."""
        st = self.call
        depth, in_str, esc = st.depth, st.in_str, st.esc
        n, broken = 0, False
        for n, c in enumerate(self.buf, 1):
            if in_str:
                esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    break
            elif c not in JSON_OUTSIDE_STRINGS:
                n, broken = n - 1, True
                break
        sent, self.buf = self.buf[:n], self.buf[n:]
        if sent:
            st.call["function"]["arguments"] += sent
            out.append(self._args(st.index, sent))
        st.block += sent
        st.depth, st.in_str, st.esc = depth, in_str, esc
        if broken:
            self.call = None   # the rest of the block is content
        elif depth == 0:
            self.tail = True
        return bool(self.buf)

    def _tail(self, out: list) -> bool:
        """After the arguments: the block's close, then the whole block must parse as this call."""
        m = TAIL.match(self.buf)
        if m is None:
            rest = self.buf.lstrip()
            if rest and not (rest[0] == "}" and CLOSE.startswith(rest[1:].lstrip())):
                self.call = None   # not the block's end: the rest is content
                return True
            return False   # wait for more
        call, block = self.call.call, self.call.block + m[0]
        whole = self.tools._call(block)
        self.call, self.buf = None, self.buf[m.end():]
        if whole is None or whole["function"]["arguments"] != call["function"]["arguments"]:
            self._content(out, m[0])   # its arguments are no JSON after all: the block's end is content
        return True

    def _content(self, out: list, text: str) -> None:
        # between and after calls, whitespace is the format's, not content
        if text and not (self.calls and not text.strip()):
            out.append({"content": text})

    def flush(self) -> list[dict]:
        """The held tail (an unfinished block comes out as text)."""
        out: list[dict] = []
        self.call = None
        self._content(out, self.buf)
        self.buf = ""
        return out


def template_messages(messages) -> list[dict]:
    """The request's messages as the chat template reads them: text content, OpenAI's "developer" as
    "system", assistant tool calls with their arguments as objects (the template writes them with
    tojson), tool results as role "tool"."""
    out = []
    for m in messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [_history_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _history_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass   # the model wrote it that way: it goes back as written
    return {**call, "function": fn}
