"""The HTTP routes: validate, tokenize, enqueue, and turn the engine thread's events into OpenAI (or
llama-server) responses, streamed as SSE or whole. Nothing here waits on the GPU: the event loop only
awaits the job's event queue, so /health, /metrics and queue refusals answer while a request runs."""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import uuid
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..runtime.sampler import Sampling
from . import choices, errors, limits, llama_compat, offload, prompts
from .context import fit, requested
from .echo import check_prompt_logprobs
from .errors import APIError, parse
from .grammar import Grammars
from .limits import MAX_HEAD_BYTES, MAX_HEADERS
from .sampling import sampling
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, Sampled, TokenizeRequest
from .sse import SSE_HEADERS, frame as _sse
from .tools import ToolUse, template_messages
from .jobs import Done, Failed, Job, PromptLogprobs, Token

OPEN = ("/health", "/metrics")   # answer without the API key (load balancers, Prometheus)


class Guard:
    """ASGI middleware: header count (431), body size limit (413), API key (401), and the request counter by endpoint and
    status. Pure ASGI rather than BaseHTTPMiddleware, so streamed responses and disconnects pass untouched."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv, path = self.server, scope["path"]
        scope.setdefault("state", {})["received"] = time.perf_counter()   # where server-side TTFT starts
        endpoint = path if path in srv.endpoints else "other"
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        seen = [0]

        async def limited_receive():
            message = await receive()
            seen[0] += len(message.get("body", b""))
            if seen[0] > srv.max_body:   # a chunked body without Content-Length
                raise HTTPException(413, _too_large(srv.max_body).message)
            return message
        try:
            if len(scope["headers"]) > MAX_HEADERS or sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEAD_BYTES:
                raise APIError(f"the request has more than {MAX_HEADERS} headers or {MAX_HEAD_BYTES} bytes of them",
                               status=431, code="headers_too_large")
            headers = dict(scope["headers"])
            if srv.api_key and path not in OPEN:
                auth = headers.get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(auth.encode(), f"Bearer {srv.api_key}".encode()):
                    raise APIError("missing or wrong API key (send 'Authorization: Bearer KEY')", status=401,
                                   code="invalid_api_key")
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > srv.max_body:
                raise _too_large(srv.max_body)
            await self.app(scope, limited_receive, counted_send)
        except APIError as e:
            await e.response()(scope, receive, counted_send)
        finally:
            srv.metrics.requests.labels(endpoint, str(status[0])).inc()


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body exceeds the limit of {limit} bytes", status=413, code="body_too_large")


class Server:
    def __init__(self, worker, metrics, model_id: str, api_key: str | None = None, max_body: int = 8 << 20,
                 max_text: int | None = None):
        self.worker, self.metrics, self.model_id = worker, metrics, model_id
        self.api_key, self.max_body, self.created = api_key, max_body, int(time.time())
        self.max_text = max_text   # None: limits.CHARS_PER_TOKEN per token of the context
        self.endpoints: set[str] = set()
        self.grammars: Grammars | None = None   # structured output, made on first use

    # ---- request checks ------------------------------------------------------------------------------

    def ready(self):
        if err := self.worker.unavailable():
            raise err
        return self.worker.engine, self.worker.tokenizer

    def check_openai(self, body: Sampled) -> None:
        """``model`` may name anything: the one served model answers (as llama-server does; editors send
        the name their user typed)."""
        choices.check_n(body.n, self.worker)
        if getattr(body, "best_of", None) not in (None, 1):
            raise APIError("best_of must be 1: the server does not rank samples (n gives several)", param="best_of")

    def check_text(self, engine, size: int, param: str, what: str = "characters") -> None:
        limit = self.max_text if self.max_text is not None else limits.CHARS_PER_TOKEN * engine.context
        limits.check_text(size, limit, param, what)

    def grammar_engine(self) -> Grammars:
        w = self.worker
        if self.grammars is None:
            self.grammars = Grammars(w.tokenizer, w.engine.dims.vocab, w.stop_ids)
        return self.grammars

    def sampling(self, body, forced=None) -> Sampling:
        w = self.worker
        return sampling(body, w.tokenizer, w.engine.dims.vocab, w.stop_ids, self.grammar_engine(), forced)

    # ---- the engine's events -------------------------------------------------------------------------

    def submit(self, request: Request, job: Job) -> Job:
        limits.check_stops(job.stops)
        job.received = request.state.received
        self.worker.submit(job)
        return job

    async def events(self, job: Job, request: Request | None = None):
        """The job's events up to Done; a Failed raises. Leaving early (a disconnect cancels the streaming
        task; ``request`` is watched when the response is not streamed) cancels the generation, which the
        engine thread sees at its next token."""
        finished = False
        watch = asyncio.create_task(choices.disconnect(request, job)) if request is not None else None
        try:
            while True:
                ev = await job.events.get()
                if ev is None:   # the client left
                    return
                if isinstance(ev, Failed):
                    finished = True
                    raise ev.error
                yield ev
                if isinstance(ev, Done):
                    finished = True
                    return
        finally:
            if watch is not None:
                watch.cancel()
            if not finished:
                self.worker.cancel(job)

    async def collect(self, job: Job, request: Request | None = None) -> tuple[str, list, Done | None]:
        """(text, logprobs, Done or None if the client left); echo's prompt logprobs come first in logprobs."""
        text, logprobs, done = [], [], None
        async with aclosing(self.events(job, request)) as events:
            async for ev in events:
                if isinstance(ev, PromptLogprobs):
                    logprobs[:0] = ev.items
                    continue
                text.append(ev.text)
                if isinstance(ev, Token) and ev.logprobs:
                    logprobs.append(ev.logprobs)
                if isinstance(ev, Done):
                    done = ev
        return "".join(text), logprobs, done


def _completion_logprobs(items: list, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, lp, top in items:
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else dict(top))   # None: echo's first prompt token
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _chat_logprobs(items: list) -> dict:
    def entry(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [entry(text, lp) | {"top_logprobs": [entry(t, p) for t, p in top]}
                        for text, lp, top in items]}


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="nanoqwen", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.add_middleware(Guard, server=server)
    srv = server

    @app.get("/health")
    async def health():
        if err := srv.worker.unavailable():
            raise err
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        engine = srv.worker.engine
        return {"object": "list", "data": [{"id": srv.model_id, "object": "model", "created": srv.created,
                                            "owned_by": "nanoqwen",
                                            "context_length": engine.context if engine else None,
                                            "max_model_len": engine.context if engine else None}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest)
        engine, tok = srv.ready()
        srv.check_text(engine, len(body.content), "content")

        def tokens() -> bytes:   # serialized off the loop too: a long text's pieces are megabytes of JSON
            ids = tok.encode(body.content)
            out = [{"id": i, "piece": p} for i, p in zip(ids, tok.pieces(ids))] if body.with_pieces else ids
            return ('{"tokens": ' + offload.json_list(out) + "}").encode()
        return Response(await offload.run(tokens), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest)
        engine, tok = srv.ready()
        srv.check_text(engine, len(body.tokens), "tokens", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < engine.dims.vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {engine.dims.vocab})", param="tokens")
        return {"content": await offload.run(tok.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        srv.check_openai(body)
        engine, tok = srv.ready()
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"one prompt per request (got {len(p)}): send several requests at once instead",
                               param="prompt")
            p = p[0]
        if isinstance(p, str):
            srv.check_text(engine, len(p) + len(body.suffix or ""), "prompt")
        if body.suffix is not None:
            if not isinstance(p, str):
                raise APIError("suffix (fill in the middle) needs a text prompt", param="suffix")
            ids = await offload.run(prompts.fim, tok, p, body.suffix)
        else:
            ids = await offload.run(tok.encode, p) if isinstance(p, str) else list(p)
        scored = body.echo and body.logprobs is not None   # the prompt's logprobs too
        if scored:
            check_prompt_logprobs(engine, body.suffix)
        n = fit(engine, ids, *requested(body, "max_tokens", "n_predict"))
        echo = (p if isinstance(p, str) else tok.decode(p)) if body.echo else ""
        sampled = srv.sampling(body)
        jobs = choices.submit(srv, request, body.n, lambda i: Job(
            ids, n, choices.seeded(sampled, i), body.stops, body.logprobs,
            prompt_logprobs=body.logprobs if scored else None))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def obj(*choice_list):
            return {"id": cid, "object": "text_completion", "created": created, "model": srv.model_id,
                    "choices": list(choice_list)}

        def one(text, finish=None, logprobs=None, index=0):
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def logprobs(lps):
            head = len(ids) if scored else 0   # the prompt's items (their offsets count from the echo's start)
            return _joined(_completion_logprobs(lps[:head], 0), _completion_logprobs(lps[head:], len(echo)))

        if not body.stream:
            results = await choices.collect(srv, jobs, request)
            if results is None:
                return Response(status_code=499)
            return obj(*[one(echo + text, done.finish_reason, logprobs(lps) if body.logprobs is not None else None, i)
                         for i, (text, lps, done) in enumerate(results)]) | \
                {"usage": choices.usage(len(ids), [done for _, _, done in results])}

        def choice(i):
            offset = [len(echo)]

            def chunk(text, lp):
                lps = None
                if lp is not None:
                    lps = _completion_logprobs([lp], offset[0])
                    offset[0] += len(lp[0])
                return obj(one(text, logprobs=lps, index=i))

            def final(done):
                tail = [obj(one(done.text, index=i))] if done.text else []
                return tail + [obj(one("", done.finish_reason, index=i))]
            return chunk, final, lambda items: obj(one(echo, logprobs=_completion_logprobs(items, 0), index=i))

        def usage(dones):
            return obj() | {"usage": choices.usage(len(ids), dones)} if body.include_usage else None
        def first(i):   # the echo, unless it waits for its logprobs (the prompt callback above)
            return _sse(obj(one(echo, index=i))) if echo and not scored else b""
        return StreamingResponse(choices.stream(srv, jobs, first, [choice(i) for i in range(body.n)], usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request, ChatRequest)
        srv.check_openai(body)
        engine, tok = srv.ready()
        srv.check_text(engine, sum(len(m.text()) for m in body.messages), "messages")
        tools = ToolUse(body.tools, body.tool_choice, body.parallel_tool_calls, tok.chat_template)
        messages = template_messages(body.messages)
        try:
            ids = await offload.run(functools.partial(tok.encode_chat, messages, **tools.template_kwargs()))
        except Exception as e:  # noqa: BLE001 - the model's own template rejects the conversation
            raise APIError(f"the chat template rejects these messages: {e}", param="messages") from None
        n = fit(engine, ids, *requested(body, "max_completion_tokens", "max_tokens", "n_predict"))
        top = (body.top_logprobs or 0) if body.logprobs else None
        forced = tools.constraint(srv.grammar_engine())
        sampled = srv.sampling(body, forced)
        jobs = choices.submit(srv, request, body.n, lambda i: Job(ids, n, choices.seeded(sampled, i), body.stops, top))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def obj(kind, choice, index=0):
            return {"id": cid, "object": kind, "created": created, "model": srv.model_id,
                    "choices": [{"index": index, "logprobs": None, "finish_reason": None} | choice]}

        if not body.stream:
            results = await choices.collect(srv, jobs, request)
            if results is None:
                return Response(status_code=499)

            def whole(i, text, lps, done):
                content, calls = tools.parse(text)
                return obj("chat.completion", {"message": {"role": "assistant", "content": content} |
                                                          ({"tool_calls": calls} if calls else {}),
                                               "logprobs": _chat_logprobs(lps) if body.logprobs else None,
                                               "finish_reason": "tool_calls" if calls else done.finish_reason},
                           i)["choices"][0]
            return obj("chat.completion", {}) | {"choices": [whole(i, *r) for i, r in enumerate(results)],
                                                 "usage": choices.usage(len(ids), [done for _, _, done in results])}

        def choice(i):
            calls = tools.stream() if tools.active else None   # tool-call blocks come out as delta.tool_calls

            def chunk(text, lp):
                lps = {"logprobs": _chat_logprobs([lp]) if lp else None}
                if calls is None:
                    return obj("chat.completion.chunk", {"delta": {"content": text}} | lps, i)
                deltas = calls.push(text) or ([{}] if lp else [])
                return [obj("chat.completion.chunk", {"delta": d} | (lps if k == 0 else {}), i)
                        for k, d in enumerate(deltas)]

            def final(done):
                tail = calls.push(done.text) + calls.flush() if calls else [{"content": done.text}] if done.text else []
                finish = "tool_calls" if calls and calls.calls else done.finish_reason
                return [obj("chat.completion.chunk", {"delta": d}, i) for d in tail] + \
                       [obj("chat.completion.chunk", {"delta": {}, "finish_reason": finish}, i)]
            return chunk, final, None

        def usage(dones):
            return {**obj("chat.completion.chunk", {}), "choices": [], "usage": choices.usage(len(ids), dones)} \
                if body.include_usage else None

        def first(i):
            return _sse(obj("chat.completion.chunk", {"delta": {"role": "assistant", "content": ""}}, i))
        return StreamingResponse(choices.stream(srv, jobs, first, [choice(i) for i in range(body.n)], usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    llama_compat.install(app, srv)
    srv.endpoints = {r.path for r in app.routes}
    return app
