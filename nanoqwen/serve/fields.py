"""Fields outside a model's own. Requests: the one list of fields accepted and ignored, because they
change nothing in this server's answer, and of those accepted only at their neutral value (a sampler or
feature this server does not have: any other value is a 400 naming the field); every other unknown field
is a 400 naming it, so that nothing a client asks for is dropped silently. Responses: llama-server's
``response_fields``: a client (llama.vim) names the fields of the response it reads, nested ones by their
path; the response then holds only those, each under the name it was asked by (``"timings/prompt_n"`` is
a top-level key). A field that does not exist is left out, as in llama-server."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import APIError

IGNORED = {
    "user": "OpenAI: an end-user id for abuse monitoring",
    "metadata": "OpenAI: tags for stored completions",
    "store": "OpenAI: keep the completion on the server (this one keeps nothing)",
    "service_tier": "OpenAI: the processing tier",
    "prompt_cache_key": "OpenAI: a hint for prompt caching (prefix reuse here is automatic)",
    "safety_identifier": "OpenAI: an end-user id for abuse monitoring",
    "prediction": "OpenAI: predicted output; it changes latency, never the answer",
    "reasoning_effort": "OpenAI: reasoning budget; Qwen2.5 does not reason before answering",
    "cache_prompt": "llama-server: prefix reuse is always on here",
    "id_slot": "llama-server: the slot; this server has one",
    "t_max_prompt_ms": "llama-server: parsed but not used by llama-server either",
    "timings_per_token": "llama-server: timings in every streamed chunk (the last one has them)",
    "return_tokens": "llama-server: token ids in the reply (streamed chunks carry them)",
}

NEUTRAL = {   # llama-server's samplers that are not implemented: their off value is accepted
    "mirostat": 0, "typical_p": 1.0, "typ_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
    "top_n_sigma": -1.0, "dynatemp_range": 0.0, "tfs_z": 1.0,
}


class Checked(BaseModel):
    """A request model whose unknown fields are refused unless listed above."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data):
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields)
            for key, value in data.items():
                if key in known or key in IGNORED:
                    continue
                if key in NEUTRAL:
                    if value is None or value == NEUTRAL[key]:
                        continue
                    raise APIError(f"{key} is not supported (only its neutral value {NEUTRAL[key]!r})", param=key)
                raise APIError(f"unknown field {key!r}: this server neither honours nor ignores it", param=key)
        return data


def response_fields(obj: dict, paths: list[str]) -> dict:
    if not paths:
        return obj
    out = {}
    for path in paths:
        value = obj
        for key in path.split("/"):
            if not (isinstance(value, dict) and key in value):
                break
            value = value[key]
        else:
            out[path] = value
    return out
