"""Several clients at once (serve/scheduler.py) on the reference backend: real `nanoqwen serve` processes on
127.0.0.1 driven by the official `openai` client, streaming. Each stream's greedy tokens, and the logprob of
each of them (a function of its whole logits row), must be bitwise what the same engine gives the request
alone, whatever ran beside it: mixed prompt lengths read in chunks between decode steps, mixed max_tokens,
clients that leave mid-stream, speculative requests, a sequence that waits for pages. The reference's step
computes every row as one decode step (class (a) of docs/architecture.md), so equality is exact. No prompt
extends another prompt sent to the same server (each starts at its own offset of the text): on the CUDA
engine a prompt position reused from the prefix cache is a cold prefill's bits, a generated one is not. Where a
test needs two requests side by side at a given moment (a page wait, a failed admission), the app runs in
process and the test holds the engine thread between steps (HeldSteps) rather than racing it."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from _serve_util import in_worker, model_fixtures, open_local, serve_in_process, server as start_server
from _texts import code_text
from nanoqwen.runtime.sampler import Sampling
from nanoqwen.serve.jobs import top_logprobs

STEP_TOKENS = 16   # small, so that prompts are read in many chunks between the running streams' steps


model, local, backend = model_fixtures("batching")


@pytest.fixture(scope="module")
def ids(local):
    """Committed Python source as token ids: prompts are slices of it."""
    return local[1].encode(code_text())


def alone(local, prompt: list[int], max_tokens: int) -> tuple[list[str], list[float], str]:
    """(token texts, their logprobs, finish reason) of a greedy request run alone and cold in this process
    (its prefix cache emptied first: a reused generated position is not a prefill's bits on the GPU)."""
    engine, tok, stop = local
    (engine.runner.cache if hasattr(engine, "runner") else engine.cache).clear()
    texts, lps, finish = [], [], "length"
    for t, row in engine.generate(prompt, max_tokens, Sampling(), logits=True):
        if t in stop:
            finish = "stop"
            break
        text, lp, _ = top_logprobs(tok, row, t, 1)
        texts.append(text)
        lps.append(lp)
    return texts, lps, finish


def stream(client, prompt, max_tokens: int, leave_after: int | None = None, **kw) -> dict:
    """A streamed completion (greedy unless ``kw`` says otherwise): its token texts, logprobs, finish reason
    (and text, usage); with ``leave_after`` the client closes the stream after that many chunks."""
    s = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, stream=True, logprobs=1,
                                  stream_options={"include_usage": True}, **({"temperature": 0} | kw))
    out = {"texts": [], "lps": [], "text": "", "finish": None, "usage": None}
    for i, chunk in enumerate(s):
        if leave_after is not None and i == leave_after:
            s.close()
            return out
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for c in chunk.choices:
            out["text"] += c.text
            if c.logprobs is not None:
                out["texts"] += c.logprobs.tokens
                out["lps"] += c.logprobs.token_logprobs
            out["finish"] = c.finish_reason or out["finish"]
    return out


def run_all(fn, n: int) -> list:
    """fn(i) for i < n, each in its own thread, all started together; their results in order."""
    out, errors = [None] * n, []
    start = threading.Barrier(n)

    def work(i):
        try:
            start.wait()
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "a client never finished"
    return out


def histogram(server, name: str) -> dict[str, float]:
    """le -> cumulative count of a /metrics histogram."""
    text = httpx.get(f"{server.url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)} | {
        "count": float(re.search(rf"^{name}_count (\S+)$", text, re.M)[1])}


# ---- 16 clients, 8 running ------------------------------------------------------------------------------

LENGTHS = (3, 250, 17, 40, 120, 9, 64, 31, 180, 5, 90, 22, 140, 12, 75, 50)   # prompt tokens per client
MAX_TOKENS = (24, 6, 40, 1, 12, 32, 3, 20, 8, 28, 16, 2, 10, 36, 5, 14)
LEAVE = {2: 3, 7: 1, 11: 0, 13: 5}   # client -> chunks read before it disconnects (max_tokens 2000 for these)


@pytest.fixture(scope="module")
def server(model, backend):
    s = start_server(model[0], "--max-running", "8", "--step-tokens", str(STEP_TOKENS), "--kv-tokens", "65536",
                     backend=backend, cache_dir=model[1])
    yield s
    s.close()


def test_sixteen_concurrent_streams_are_each_bitwise_alone(server, local, ids):
    prompts = [ids[37 * i:37 * i + n] for i, n in enumerate(LENGTHS)]
    expected = {i: alone(local, p, m) for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)) if i not in LEAVE}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    cancelled0 = server.metric("nanoqwen_requests_cancelled_total")

    def ask(i):
        return stream(client, prompts[i], 2000 if i in LEAVE else MAX_TOKENS[i], LEAVE.get(i))
    got = run_all(ask, len(prompts))
    for i, (texts, lps, finish) in expected.items():
        g = got[i]
        assert (g["texts"], g["lps"], g["finish"]) == (texts, lps, finish), f"client {i}"
        assert g["text"] == "".join(texts) and g["usage"].completion_tokens == len(texts) + (finish == "stop")
    deadline = time.monotonic() + 60
    while server.metric("nanoqwen_requests_cancelled_total") != cancelled0 + len(LEAVE):
        assert time.monotonic() < deadline, "a client's departure did not cancel its generation"
        time.sleep(0.05)
    while server.metric("nanoqwen_requests_running") != 0:   # the cancelled rows go at the next step
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metric("nanoqwen_kv_pages", state="running") == 0
    assert server.metric("nanoqwen_kv_pages", state="kept") > 0
    steps = histogram(server, "nanoqwen_step_sequences")
    assert steps["count"] > steps["1.0"], "no step ran two sequences"
    assert steps["8.0"] == steps["count"], "more sequences in a step than --max-running"
    rows = histogram(server, "nanoqwen_step_rows")
    assert rows["16.0"] == rows["count"], "a step exceeded --step-tokens"


def test_seeded_sampling_and_penalties_are_per_request(server, ids):
    """Sampled requests (seed, temperature, top_p, penalties) give, side by side, what each gives alone."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    fields = [dict(temperature=0.9, seed=1), dict(temperature=0.7, top_p=0.8, seed=2),
              dict(temperature=0, frequency_penalty=1.5), dict(temperature=1.2, presence_penalty=0.5, seed=3),
              dict(temperature=0)]
    # starts no other prompt of the module's server shares: on the GPU a request that extends an earlier
    # one's prompt reuses its generated positions, whose K/V the decode step computed (class (b))
    prompts = [ids[2000 + 11 * i:2030 + 19 * i] for i in range(len(fields))]

    def ask(i):
        return stream(client, prompts[i], 12, **fields[i])
    sequential = [ask(i) for i in range(len(fields))]
    together = run_all(ask, len(fields))
    for i, (a, b) in enumerate(zip(sequential, together)):
        assert (b["texts"], b["lps"], b["finish"]) == (a["texts"], a["lps"], a["finish"]), fields[i]


# ---- speculative requests beside plain ones -------------------------------------------------------------

def test_speculative_streams_beside_others_are_plain_greedy(model, backend, local, ids):
    s = start_server(model[0], "--speculate", "lookup", "--max-running", "4", "--step-tokens", "32",
                     backend=backend, cache_dir=model[1])
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = [ids[:200], ids[60:120], ids[300:460], ids[20:30], ids[200:380], ids[500:540]]
        max_tokens = [30, 20, 24, 16, 28, 12]
        got = run_all(lambda i: stream(client, prompts[i], max_tokens[i]), len(prompts))
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            texts, lps, finish = alone(local, p, m)
            assert (got[i]["texts"], got[i]["lps"], got[i]["finish"]) == (texts, lps, finish), f"client {i}"
        assert s.metric("nanoqwen_spec_decode_num_draft_tokens_total") > 0, "nothing was drafted"
        steps = histogram(s, "nanoqwen_step_sequences")
        assert steps["count"] > steps["1.0"], "no step ran two sequences"
    finally:
        s.close()


# ---- a sequence that cannot get pages waits -------------------------------------------------------------

class HeldSteps:
    """The reference's multi-sequence step under the test's control: the engine thread starts a step only
    while fewer than ``allowed`` have started (``allow`` raises it, ``free`` lifts the hold), so what the
    scheduler did between two steps can be read while it waits at the next one (``wait_held``)."""

    def __init__(self, batch, allowed: int):
        self.batch, self.allowed, self.started, self.holding = batch, allowed, 0, False
        self.cv = threading.Condition()

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def step(self, work):
        with self.cv:
            self.holding = True
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: self.started < self.allowed, 120), "a step was held too long"
            self.started, self.holding = self.started + 1, False
        return self.batch.step(work)

    def wait_held(self, started: int) -> None:
        """Until the engine thread waits at the next step after ``started`` steps."""
        with self.cv:
            assert self.cv.wait_for(lambda: self.holding and self.started == started, 60), \
                f"the engine thread never got past {started} steps to the next"

    def allow(self, n: int = 1) -> None:
        with self.cv:
            self.allowed += n
            self.cv.notify_all()

    def free(self) -> None:
        self.allow(1 << 30)


def answer(r) -> tuple[list[str], list[float], str]:
    """(token texts, their logprobs, finish reason) of a non-streamed completion with logprobs 1."""
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["finish_reason"]


def test_a_sequence_short_of_pages_waits_and_others_run(model, backend, local, ids):
    """A pool of 256 tokens (16 pages) holds one 200-position sequence: a second one waits at the head of the
    queue while rows are free (running 1, waiting 1) instead of failing either, then runs once the first
    has ended; both are exactly what they give alone. The steps are held so that the scheduler's admission
    of the second is read while the first still runs."""
    engine, tok, _ = open_local(*model, backend=backend, context=256)   # its KV pool holds `context` tokens
    held = engine.batch = HeldSteps(engine.batch, allowed=1)
    try:
        client = serve_in_process(in_worker(engine, tok, backend))
        big, waiter, got = ids[:100], ids[400:500], {}

        def ask(name, prompt):
            got[name] = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 100,
                                                             "temperature": 0, "logprobs": 1})
        threads = [threading.Thread(target=ask, args=("big", big))]
        threads[0].start()
        held.wait_held(1)   # the first runs: its prompt was read in step 1
        threads.append(threading.Thread(target=ask, args=("waiter", waiter)))
        threads[1].start()
        deadline = time.monotonic() + 60
        while "nanoqwen_queue_depth 1.0" not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the second request never reached the queue"
            time.sleep(0.02)
        held.allow(1)   # one more step, then an admission with the second at the head of the queue
        held.wait_held(2)
        text = client.get("/metrics").text
        assert "nanoqwen_queue_depth 1.0" in text and "nanoqwen_requests_running 1.0" in text, text
        held.free()
        for t in threads:
            t.join(300)
            assert not t.is_alive(), "a request never got its answer"
        assert answer(got["big"]) == alone(local, big, 100)
        assert answer(got["waiter"]) == alone(local, waiter, 100)
    finally:
        held.free()
        engine.close()


# ---- in-process: faults, and an engine without the multi-sequence step ----------------------------------

class FaultyStep:
    """The reference's multi-sequence step, raising once when ``token`` is among a step's rows."""

    def __init__(self, batch, token: int):
        self.batch, self.token, self.fired = batch, token, False

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def step(self, work):
        if not self.fired and any(self.token in rows for _, rows in work):
            self.fired = True
            raise RuntimeError("simulated fault")
        return self.batch.step(work)


def test_a_step_fault_fails_its_sequences_and_the_reference_serves_on(model, local, ids):
    engine, tok, _ = local
    plain = engine.batch
    engine.batch = FaultyStep(plain, 1999)   # no prompt of this test holds it: the marked prompt does
    try:
        client = serve_in_process(lambda: (engine, tok))
        bad = client.post("/v1/completions", json={"prompt": ids[:20] + [1999], "max_tokens": 4, "temperature": 0})
        assert bad.status_code == 500 and "simulated fault" in bad.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        good = client.post("/v1/completions", json={"prompt": ids[:20], "max_tokens": 4, "temperature": 0,
                                                    "logprobs": 1}).json()
        assert good["choices"][0]["logprobs"]["tokens"] == alone(local, ids[:20], 4)[0]
        assert "nanoqwen_kv_pages{state=\"running\"} 0.0" in client.get("/metrics").text
    finally:
        engine.batch = plain


def test_a_grammar_that_cannot_start_fails_its_request_only(local, ids, monkeypatch):
    """A request whose grammar fails as it is admitted (here: its matcher refuses to start) is a 400 of its
    own; a stream running beside it finishes as it does alone, and its sequence's pages go back. The steps
    are held so that the 400 comes while the other still runs."""
    from nanoqwen.runtime.generate import ContextError
    from nanoqwen.serve import grammar

    def refuse(self):
        raise ContextError("the grammar engine cannot use this model's tokenizer: test")
    monkeypatch.setattr(grammar.Constraint, "start", refuse)
    engine, tok, _ = local
    held = engine.batch = HeldSteps(engine.batch, allowed=1)
    try:
        client = serve_in_process(lambda: (engine, tok))
        results = {}
        t = threading.Thread(target=lambda: results.update(run=client.post("/v1/completions", json={
            "prompt": ids[:30], "max_tokens": 40, "temperature": 0, "logprobs": 1})))
        t.start()
        held.wait_held(1)   # the first runs: its prompt was read in step 1
        u = threading.Thread(target=lambda: results.update(bad=client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}})))
        u.start()
        deadline = time.monotonic() + 60
        while "nanoqwen_queue_depth 1.0" not in client.get("/metrics").text:
            assert time.monotonic() < deadline and u.is_alive(), "the second request never reached the queue"
            time.sleep(0.02)
        held.allow(1)   # one more step, then the admission that fails the second
        u.join(60)
        assert not u.is_alive(), "the failed request never got its answer"
        bad = results["bad"]
        assert bad.status_code == 400 and "cannot use this model's tokenizer" in bad.json()["error"]["message"]
        held.wait_held(2)
        assert t.is_alive() and "nanoqwen_requests_running 1.0" in client.get("/metrics").text   # still beside it
        held.free()
        t.join(120)
        assert not t.is_alive(), "the running request never got its answer"
    finally:
        held.free()
        engine.batch = held.batch
    assert results["run"].json()["choices"][0]["logprobs"]["tokens"] == alone(local, ids[:30], 40)[0]
    assert "nanoqwen_kv_pages{state=\"running\"} 0.0" in client.get("/metrics").text


class CountingEngine:
    """A stand-in engine without ``batch``: counts the token streams open at once."""

    def __init__(self):
        from _serve_util import ScriptedEngine
        self.scripted = ScriptedEngine([300, 301, 302], delay_s=0.01)
        self.name, self.dims, self.context = "counting stand-in", self.scripted.dims, self.scripted.context
        self.cached_tokens, self.speculate, self.open, self.most = 0, None, 0, 0

    def pages(self):
        return (1 if self.open else 0), 2, 10

    def generate(self, prompt, max_new_tokens, sampling, logits=False):
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            yield from self.scripted.generate(prompt, max_new_tokens, sampling, logits)
        finally:
            self.open -= 1


def test_an_engine_without_the_step_runs_one_request_at_a_time(local):
    logs, engine = [], CountingEngine()
    client = serve_in_process(lambda: (engine, local[1]), log=logs.append, max_running=8)
    worker = client.worker
    assert worker.max_running == 1 and any("--max-running 8 taken as 1" in m for m in logs)

    def ask(i):
        r = client.post("/v1/completions", json={"prompt": [5 + i], "max_tokens": 20, "temperature": 0})
        return r.json()["usage"]["completion_tokens"]
    assert run_all(ask, 3) == [20, 20, 20]
    assert sorted(p for p, _n, _s in engine.scripted.requests) == [[5], [6], [7]]
    assert engine.most == 1, "two requests ran at once on an engine without the multi-sequence step"
    text = client.get("/metrics").text   # the engine's pages, read after the last request
    assert all(f'nanoqwen_kv_pages{{state="{k}"}} {v}' in text for k, v in (("running", 0.0), ("kept", 2.0),
                                                                            ("free", 8.0)))


def test_the_queue_holds_max_queue_beyond_the_running_rows():
    """--max-running 2 --max-queue 1: two requests run and one waits; a fourth is refused (503, Retry-After),
    before and after the engine thread has taken the two."""
    import asyncio
    from nanoqwen.serve.errors import APIError
    from nanoqwen.serve.metrics import Metrics
    from nanoqwen.serve.jobs import Job
    from nanoqwen.serve.worker import Worker

    async def main():
        w = Worker(lambda: None, Metrics(), max_queue=1, max_running=2, log=lambda m: None)
        w.state = "ready"   # the engine thread is not started: the queue alone is under test
        jobs = [Job([1], 1, Sampling()) for _ in range(4)]
        for j in jobs[:3]:
            w.submit(j)
        for taken in (0, 2):
            if taken:
                assert [w.take(wait=False) for _ in range(2)] == jobs[:2]
                w.set_running(2)
            with pytest.raises(APIError) as e:
                w.submit(jobs[3])
            assert (e.value.status, e.value.code, e.value.headers) == (503, "queue_full", {"Retry-After": "1"})
        w.set_running(1)   # one ended: a row is free again
        w.submit(jobs[3])
    asyncio.run(main())
