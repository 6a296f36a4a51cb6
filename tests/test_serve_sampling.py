"""Each sampling field's measurable effect on the reference backend (the small test model, in-process
app), through the host sampling path: a +100 logit_bias forces its token, -100 on the greedy token changes
the answer, each penalty breaks a repetitive greedy loop, top_k=1 and min_p=1 draw the greedy answer,
n_predict bounds every endpoint, `samplers` is honoured or refused. A greedy request without such
fields keeps the device argmax path (Sampling.greedy), checked on a stand-in engine."""

from __future__ import annotations

import pytest

from _serve_util import ScriptedEngine, serve_in_process
from nanoqwen import tokenizer
from nanoqwen.backends import ReferenceEngine
from nanoqwen.modelcache import resolve
from nanoqwen.testmodels import SMALL_PY_DIR

LOOP = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, "   # greedy answer: "3, 3, 3, ..." (3 distinct tokens in 32)
CODE = "def f():\n    return 1\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("sampling")))
        path = resolve(SMALL_PY_DIR, log=lambda m: None)
    return ReferenceEngine(path, 512), tokenizer.load(path)


@pytest.fixture(scope="module")
def client(model):
    return serve_in_process(lambda: model)


def complete(client, prompt, **fields):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32, "temperature": 0} | fields)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_plus_100_logit_bias_forces_its_token(client, model):
    _engine, tok = model
    [banana] = tok.encode("banana")[:1]
    piece = tok.decode([banana])
    for temperature in (0, 1.0):
        text = complete(client, CODE, max_tokens=5, temperature=temperature, logit_bias={str(banana): 100})
        assert text == piece * 5, text
    # llama-server's form: [[id, bias]]
    assert complete(client, CODE, max_tokens=3, logit_bias=[[banana, 100]]) == piece * 3


def test_minus_100_on_the_greedy_token_changes_the_answer(client, model):
    _engine, tok = model
    plain = complete(client, CODE, max_tokens=8)
    first = tok.encode(plain)[0]
    biased = complete(client, CODE, max_tokens=8, logit_bias={str(first): -100})
    assert biased != plain and not biased.startswith(tok.decode([first])), (plain, biased)
    never = complete(client, CODE, max_tokens=8, logit_bias=[[first, False]])   # llama-server's "never"
    assert not never.startswith(tok.decode([first]))


@pytest.mark.parametrize("field", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                   {"repetition_penalty": 1.5}, {"repeat_penalty": 1.5}])
def test_penalties_break_a_repetitive_greedy_loop(client, model, field):
    _engine, tok = model
    plain = complete(client, LOOP)
    assert len(set(tok.encode(plain))) <= 3, plain
    penalized = complete(client, LOOP, **field)
    assert len(set(tok.encode(penalized))) > 6, penalized


def test_repeat_last_n_zero_turns_the_repetition_penalty_off(client):
    assert complete(client, LOOP, repeat_penalty=1.5, repeat_last_n=0) == complete(client, LOOP)


@pytest.mark.parametrize("field", [{"top_k": 1}, {"min_p": 1.0}])
def test_truncation_to_one_token_draws_the_greedy_answer(client, field):
    greedy = complete(client, CODE)
    for seed in range(3):
        assert complete(client, CODE, temperature=1.5, seed=seed, **field) == greedy


def test_top_k_truncates_and_seed_reproduces(client):
    a = complete(client, CODE, temperature=1.5, seed=7, top_k=5)
    assert a == complete(client, CODE, temperature=1.5, seed=7, top_k=5)
    draws = {complete(client, CODE, temperature=1.5, seed=s, max_tokens=4) for s in range(4)}
    assert len(draws) > 1   # without truncation the draws differ


def test_n_predict_bounds_every_endpoint(client):
    r = client.post("/v1/completions", json={"prompt": CODE, "n_predict": 3, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 3
    bias = {"logit_bias": {"0": -100, "2": -100}}   # no end-of-text: the length is n_predict's
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n_predict": 3,
                                                   **bias}).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    r = client.post("/infill", json={"input_prefix": "def f(", "n_predict": 2}).json()
    assert r["tokens_predicted"] <= 2


def test_samplers_chain_is_honoured_or_refused(client):
    greedy = complete(client, CODE)
    # llama.cpp's chain: only the named steps; no "temperature" step draws at temperature 1
    assert complete(client, CODE, samplers=["top_k"], top_k=1, seed=3) == greedy
    assert complete(client, CODE, samplers=["top_k", "temperature"], top_k=1, temperature=0.7, seed=3) == greedy
    r = client.post("/infill", json={"input_prefix": "def f(", "top_k": 40, "top_p": 0.9, "n_predict": 8,
                                     "samplers": ["top_k", "top_p", "infill"]})   # llama.vim's chain
    assert r.status_code == 200, r.text
    for bad, needle in ((["dry"], "'dry'"), (["infill"], "top_k")):
        r = client.post("/v1/completions", json={"prompt": CODE, "samplers": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "samplers" and needle in r.text, r.text


@pytest.mark.parametrize("body, param", [({"logit_bias": {"999999": 5}}, "logit_bias"),
                                         ({"logit_bias": {"12": 101}}, "logit_bias"),
                                         ({"logit_bias": {"banana": 1}}, "logit_bias"),
                                         ({"presence_penalty": 3}, "presence_penalty"),
                                         ({"top_k": -1}, "top_k"),
                                         ({"repeat_penalty": 1.2, "repetition_penalty": 1.1}, "repeat_penalty")])
def test_bad_sampling_fields_are_400_naming_them(client, body, param):
    r = client.post("/v1/completions", json={"prompt": CODE} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_only_shaping_fields_leave_the_device_argmax_path():
    engine = ScriptedEngine([300])
    c = serve_in_process(lambda: (engine, tokenizer.Tokenizer(SMALL_PY_DIR)))
    for body, greedy in (({}, True), ({"top_k": 40, "top_p": 0.5}, True), ({"presence_penalty": 0.5}, False),
                         ({"logit_bias": {"5": 1}}, False), ({"temperature": 0.7}, False),
                         ({"samplers": ["top_k"]}, False)):
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0} | body)
        assert r.status_code == 200, r.text
        assert engine.requests[-1][2].greedy is greedy, body
