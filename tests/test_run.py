"""`nanoqwen run` on the CPU through the reference backend, on the trained small-py model (realistic top-1
margins, a real tokenizer and chat template): greedy is deterministic and is exactly the reference's
greedy continuation, EOS and max_new_tokens stop the loop, --chat applies the template, sampling is
reproducible under --seed, and every user error is one line with a non-zero exit."""

from __future__ import annotations

import re

import pytest

from nanoqwen import testmodels
from nanoqwen.backends import ReferenceEngine
from nanoqwen.cli.main import main
from nanoqwen.modelcache import resolve
from nanoqwen.reference import Reference
from nanoqwen.runtime.generate import generate
from nanoqwen.runtime.sampler import Sampling
from nanoqwen import tokenizer

MODEL = testmodels.SMALL_PY_DIR
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """One packed copy of the model for the whole module (the cache is content-keyed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("nq-cache")))
        yield


@pytest.fixture(scope="module")
def packed(cache_dir):
    path = resolve(MODEL, log=lambda m: None)
    return path, tokenizer.load(path)


def run_cli(capsys, *argv):
    rc = main(["run", str(MODEL), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def stats(err: str) -> dict:
    m = re.search(r"prompt (\d+) tokens, generated (\d+) \(stop: (\w+)\)", err)
    assert m, err
    return {"prompt": int(m[1]), "generated": int(m[2]), "stop": m[3]}


def test_greedy_is_deterministic_and_matches_reference(capsys, packed):
    path, tok = packed
    rc1, out1, err1 = run_cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "24")
    rc2, out2, err2 = run_cli(capsys, "--prompt", PROMPT, "--max-new-tokens", "24", "--stream")
    assert rc1 == rc2 == 0
    assert out1 == out2, "greedy output differs between runs (or between --stream and not)"
    assert "numpy reference" in err1 and "tokens/s" in err1
    ids = tok.encode(PROMPT)
    want = Reference.from_file(path).generate_greedy(ids, 24, stop_tokens=tok.eos_ids)
    if want[-1] in tok.eos_ids:
        want = want[:-1]
    assert out1 == PROMPT + tok.decode(want) + "\n"   # class (a): the reference backend runs this Reference
    s = stats(err1)
    assert s["prompt"] == len(ids) and s["generated"] == len(want)


def test_max_new_tokens(capsys):
    rc, out, err = run_cli(capsys, "--prompt", "import os\n", "--max-new-tokens", "5")
    assert rc == 0
    s = stats(err)
    assert s["stop"] == "max_new_tokens" and s["generated"] == 5


def test_eos_stops_generation(packed):
    """Declare the reference's 6th greedy token an EOS: the loop must stop right there, without it."""
    path, tok = packed
    ids = tok.encode(PROMPT)
    engine = ReferenceEngine(path, context=len(ids) + 32)
    free = list(engine.generate(ids, 12, Sampling()))

    class EosAt:
        eos_ids = (free[5],)
        stream = tok.stream

    first = free.index(free[5])  # the stop token may already occur earlier
    r = generate(engine, EosAt(), ids, 12)
    assert r.stop == "eos" and r.tokens == free[:first]


def test_chat_template(capsys, packed):
    _, tok = packed
    rc, out, err = run_cli(capsys, "--chat", "Write a sort function.", "--max-new-tokens", "8")
    assert rc == 0
    ids = tok.encode_chat([{"role": "user", "content": "Write a sort function."}])
    assert ids[:1] == [tok.token_to_id("<|im_start|>")]
    assert stats(err)["prompt"] == len(ids)
    assert not out.startswith("Write a sort"), "a chat reply must not echo the prompt"


def test_chat_reply_is_a_code_block(capsys):
    """The model was trained on a few ChatML conversations: it answers a request for code with a ```python
    block and ends its turn with <|im_end|> by itself."""
    rc, out, err = run_cli(capsys, "--chat", "write a python function that reverses a list", "--max-new-tokens", "256")
    assert rc == 0 and stats(err)["stop"] == "eos"
    assert out.startswith("```python\n") and out.rstrip().endswith("```"), out


def test_fill_in_the_middle(capsys):
    """The model fills a middle (Qwen2.5-Coder's prefix-suffix-middle format, special tokens written by
    name) and ends it with <|endoftext|> by itself. A 3.8M-parameter model's middle is Python-shaped, not
    necessarily right, so its content is not judged here."""
    prefix = "import os\n\ndef list_python_files(path):\n    result = []\n    for name in os.listdir(path):\n"
    prompt = f"<|fim_prefix|>{prefix}<|fim_suffix|>    return result\n<|fim_middle|>"
    rc, out, err = run_cli(capsys, "--prompt", prompt, "--max-new-tokens", "64")
    assert rc == 0 and stats(err)["stop"] == "eos" and out.startswith(prompt)
    middle = out[len(prompt):-1]
    assert middle.strip() and "<|" not in middle, middle


def test_sampling_reproducible_with_seed(capsys):
    args = ("--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0.9", "--top-p", "0.95")
    a = run_cli(capsys, *args, "--seed", "7")
    b = run_cli(capsys, *args, "--seed", "7")
    assert a[0] == b[0] == 0 and a[1] == b[1]


def test_nanoqwen_file_model(capsys, packed):
    """MODEL may be the packed file itself, which brings its own tokenizer."""
    path, _ = packed
    rc = main(["run", str(path), "--prompt", PROMPT, "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith(PROMPT)
    assert "packing" not in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", PROMPT, "--backend", "cuda"], "no CUDA device"),
    (["--prompt", PROMPT, "--max-new-tokens", "100000"], "exceeds the model's context"),
    (["--prompt", PROMPT, "--max-new-tokens", "50", "--context", "20"], "exceeds the KV cache"),
    (["--prompt", PROMPT, "--top-p", "0"], "--top-p"),
    (["--prompt", PROMPT, "--temperature", "-1"], "--temperature"),
    (["--prompt", PROMPT, "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", ""], "prompt is empty"),
    (["--chat", ""], "--chat is empty"),
    (["--chat", "  \n"], "--chat is empty"),
    (["--prompt", PROMPT, "--context", "0"], "--context must be at least 1 token, got 0"),
    (["--prompt", PROMPT, "--context", "100000"], "--context 100000 exceeds the model's"),
    (["--prompt", PROMPT, "--temperature", "1", "--seed", "-1"], "--seed must be a non-negative integer"),
    (["--prompt", PROMPT, "--tokenizer", "/nonexistent-dir"], "--tokenizer /nonexistent-dir: no tokenizer.json"),
])
def test_errors_are_one_line(capsys, argv, message):
    from nanoqwen.backends import cuda_available
    if "cuda" in argv and cuda_available():
        pytest.skip("a CUDA device is present")
    rc, out, err = run_cli(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc != 0 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_missing_model_is_one_line(capsys, tmp_path):
    rc = main(["run", str(tmp_path / "nope"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error:") and "nope" in err


def test_pack_cache_is_content_keyed(tmp_path, monkeypatch):
    import shutil
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m"
    shutil.copytree(MODEL, model)
    logs = []
    first = resolve(model, log=logs.append)
    again = resolve(model, log=logs.append)
    assert first == again and len(logs) == 1, "an unchanged checkpoint must not be repacked"
    (model / "generation_config.json").write_text((model / "generation_config.json").read_text() + "\n")
    edited = resolve(model, log=logs.append)
    assert edited != first and len(logs) == 2, "an edited checkpoint must be repacked under a new key"
