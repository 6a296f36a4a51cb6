"""Request bodies, with OpenAI's field names (and llama-server's for /tokenize, /detokenize;
/infill and /completion are serve/llama_compat.py's).
Fields that change nothing here (user, cache_prompt, ...) are listed in serve/fields.py and ignored, any
other unknown field is a 400; values the server cannot honour (best_of > 1, a batch of prompts) are
refused by the routes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .errors import APIError
from .sampling import SamplingFields
from .tools import Tool

Stop = str | list[str] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampled(SamplingFields):
    """The sampling fields shared by the OpenAI endpoints (OpenAI's defaults)."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 64)   # numpy's generators take non-negative seeds
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    n_predict: int | None = Field(None, ge=-1)   # llama-server's max_tokens (-1: all the room left)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampled):
    # token ids first: pydantic tries the members in order, and an editor's long prompt of ids parses 30%
    # faster than behind str (no value is valid for two members, but [], which is every list member's)
    prompt: list[int] | str | list[str] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=0)   # 0: prefill only, kept for prefix reuse (OpenAI allows it)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None


class ContentPart(BaseModel):
    type: str
    text: str = ""


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]   # what the chat template renders
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None   # an assistant turn's calls (serve/tools.py)
    tool_call_id: str | None = None        # a tool turn's answer to one of them
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            if other := next((p.type for p in self.content if p.type != "text"), None):
                raise APIError(f"this model takes text only: a message has a {other!r} content part",
                               param="messages", code="unsupported_content")
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class ExtraFile(BaseModel):
    filename: str = ""
    text: str


class TokenizeRequest(BaseModel):
    content: str
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    tokens: list[int]
