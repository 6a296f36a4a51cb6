"""OpenAI's `n` against the real server process (reference backend, the small test model) through the
official `openai` client: n choices, each its own index; greedy choices are the engine's greedy answer;
sampled choice i is what a single request seeded seed + i gets (independent samples, reproducible);
streamed choices interleave and accumulate to the whole answer; usage counts the prompt once; a client
leaving cancels every choice, and a queue that cannot take them all refuses the request whole; n beyond
what the server holds, and best_of, are 400s naming them."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from _serve_util import ScriptedEngine, greedy, model_fixtures, serve_in_process, server as start_server

PROMPT = "def parse_args(argv):\n    "
CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]


model, local, backend = model_fixtures("choices")


@pytest.fixture(scope="module")
def server(model, local):
    s = start_server(model[0], "--max-queue", "4", "--max-running", "2", backend="reference", cache_dir=model[1])
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_choices_are_the_greedy_answer(client, local):
    engine, tok, stop = local
    ids = tok.encode(PROMPT)
    want = greedy(engine, stop, ids, 6)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == tok.decode([t for t in want if t not in stop]) for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3 * len(want))
    assert r.usage.total_tokens == len(ids) + 3 * len(want)


def test_sampled_choice_i_is_the_request_seeded_seed_plus_i(client):
    kw = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    r = client.completions.create(n=3, seed=7, **kw)
    alone = [client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1   # independent samples (these seeds give different texts on this model)


def test_streamed_chat_choices_interleave_and_add_up(client):
    kw = {"model": "m", "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**kw)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        assert len(ch.choices) <= 1   # each chunk one choice
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [({"n": 7}, "n"), ({"n": 0}, "n"), ({"best_of": 2}, "best_of")])
def test_n_beyond_the_server_and_best_of_are_400(server, body, param):
    # --max-queue 4 and --max-running 2: 6 sequences at once at most
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2} | body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert body.get("n") != 7 or "between 1 and 6" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_cancels_every_choice(server, stream):
    """n = 3 long generations (many seconds each on this backend); the client leaves after the first
    second or the first chunk: all three stop."""
    cancelled0 = server.metric("nanoqwen_requests_cancelled_total")
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "n": 3, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 30
    while server.metric("nanoqwen_requests_cancelled_total") != cancelled0 + 3 or \
            server.metric("nanoqwen_requests_running") != 0:
        assert time.monotonic() < deadline, "a client's departure did not cancel all its choices"
        time.sleep(0.05)


class HeldEngine(ScriptedEngine):
    """The stand-in engine, its generation held at its start (``started``) until ``release``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.started, self.release = threading.Event(), threading.Event()

    def generate(self, *args, **kw):
        self.started.set()
        assert self.release.wait(120), "never released"
        yield from super().generate(*args, **kw)


def test_choices_the_queue_cannot_take_are_all_refused(local):
    """One request runs, held (the stand-in engine runs one at a time) and the queue holds 2: of n = 3
    choices the third is refused, so the request is a 503 and its two queued choices leave the queue."""
    engine = HeldEngine([300])
    client = serve_in_process(lambda: (engine, local[1]), max_queue=2)
    out = {}
    slow = threading.Thread(target=lambda: out.update(r=client.post("/v1/completions",
                                                                    json={"prompt": "x", "max_tokens": 20})))
    slow.start()
    try:
        assert engine.started.wait(60), "the first request never ran"
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert not client.worker._queue
    finally:
        engine.release.set()
        slow.join(60)
    assert out["r"].json()["usage"]["completion_tokens"] == 20
    assert len(engine.requests) == 1   # only the held one ran
