"""OpenAI's ``n``: n independent samples of one request, each its own job (a sequence of the scheduler,
choice i seeded ``seed + i`` when a seed is given, so a seed still fixes every choice; with temperature 0
they are identical), answered as choices 0..n-1 whole, or streamed with their chunks interleaved as they
come (each chunk one choice, with its index), usage once at the end: the prompt counted once, the
completions summed."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

from .errors import APIError
from .jobs import Done, Job, PromptLogprobs, Token
from .sse import frame as _sse

MAX_CHOICES = 16   # each is a queued sequence: a bound keeps one request from filling the queue


def check_n(n: int, worker) -> None:
    """At most MAX_CHOICES, and no more than the server can hold at once (running and queued)."""
    limit = min(MAX_CHOICES, worker.max_queue + worker.max_running)
    if not 1 <= n <= limit:
        raise APIError(f"n must be between 1 and {limit} on this server, got {n}", param="n")


def submit(srv, request, n: int, make) -> list[Job]:
    """``make(sampling_seed_offset)`` -> a Job; n of them submitted (none if one is refused)."""
    jobs = []
    try:
        for i in range(n):
            jobs.append(srv.submit(request, make(i)))
    except APIError:
        for job in jobs:
            srv.worker.cancel(job)
        raise
    return jobs


def seeded(sampling, i: int):
    """Choice i's sampling: its own seed when the request fixes one."""
    if sampling.seed is None or i == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 64))


async def collect(srv, jobs: list[Job], request) -> list | None:
    """Each job's (text, logprobs, Done); None when the client left (every job then cancelled)."""
    watch = asyncio.create_task(disconnect(request, *jobs))
    tasks = [asyncio.create_task(srv.collect(job)) for job in jobs]
    try:
        out = await asyncio.gather(*tasks)
    finally:   # one failed (a 4xx / 5xx for the request): the others stop at their next token
        watch.cancel()
        for t in tasks:
            t.cancel()
    return None if any(done is None for _, _, done in out) else out


async def disconnect(request, *jobs: Job) -> None:
    """Wakes each job's ``Server.events`` with None when the client of a non-streamed request leaves: once
    the body is read, the server's receive() returns only at the disconnect (polling is_disconnected
    between events would never run while tokens keep coming)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.events.put_nowait(None)


def _usage(prompt_tokens: int, done: Done) -> dict:
    """One choice's usage; a speculating server adds the draft tokens in the fields OpenAI uses for its
    predicted outputs (accepted / rejected prediction tokens)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done.completion_tokens,
             "total_tokens": prompt_tokens + done.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
    if done.drafted_tokens is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": done.accepted_tokens,
                                              "rejected_prediction_tokens": done.drafted_tokens - done.accepted_tokens}
    return usage


def usage(prompt_tokens: int, dones: list[Done]) -> dict:
    """OpenAI's usage object over every choice."""
    total = _usage(prompt_tokens, dones[0])
    for done in dones[1:]:
        more = _usage(prompt_tokens, done)
        total["completion_tokens"] += more["completion_tokens"]
        total["total_tokens"] += more["completion_tokens"]
        for k, v in more.get("completion_tokens_details", {}).items():
            total["completion_tokens_details"][k] += v
    return total


async def stream(srv, jobs: list[Job], first, choices, final_usage):
    """SSE over every job: ``first(i)`` (bytes, maybe empty) per choice, then its events as they come:
    ``choices[i]`` = (chunk(text, logprobs), final(done), prompt(items)) as for one job
    (``Server.stream``), then ``final_usage(dones)`` (an object or None) and ``data: [DONE]``. An engine
    error after the 200 goes in-band and ends the stream."""
    for i in range(len(jobs)):
        if head := first(i):
            yield head
    queue: asyncio.Queue = asyncio.Queue()
    dones: list = [None] * len(jobs)

    async def pump(i: int, job: Job) -> None:
        chunk, final, prompt = choices[i]
        try:   # the events are closed (the job cancelled) when this task is cancelled
            async with aclosing(srv.events(job)) as events:
                async for ev in events:
                    if isinstance(ev, Token):
                        if ev.text or ev.logprobs:
                            out = chunk(ev.text, ev.logprobs)
                            for obj in out if isinstance(out, list) else [out]:
                                queue.put_nowait(_sse(obj))
                    elif isinstance(ev, PromptLogprobs):
                        queue.put_nowait(_sse(prompt(ev.items)))
                    else:
                        dones[i] = ev
                        for obj in final(ev):
                            queue.put_nowait(_sse(obj))
        except APIError as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)   # this job is over

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, APIError):
                yield _sse(item.body())
                break
            else:
                yield item
        else:
            if (obj := final_usage(dones)) is not None:
                yield _sse(obj)
        yield b"data: [DONE]\n\n"
    finally:   # the client left, or an error ended the stream: the other jobs stop at their next token
        for t in tasks:
            t.cancel()
