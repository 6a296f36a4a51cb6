"""The request fields that choose tokens, shared by every endpoint (OpenAI's names, with llama-server's
and vLLM's aliases), turned into the engine's Sampling. Any of them other than plain greedy sends the
request down the host sampling path (runtime/sampler.py); a greedy request without them keeps the device
argmax. A value the sampler cannot honour is a 400 naming its field."""

from __future__ import annotations

from pydantic import Field

from ..runtime.sampler import Sampling, SamplingError, Vocab
from .errors import APIError
from .fields import Checked

# llama-server's logit_bias: [[token id or text, bias or false (never)], ...]; OpenAI's: {"id": bias}
LogitBias = dict[str, float] | list[tuple[int | str, float | bool]]
NEVER = -1e30   # a bias of false: the token is never chosen


class SamplingFields(Checked):
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)   # vLLM's / HF's name
    repeat_penalty: float | None = Field(None, gt=0.0)       # llama-server's name
    repeat_last_n: int = Field(-1, ge=-1)   # the tokens repetition_penalty looks back on: -1 = all, 0 = none
    penalty_last_n: int | None = Field(None, ge=-1)   # llama-server's other name of repeat_last_n
    logit_bias: LogitBias | None = None
    samplers: list[str] | None = None       # llama-server's sampler chain, in order
    # grammars (serve/grammar.py): OpenAI's response_format, llama-server's json_schema and GBNF grammar
    response_format: dict | None = None
    json_schema: dict | None = None
    grammar: str | None = None


def _bias(field: LogitBias | None, tok, vocab: int) -> tuple[tuple[int, float], ...]:
    if not field:
        return ()
    pairs = field.items() if isinstance(field, dict) else field
    out = []
    for key, bias in pairs:
        bias = NEVER if bias is False else float(bias)
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            if isinstance(field, dict):
                raise APIError(f"logit_bias: the key {key!r} is not a token id", param="logit_bias")
            out += [(t, bias) for t in tok.encode(key)]   # llama-server: a text biases each of its tokens
            continue
        if not 0 <= int(key) < vocab:
            raise APIError(f"logit_bias: token id {key} is outside the vocabulary [0, {vocab})", param="logit_bias")
        if bias != NEVER and not -100.0 <= bias <= 100.0:
            raise APIError(f"logit_bias: the bias {bias} of token {key} is outside [-100, 100]", param="logit_bias")
        out.append((int(key), bias))
    return tuple(out)


def sampling(body, tok, vocab: int, eog: frozenset[int], grammars, forced=None) -> Sampling:
    """``body`` has temperature, top_p, seed and the SamplingFields; ``eog`` are the ids that end a
    generation (the infill step's); ``grammars`` makes the request's grammar, ``forced`` a tool call's."""
    penalties = [f for f in ("repetition_penalty", "repeat_penalty") if getattr(body, f) is not None]
    if len(penalties) == 2 and body.repetition_penalty != body.repeat_penalty:
        raise APIError("repetition_penalty and repeat_penalty are two names of one field: send one",
                       param="repeat_penalty")
    window = body.repeat_last_n if body.penalty_last_n is None else body.penalty_last_n
    infill = body.samplers is not None and "infill" in body.samplers
    try:
        return Sampling(body.temperature, body.top_p, body.seed, top_k=body.top_k, min_p=body.min_p,
                        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                        repetition_penalty=getattr(body, penalties[0]) if penalties else 1.0,
                        penalty_window=window, logit_bias=_bias(body.logit_bias, tok, vocab),
                        order=tuple(body.samplers) if body.samplers is not None else None,
                        vocab=Vocab(lambda i: tok.decode([i]), eog) if infill else None,
                        constraint=grammars.for_request(body, forced))
    except SamplingError as e:   # the sampler's words are the CLI's: name the request's field
        msg = str(e).replace("--top-p", "top_p").replace("--", "")
        raise APIError(msg, param=msg.split()[0].rstrip(":")) from None
