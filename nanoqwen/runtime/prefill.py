"""Prefill, first version: the prompt goes through the decode step itself, one token per step, in
whatever mode the decoder runs (eager or its one replayed graph). Slow for long prompts (every step also
runs the lm_head) but correct by construction: it is exactly the kernels the decode tests check, and
it needs nothing the decode step does not have. The tensor-core prefill (DESIGN.md section 6) is a
later issue; it will replace this function, not the decoder."""

from __future__ import annotations


def prefill(decoder, prompt: list[int], read_last: bool = True) -> int:
    """Enqueue steps 0 .. len(prompt)-1, step i feeding ``prompt[i]`` into state[0] (step 0's token was
    set by ``decoder.reset``). With ``read_last`` the last step's argmax, the first new token, is copied
    out. Nothing here waits for the GPU. Returns the number of steps enqueued."""
    for i, tok in enumerate(prompt):
        decoder.step(i, feed=tok if i else None, read_token=read_last and i == len(prompt) - 1)
    return len(prompt)
