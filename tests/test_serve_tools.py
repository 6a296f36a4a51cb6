"""Tool calling on scripted model output (a stand-in engine that answers with given text, the small
test model's tokenizer and chat template, whose tools section is Qwen2.5's): the tools and the history's
calls and results reach the prompt through the template; <tool_call> blocks come back as OpenAI tool_calls,
whole and streamed (through the official `openai` client), one or several, a streamed call's arguments
token by token; an unparsable block or an unknown function comes back as text (streamed: unless it breaks
after its arguments began); bad tool_choice values are 400."""

from __future__ import annotations

import json

import openai
import pytest

from _serve_util import ScriptedEngine, serve_in_process
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
IM_END = 2


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(SMALL_PY_DIR)


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine([IM_END], context=4096)


@pytest.fixture(scope="module")
def client(engine, tok):
    return serve_in_process(lambda: (engine, tok))


@pytest.fixture(scope="module")
def sdk(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def answer(engine, tok, text):
    engine.script = tok.encode(text) + [IM_END]


def prompt_text(engine, tok):
    return tok.decode(engine.requests[-1][0])


def test_tools_reach_the_prompt_through_the_template(client, engine, tok):
    answer(engine, tok, "ok")
    client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    text = prompt_text(engine, tok)
    assert "# Tools" in text and '"name": "get_weather"' in text and "<tools>" in text
    assert text == tok.apply_chat_template(ASK, tools=[WEATHER])
    for extra in ({}, {"tool_choice": "none"}):
        client.post("/v1/chat/completions", json={"messages": ASK} | ({"tools": [WEATHER]} if extra else {}) | extra)
        assert "# Tools" not in prompt_text(engine, tok)


def test_history_keeps_calls_and_results(client, engine, tok):
    answer(engine, tok, "It is 22C.")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    assert r.json()["choices"][0]["message"]["content"] == "It is 22C."
    text = prompt_text(engine, tok)
    assert CALL.replace("<tool_call>", "<|im_start|>assistant\n<tool_call>") in text   # arguments as an object
    assert "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>" in text


def test_a_call_becomes_tool_calls(sdk, engine, tok):
    answer(engine, tok, CALL)
    r = sdk.chat.completions.create(model="anything", messages=ASK, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_parallel_calls_and_parallel_false(sdk, engine, tok):
    answer(engine, tok, CALL + "\n" + CALL.replace("Paris", "Rome").replace("get_weather", "get_time"))
    calls = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME]).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"] and calls[0].id != calls[1].id
    one = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'   # no JSON after its head
UNCLOSED = CALL[:-len("</tool_call>")]


@pytest.mark.parametrize("text", [BROKEN, CALL.replace("get_weather", "launch_rocket"), UNCLOSED,
                                  '<tool_call>\nget_weather(city="Paris")\n</tool_call>'])
def test_an_unparsable_call_comes_back_as_text(sdk, engine, tok, text):
    answer(engine, tok, text)
    c = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0]
    assert c.message.content == text and not c.message.tool_calls and c.finish_reason == "stop"


@pytest.mark.parametrize("text", [CALL.replace("get_weather", "launch_rocket"),
                                  '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
                                  '<tool_call>\n{"name": "get_weather", "arguments": oops}\n</tool_call>'])
def test_a_block_unparsable_from_its_head_streams_as_text(sdk, engine, tok, text):
    answer(engine, tok, text)
    chunks = list(sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("text, sent, rest", [(BROKEN, '{"city": ', "</tool_call>"),
                                              (UNCLOSED, '{"city": "Paris"}', "}\n")])
def test_a_streamed_call_whose_block_breaks_keeps_the_arguments_sent(sdk, engine, tok, text, sent, rest):
    """Sent deltas cannot be taken back: the call stays with its arguments so far, the rest is content."""
    answer(engine, tok, text)
    with sdk.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER]) as stream:
        final = stream.get_final_completion().choices[0]
    [call] = final.message.tool_calls
    assert (call.function.name, call.function.arguments, final.message.content) == ("get_weather", sent, rest)


def test_streamed_arguments_arrive_token_by_token(sdk, engine, tok):
    args = '{"city": "Paris", "days": [1, 2, 3], "units": {"temp": "C", "wind": "km/h"}}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    answer(engine, tok, text)
    whole = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0].message.tool_calls[0]
    assert whole.function.arguments == args   # the model's own JSON text, as streamed
    raw = [tc for ch in sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True)
           for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    first = raw[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather", "")
    assert first.id.startswith("call_") and all(tc.id is None and tc.index == 0 for tc in raw[1:])
    fragments = [tc.function.arguments for tc in raw[1:]]
    # one per token: the tokens that hold the arguments, but the first and last may straddle the head and tail
    assert len(fragments) >= len(tok.encode(args)) - 2, fragments
    assert "".join(fragments) == args
    with sdk.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER]) as stream:
        deltas = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and "".join(deltas) == final.message.tool_calls[0].function.arguments
    assert json.loads(final.message.tool_calls[0].function.arguments) == json.loads(args)


def test_streamed_calls_are_delta_tool_calls(sdk, engine, tok):
    answer(engine, tok, "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = acc["id"] or tc.id
            acc["name"] += tc.function.name or ""
            acc["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Let me check.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("choice, needle", [({"type": "function", "function": {"name": "nope"}}, "'nope'"),
                                            ("sometimes", "tool_choice must be")])
def test_bad_tool_choice_is_400(client, choice, needle):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and needle in r.text, r.text


def test_whole_and_streamed_answers_agree_on_a_mixed_answer(sdk, engine, tok):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": oops}\n</tool_call>'
    answer(engine, tok, CALL + "\n" + bad)
    m = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0].message
    assert [c.function.name for c in m.tool_calls] == ["get_weather"] and m.content == bad
    chunks = list(sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks).strip() == bad
    streamed = "".join(tc.function.arguments or "" for ch in chunks for tc in ch.choices[0].delta.tool_calls or [])
    assert streamed == m.tool_calls[0].function.arguments   # the one call's head and its fragments


def test_developer_is_system_and_an_unknown_role_is_400(client, engine, tok):
    answer(engine, tok, "ok")
    client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "Be terse."}] + ASK})
    assert prompt_text(engine, tok).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "function", "content": "x"}] + ASK})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
