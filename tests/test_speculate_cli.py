"""`nanoqwen run --speculate lookup|draft:FILE` on the reference backend (small-py): the same text as plain
greedy, the drafted / accepted counts in the summary line, bad options one line with a non-zero exit."""

from __future__ import annotations

import re

import pytest

from nanoqwen import testmodels
from nanoqwen.cli.main import main

MODEL = testmodels.SMALL_PY_DIR
# a function and the start of its copy: prompt lookup has something to find
PROMPT = "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n\n\n" \
         "def add_all(values):\n"


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("nq-cache")))
        yield


def run_cli(capsys, *argv):
    rc = main(["run", str(MODEL), "--backend", "reference", "--prompt", PROMPT, "--max-new-tokens", "24", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# Class (a) of docs/architecture.md: the reference backend's verify computes each row as a decode step,
# so the speculative text is the plain text exactly.


def test_run_speculate_prints_the_same_text_and_counts(capsys):
    rc0, plain, err0 = run_cli(capsys)
    rc1, spec, err1 = run_cli(capsys, "--speculate", "lookup", "--draft-tokens", "5")
    assert rc0 == rc1 == 0
    assert spec == plain
    assert "speculate" not in err0
    m = re.search(r"speculate: drafted (\d+), accepted (\d+)", err1)
    assert m, err1
    drafted, accepted = int(m[1]), int(m[2])
    assert 0 < accepted <= drafted


def test_run_speculate_with_sampling_drafts_nothing(capsys):
    rc, _, err = run_cli(capsys, "--speculate", "lookup", "--temperature", "0.7", "--seed", "1")
    assert rc == 0 and "speculate: drafted 0, accepted 0" in err


def test_run_with_a_draft_model_prints_the_same_text(capsys):
    """The model as its own draft model: the same text, every draft accepted."""
    rc0, plain, _ = run_cli(capsys)
    rc1, spec, err = run_cli(capsys, "--speculate", f"draft:{MODEL}", "--draft-tokens", "4")
    assert rc0 == rc1 == 0 and spec == plain
    m = re.search(r"speculate: drafted (\d+), accepted (\d+)", err)
    assert m and 0 < int(m[1]) == int(m[2]), err


@pytest.mark.parametrize("argv, messages", [
    (["--speculate", "lookup", "--draft-tokens", "0"], ["--draft-tokens must be in [1, 64], got 0"]),
    (["--speculate", "ngram"], ["--speculate must be one of lookup, draft:FILE, got 'ngram'"]),
    (["--speculate", "draft:/nonexistent/draft.nanoqwen"], ["draft:/nonexistent/draft.nanoqwen: no such file"]),
])
def test_bad_speculate_options_are_one_line(capsys, argv, messages):
    rc = main(["run", str(MODEL), "--prompt", PROMPT, *argv])
    _, err = capsys.readouterr()
    assert rc != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and any(m in lines[0] for m in messages), err
    assert "Traceback" not in err
