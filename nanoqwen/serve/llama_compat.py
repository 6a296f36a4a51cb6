"""llama-server's own endpoints, for the clients that speak them (llama.vim, llama.vscode, Continue's and
Tabby's llama.cpp providers): /infill and /completion (one result object per request, or a list with
``n_cmpl`` > 1; streamed as one object per token, the last with ``stop: true``, no [DONE]), /props and
/apply-template. Field names and response fields are llama-server's; its sampling fields are honoured
through serve/sampling.py, n_indent and t_max_predict_ms through serve/cutoffs.py, n_probs as
completion_probabilities, response_fields as its flat "a/b" keys. Greedy unless told otherwise: the
same buffer gives the same completion."""

from __future__ import annotations

from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from . import offload, prompts
from .context import fit
from .cutoffs import Cutoff
from .errors import APIError, parse
from .fields import response_fields
from .sampling import SamplingFields
from .schemas import ExtraFile, Message
from .sse import SSE_HEADERS, frame
from .tools import Tool, ToolUse, template_messages
from .jobs import Done, Job, Token

FIM_TOKENS = {"prefix": prompts.FIM_PREFIX, "suffix": prompts.FIM_SUFFIX, "middle": prompts.FIM_MIDDLE,
              "pad": "<|fim_pad|>", "repo": prompts.REPO_NAME, "sep": prompts.FILE_SEP}


class NativeFields(SamplingFields):
    """The fields /completion and /infill share (llama-server's names; greedy by default)."""
    model: str | None = None   # any name: the one served model answers
    n_predict: int = Field(-1, ge=-1)   # -1: until the context is full; 0: prefill only (a cache warm-up)
    stream: bool = False
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 64)   # numpy's generators take non-negative seeds
    stop: list[str] = []
    n_probs: int = Field(0, ge=0, le=20)
    n_cmpl: int = Field(1, ge=1, le=8)      # completions of one prompt, generated one after another
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)
    response_fields: list[str] = []
    ignore_eos: bool = False
    lora: list | None = None


class InfillRequest(NativeFields):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = []
    prompt: str = ""


class NativeCompletionRequest(NativeFields):
    prompt: str | list[int | str]


class ApplyTemplateRequest(BaseModel):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None


def _refuse(body: NativeFields) -> None:
    if body.ignore_eos:
        raise APIError("ignore_eos is not supported: generation always ends at the model's end tokens",
                       param="ignore_eos")
    if body.lora:
        raise APIError("lora adapters are not supported", param="lora")
    if body.stream and body.n_cmpl > 1:
        raise APIError("n_cmpl > 1 is not streamed: send stream false", param="n_cmpl")


def generation_settings(srv, engine, body: NativeFields | None = None) -> dict:
    """llama-server's generation_settings (with n_ctx, which llama.vscode reads from every reply)."""
    b = body or NativeFields()
    return {"n_ctx": engine.context, "model": srv.model_id, "n_predict": b.n_predict, "temperature": b.temperature,
            "top_k": b.top_k, "top_p": b.top_p, "min_p": b.min_p, "seed": b.seed, "stop": b.stop,
            "presence_penalty": b.presence_penalty, "frequency_penalty": b.frequency_penalty,
            "repeat_penalty": b.repeat_penalty or b.repetition_penalty or 1.0, "repeat_last_n": b.repeat_last_n,
            "n_probs": b.n_probs, "n_indent": b.n_indent, "t_max_predict_ms": b.t_max_predict_ms,
            "samplers": b.samplers, "stream": b.stream}


def _probabilities(item) -> dict:
    text, lp, top = item
    return {"token": text, "logprob": lp, "bytes": list(text.encode()),
            "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in top]}


async def run(srv, request: Request, body: NativeFields, engine, ids: list[int]):
    """One /infill or /completion request over ``ids``: the whole reply (a list with n_cmpl > 1) or
    its SSE stream."""
    _refuse(body)
    n = fit(engine, ids, None if body.n_predict < 0 else body.n_predict, "n_predict")
    settings = generation_settings(srv, engine, body)

    def job(i: int) -> Job:
        seeded = body.model_copy(update={"seed": None if body.seed is None else (body.seed + i) % (1 << 64)})
        return srv.submit(request, Job(ids, n, srv.sampling(seeded), body.stop, body.n_probs or None,
                                       Cutoff(body.n_indent, body.t_max_predict_ms)))

    def final(done: Done, content: str, probs: list, index: int = 0) -> dict:
        prompt_n, gen_n = len(ids) - done.cached_tokens, done.completion_tokens
        obj = {"index": index, "content": content, "tokens": [], "id_slot": 0, "stop": True,
               "model": srv.model_id, "tokens_predicted": gen_n, "tokens_evaluated": len(ids),
               "generation_settings": settings, "prompt": "", "has_new_line": "\n" in content,
               "truncated": False, "tokens_cached": done.cached_tokens,
               "stop_type": "word" if done.stop_word else ("limit" if done.finish_reason == "length" else "eos"),
               "stopping_word": done.stop_word or "",
               "timings": {"prompt_n": prompt_n, "prompt_ms": 1e3 * done.prompt_s,
                           "prompt_per_token_ms": 1e3 * done.prompt_s / max(prompt_n, 1),
                           "prompt_per_second": prompt_n / done.prompt_s if done.prompt_s else 0.0,
                           "predicted_n": gen_n, "predicted_ms": 1e3 * done.decode_s,
                           "predicted_per_token_ms": 1e3 * done.decode_s / max(gen_n - 1, 1),
                           "predicted_per_second": (gen_n - 1) / done.decode_s if done.decode_s else 0.0}}
        if body.n_probs:
            obj["completion_probabilities"] = [_probabilities(p) for p in probs]
        return response_fields(obj, body.response_fields)

    if not body.stream:
        out = []
        for i in range(body.n_cmpl):   # batch 1: one after another (the prompt is reused from the cache)
            text, probs, done = await srv.collect(job(i), request)
            if done is None:
                return Response(status_code=499)
            out.append(final(done, text, probs, i))
        return out[0] if body.n_cmpl == 1 else out

    streaming = job(0)

    async def sse():   # llama-server's stream: one object per token, the last with stop = true, no [DONE]
        try:
            async with aclosing(srv.events(streaming)) as events:
                async for ev in events:
                    if isinstance(ev, Token):
                        if ev.text or ev.logprobs:
                            obj = {"index": 0, "content": ev.text, "stop": False, "tokens": [ev.token_id]}
                            if ev.logprobs:
                                obj["completion_probabilities"] = [_probabilities(ev.logprobs)]
                            yield frame(obj)
                    else:
                        yield frame(final(ev, ev.text, []))
        except APIError as e:
            yield frame(e.body())
    return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)


def install(app, srv) -> None:
    @app.post("/infill")
    async def infill(request: Request):
        body = await parse(request, InfillRequest)
        engine, tok = srv.ready()
        srv.check_text(engine, sum(len(f.filename) + len(f.text) for f in body.input_extra) + len(body.input_prefix)
                       + len(body.prompt) + len(body.input_suffix), "input_extra" if body.input_extra else "input_prefix")
        ids = await offload.run(prompts.repo_fim, tok, [(f.filename, f.text) for f in body.input_extra],
                                body.input_prefix + body.prompt, body.input_suffix)
        return await run(srv, request, body, engine, ids)

    async def completion(request: Request):
        body = await parse(request, NativeCompletionRequest)
        engine, tok = srv.ready()
        parts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        srv.check_text(engine, sum(len(p) if isinstance(p, str) else 1 for p in parts), "prompt")

        def encode() -> list[int]:   # text parts are tokenized, ids taken as they are (llama-server's mixed form)
            return [i for p in parts for i in (tok.encode(p) if isinstance(p, str) else [p])]
        return await run(srv, request, body, engine, await offload.run(encode))
    for path in ("/completion", "/completions"):   # llama-server answers on both
        app.post(path)(completion)

    @app.api_route("/props", methods=["GET"])
    async def props():
        engine, tok = srv.ready()
        return {"model": srv.model_id, "model_path": srv.model_id, "n_ctx": engine.context, "total_slots": 1,
                "chat_template": tok.chat_template or "", "modalities": {"vision": False, "audio": False},
                "bos_token": tok.special_tokens.get("bos_token") or "",
                "eos_token": tok.special_tokens.get("eos_token") or "",
                "fim_tokens": {k: t for k, t in FIM_TOKENS.items() if tok.token_to_id(t) is not None},
                "default_generation_settings": {"n_ctx": engine.context, "params": generation_settings(srv, engine)},
                "build_info": f"nanoqwen {engine.name}"}

    @app.post("/apply-template")
    async def apply_template(request: Request):
        body = await parse(request, ApplyTemplateRequest)
        _engine, tok = srv.ready()
        tools = ToolUse(body.tools, None, None, tok.chat_template)
        try:
            return {"prompt": tok.apply_chat_template(template_messages(body.messages), **tools.template_kwargs())}
        except Exception as e:  # noqa: BLE001 - the model's own template rejects the conversation
            raise APIError(f"the chat template rejects these messages: {e}", param="messages") from None
