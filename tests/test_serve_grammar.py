"""Structured output on the real small model (reference backend, in-process app): 50 json_schema (strict)
answers that parse and validate against their schema, json_object answers that parse, llama-server's
json_schema and GBNF grammar fields, tool_choice required / named producing arguments that follow the
function's schema; bad schemas and two grammars on one answer are 400; a request without a grammar stays
on the greedy path (stand-in engine records its Sampling)."""

from __future__ import annotations

import json

import pytest

from _serve_util import ScriptedEngine, serve_in_process
from nanoqwen import tokenizer
from nanoqwen.backends import ReferenceEngine
from nanoqwen.modelcache import resolve
from nanoqwen.schema_check import valid
from nanoqwen.testmodels import SMALL_PY_DIR

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "dev", "ops"]},
                                  "maxItems": 3},
                         "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                         "active": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 12}}}}}


def test_the_validator_refuses():   # the check below is only as good as this one
    good = {"name": "a", "age": 3, "tags": ["dev"], "address": {"city": "x", "zip": "12345"}}
    assert valid(good, PERSON)
    for bad in ({**good, "age": 121}, {**good, "age": True}, {**good, "tags": ["boss"]}, {**good, "x": 1},
                {**good, "address": {"zip": "12345"}}, {**good, "address": {"city": "x", "zip": "1234"}},
                {k: v for k, v in good.items() if k != "name"}, {**good, "name": "n" * 13}):
        assert not valid(bad, PERSON), bad
    with pytest.raises(ValueError, match="minLength"):   # a keyword it does not check is refused, not skipped
        valid("x", {"type": "string", "minLength": 2})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("grammar")))
        path = resolve(SMALL_PY_DIR, log=lambda m: None)
    return serve_in_process(lambda: (ReferenceEngine(path, 1024), tokenizer.load(path)))


def chat(client, content, **fields):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                  "max_tokens": 300} | fields)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.slow
def test_fifty_json_schema_answers_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i in range(50):
        sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}   # never an unseeded sample
        c = chat(client, f"Describe user number {i} as JSON.", response_format=fmt, **sampled)
        assert c["finish_reason"] == "stop", c
        assert valid(json.loads(c["message"]["content"]), PERSON), c["message"]["content"]


def test_json_object_answers_parse(client):
    for i in range(5):
        c = chat(client, f"Config {i} as JSON", response_format={"type": "json_object"}, temperature=1.0, seed=i)
        assert c["finish_reason"] == "stop" and isinstance(json.loads(c["message"]["content"]), dict), c


def test_llama_server_json_schema_and_gbnf_on_completions(client):
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 100, "temperature": 0,
                                             "json_schema": {"type": "array", "items": {"type": "integer"},
                                                             "maxItems": 4}}).json()
    assert all(isinstance(v, int) for v in json.loads(r["choices"][0]["text"]))
    r = client.post("/v1/completions", json={"prompt": "answer: ", "max_tokens": 20,
                                             "grammar": 'root ::= ("yes" | "no") "."'}).json()
    assert r["choices"][0]["text"] in ("yes.", "no.") and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_follow_the_schema(client, choice):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for i in range(3):   # one call: the small model would repeat parallel calls until max_tokens
        c = chat(client, f"What about city {i}?", tools=list(tools.values()), tool_choice=choice,
                 parallel_tool_calls=False, temperature=1.0, seed=i)
        assert c["finish_reason"] == "tool_calls", c
        [call] = c["message"]["tool_calls"]
        fn = call["function"]
        if isinstance(choice, dict):
            assert fn["name"] == "get_time"
        assert valid(json.loads(fn["arguments"]), tools[fn["name"]]["function"]["parameters"]), fn


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format"),
])
def test_bad_grammars_are_400(client, fields, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]} | fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_without_a_grammar_the_greedy_path_stays():
    engine = ScriptedEngine([300])
    c = serve_in_process(lambda: (engine, tokenizer.Tokenizer(SMALL_PY_DIR)))
    for fields, greedy in (({}, True), ({"response_format": {"type": "text"}}, True),
                           ({"response_format": {"type": "json_object"}}, False)):
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                             "temperature": 0} | fields)
        assert engine.requests[-1][2].greedy is greedy, fields


def test_a_grammar_with_no_way_on_fails_the_request_not_the_engine():
    """A matcher in an error state (a refused token here; llguidance's parser limits in practice) is a
    request error (ContextError, a 400 in the worker), never an engine fault."""
    import numpy as np
    from nanoqwen.runtime.generate import ContextError
    from nanoqwen.serve.grammar import Grammars
    tok = tokenizer.Tokenizer(SMALL_PY_DIR)
    grammars = Grammars(tok, 2048, frozenset({2}))
    m = grammars.gbnf('root ::= "a"', "grammar").start()
    z = np.zeros(2048)
    m.mask(z)
    m.accept(int(np.argmax(z)))
    z = np.zeros(2048)
    m.mask(z)
    assert np.flatnonzero(np.isfinite(z)).tolist() == [2]
    m = grammars.gbnf('root ::= "a"', "grammar").start()
    with pytest.raises(ContextError, match="refused token"):
        m.accept(tok.encode("b")[0])
    with pytest.raises(ContextError, match="the grammar failed"):
        m.mask(np.zeros(2048))


def test_a_tokenizer_the_grammar_engine_cannot_take_fails_the_request_not_the_engine(tmp_path):
    """bench/serve.py's word-level stand-in has no byte-level decoder: llguidance refuses it, and a
    response_format request on such a server is a 400 (ContextError), where it used to end a GPU engine."""
    from nanoqwen.bench.serve import word_tokenizer
    from nanoqwen.runtime.generate import ContextError
    from nanoqwen.serve.grammar import Grammars
    tok = tokenizer.Tokenizer(word_tokenizer(64, tmp_path))
    constraint = Grammars(tok, 64, frozenset()).json_schema({"type": "object"}, "response_format")
    with pytest.raises(ContextError, match="cannot use this model's tokenizer"):
        constraint.start()
