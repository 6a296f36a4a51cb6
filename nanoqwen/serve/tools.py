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
import uuid
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
        stream = self.stream()
        deltas = stream.push(text) + stream.flush()
        content = "".join(d.get("content", "") for d in deltas)
        return (content.strip() or None, stream.calls) if stream.calls else (content, [])

    def _call(self, block: str) -> dict | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in {t.function.name for t in self.tools}:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):   # some answers nest the arguments as a JSON string already
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """Streamed text in, OpenAI chat deltas out. Text outside blocks passes as content (holding back a
    tail that may begin ``<tool_call>``); a block is held until its ``</tool_call>``, then comes out as
    two deltas of ``tool_calls``: the call's index, id and name, then its arguments. An unparsable block
    comes out as content. ``calls`` holds the calls sent; ``flush()`` at the end."""

    def __init__(self, tools: ToolUse):
        self.tools, self.buf, self.calls = tools, "", []

    def push(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self.buf:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                             if OPEN.startswith(self.buf[-k:])), 0)
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._content(out, self.buf[:start])
            end = self.buf.find(CLOSE, start)
            if end < 0:
                self.buf = self.buf[start:]
                break
            block, self.buf = self.buf[start:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            call = self.tools._call(block[len(OPEN):-len(CLOSE)])
            if call is None:
                self._content(out, block)
            elif self.tools.parallel or not self.calls:   # without parallel calls, the first one only
                fn, i = call["function"], len(self.calls)
                out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]})
                out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
                self.calls.append(call)
        return out

    def _content(self, out: list, text: str) -> None:
        # between and after calls, whitespace is the format's, not content
        if text and not (self.calls and not text.strip()):
            out.append({"content": text})

    def flush(self) -> list[dict]:
        """The held tail (an unfinished block comes out as text)."""
        out: list[dict] = []
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
