"""How many tokens a request may generate. The room left after the prompt caps ``max_tokens`` (clients
send their own default, e.g. Continue's 4096, whatever the model: the answer is clamped and ends with
finish_reason "length", as vLLM and llama-server do); a prompt that alone fills the context is a 400 with
OpenAI's code and wording, which Cline and Roo match to truncate their history."""

from __future__ import annotations

from ..runtime.generate import ContextError, check_request
from .errors import APIError


def overflow(context: int, prompt_tokens: int) -> APIError:
    return APIError(f"This model's maximum context length is {context} tokens. However, your messages resulted "
                    f"in {prompt_tokens} tokens, which leaves no room to generate. Please reduce the length of "
                    f"the messages.", param="messages", code="context_length_exceeded")


def fit(engine, prompt: list[int], max_tokens: int | None, param: str) -> int:
    """``max_tokens`` clamped to the room left (all of it when None; 0 prefills the prompt only, kept for
    prefix reuse). The last new token is never fed back, so it may take the position after a full KV
    cache, within the model's positions."""
    room = min(engine.context + 1, engine.dims.max_positions) - len(prompt)
    if prompt and room < 1:
        raise overflow(engine.context, len(prompt))
    n = room if max_tokens is None else min(max_tokens, room)
    try:
        check_request(engine.dims, prompt, max(n, 1), engine.context)   # 0: prefill only (the engine still makes one)
    except ContextError as e:   # the engine's words are the CLI's; name the request's field instead
        raise APIError(str(e).replace("--max-new-tokens", param).replace("max_new_tokens", param),
                       param=param) from None
    return n


def requested(body, *names: str) -> tuple[int | None, str]:
    """(the length the client asked for, the field that said it): the first of ``names`` it set (a
    negative n_predict: all the room), else the first one's default."""
    for name in names:
        if name in body.model_fields_set and (v := getattr(body, name)) is not None:
            return (None if v < 0 else v), name
    return getattr(body, names[0]), names[0]
