"""Prompt logprobs with ``echo`` on /v1/completions (OpenAI's legacy scoring: ``echo`` with ``logprobs``
returns the prompt tokens' logprobs, the first one null, before the completion's). They need the logits
of every prompt position: the scheduler's multi-sequence step returns them on an engine that declares
``prompt_logits`` (the reference engine; the CUDA engine, whose prefill's final rows go through the
multi-row lm_head, runtime/batchstep.py)."""

from __future__ import annotations

from .errors import APIError


def check_prompt_logprobs(engine, suffix: str | None) -> None:
    """Refuse (400, naming ``echo``) what cannot be scored."""
    if suffix is not None:
        raise APIError("echo with logprobs scores a plain prompt, not a fill-in-the-middle one (suffix)",
                       param="echo")
    if not getattr(engine, "prompt_logits", False):
        raise APIError(f"echo with logprobs needs the logits of every prompt position, which the {engine.name} "
                       f"engine does not compute", param="echo")
