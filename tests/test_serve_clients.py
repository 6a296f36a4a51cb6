"""The request bodies that editor and agent clients send, written from their source (each names the
client and file read), against a real `nanoqwen serve` process (reference backend, the small test model
with the FIM tokens, --model-name): each is answered with the fields that client reads. The official
`openai` SDK's tool-call round trip with tool_choice "required" and its structured-output parse() run on
the real model. Any field no client here needs, and any unsupported value, is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from _serve_util import fim_model_dir, server as start_server

SYSTEM = "You are a coding assistant."
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                   "required": ["path"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    (root / "cache").mkdir()
    s = start_server(fim_model_dir(root / "small-py-fim"), "--model-name", "qwen-test", "--context", "512",
                     cache_dir=root / "cache")
    yield s
    s.close()


def post(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, (path, r.text)
    return r


def events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_models_and_props_name_the_model_and_context(server):
    [m] = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert m["id"] == "qwen-test" and m["context_length"] == 512
    assert httpx.get(f"{server.url}/props").json()["default_generation_settings"]["n_ctx"] == 512


def test_continue_agent_mode(server):
    # Continue, core/llm/llms/OpenAI.ts (_convertArgs) with agent-mode tools: the name the user typed,
    # max_tokens 4096 whatever the model (clamped here), tools, streamed
    body = {"model": "qwen2.5-coder:7b", "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": "Open main.py"}],
            "max_tokens": 4096, "temperature": 0, "stream": True, "tools": [READ_FILE]}
    chunks = events(post(server, "/v1/chat/completions", body))
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_continue_llama_cpp_provider(server):
    # Continue, core/llm/llms/LlamaCpp.ts (_convertArgs, _streamComplete): POST /completion
    body = {"prompt": "def add(a, b):", "stream": True, "n_predict": 8, "frequency_penalty": 0.1,
            "presence_penalty": 0.1, "min_p": 0.05, "stop": ["\n\n"], "top_k": 40, "top_p": 0.95, "temperature": 0.2}
    objs = events(post(server, "/completion", body))
    assert objs[-1]["stop"] is True and all("content" in o for o in objs)


def test_tabby_openai_and_llama_cpp_completion(server):
    # Tabby, crates/http-api-bindings/src/completion/openai.rs (CompletionRequest): FIM through suffix
    body = {"model": "qwen", "prompt": "def add(a, b):\n    ", "suffix": "\n", "max_tokens": 8, "temperature": 0.1,
            "stream": True, "presence_penalty": 0.5}
    assert events(post(server, "/v1/completions", body))[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # Tabby, crates/http-api-bindings/src/completion/llama.rs (CompletionRequest): POST /completion
    body = {"seed": 2 ** 63, "prompt": "def add(a, b):", "n_predict": 8, "temperature": 0.1, "stream": True,
            "penalty_last_n": 0, "presence_penalty": 0.5}
    assert events(post(server, "/completion", body))[-1]["stop"] is True


def test_llama_vscode_infill(server):
    # llama.vscode, src/llama-server.ts (createRequestPayload, defaultRequestParams): the prefetch, then the
    # completion with n_cmpl 3; src/statusbar.ts reads generation_settings.n_ctx of the reply
    chunks = [{"text": "def helper():\n    return 1\n", "time": 1700000000, "filename": "util.py"}]
    common = {"id_slot": 0, "input_prefix": "def main():\n    ", "input_suffix": "\n", "input_extra": chunks,
              "prompt": "x = ", "cache_prompt": True, "t_max_prompt_ms": 500}
    warm = post(server, "/infill", common | {"n_predict": 0, "samplers": [], "t_max_predict_ms": 1}).json()
    assert warm["content"] == "" and warm["generation_settings"]["n_ctx"] == 512
    body = common | {"n_predict": 16, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
                     "samplers": ["top_k", "top_p", "infill"], "n_indent": 4, "t_max_predict_ms": 2500,
                     "model": "qwen2.5-coder-7b"}
    replies = post(server, "/infill", body).json()
    assert len(replies) == 3 and all(isinstance(r["content"], str) and r["generation_settings"]["n_ctx"] == 512
                                     for r in replies)


def test_llama_vim_infill(server):
    # llama.vim, autoload/llama.vim (llama#fim warm-up and request): response_fields as flat "a/b" keys
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": [], "prompt": "", "n_predict": 0,
            "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}
    assert post(server, "/infill", warm).json() == {}
    fields = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
    body = {"id_slot": 0, "input_prefix": "def f(x):\n", "input_suffix": "\n", "input_extra": [{"text": "y = 1\n",
            "filename": "a.py"}], "prompt": "    ", "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40,
            "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": fields}
    assert set(post(server, "/infill", body).json()) == set(fields)


def test_aider_litellm_stream(server):
    # Aider, aider/models.py (send_completion -> litellm.completion, openai-compatible): streamed chat
    body = {"model": "openai/qwen-test", "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": "hi"}],
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = events(post(server, "/v1/chat/completions", body))
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("client", ["cline", "roo"])
def test_cline_and_roo_native_tools(server, client):
    # Cline, src/core/api/providers/openai.ts, and Roo Code, src/api/providers/openai.ts (createMessage):
    # text-part content, streamed with usage, native tools with tool_choice "auto" (Roo: no parallel calls);
    # the history carries a tool call and its result
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": [{"type": "text", "text": "<task>Fix main.py</task>"}]},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "read_file", "arguments": '{"path": "main.py"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"}]
    body = {"model": "qwen-test", "messages": history, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "tools": [READ_FILE], "tool_choice": "auto"}
    if client == "roo":
        body |= {"parallel_tool_calls": False, "max_completion_tokens": 64}
    chunks = events(post(server, "/v1/chat/completions", body))
    assert chunks[-1]["usage"]["prompt_tokens"] > 0


def test_cline_and_roo_context_overflow_wording(server):
    # Cline and Roo match "maximum context length" in the error to truncate their history
    body = {"model": "qwen-test", "messages": [{"role": "user", "content": "x " * 600}], "stream": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in err["message"]


def test_openai_sdk_tool_round_trip(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Show me main.py"}]
    r = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[READ_FILE],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "read_file"
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert set(args) == {"path"} and isinstance(args["path"], str)
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "print('hi')"}]
    r = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[READ_FILE], max_tokens=16)
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_sdk_parse_structured_output(server):
    class Point(pydantic.BaseModel):
        x: int
        y: int
        label: str = pydantic.Field(max_length=8)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # greedy: at the default temperature (1, no seed) each run sampled anew, and an integer's digits could run
    # past max_tokens (a CI failure); greedy writes {"x": 1, "y": 2, "label": "my"}, ~20 tokens
    r = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "A point"}],
                                      response_format=Point, max_tokens=80, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Point)


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", {"mirostat": 2}),
                                         ("/v1/chat/completions", {"functions": []}),
                                         ("/v1/completions", {"typical_p": 0.5}),
                                         ("/completion", {"dry_multiplier": 0.8}),
                                         ("/infill", {"ignore_eos": True})])
def test_unsupported_fields_are_400_naming_them(server, path, field):
    body = {"messages": [{"role": "user", "content": "x"}], "prompt": "x", "input_prefix": "x"}
    body = {k: v for k, v in body.items() if (k == "messages") == (path == "/v1/chat/completions")
            and (k != "input_prefix" or path == "/infill")}
    r = httpx.post(f"{server.url}{path}", json=body | field, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(field)), r.text
