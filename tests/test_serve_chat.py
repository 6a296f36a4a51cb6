"""`nanoqwen chat`: turns carry the conversation (each prompt extends the last, so the engine reuses its
KV), /clear starts over, /exit leaves, Ctrl-C stops a reply and not the program. Replies are checked
against the reference engine's greedy answers in this process."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from _serve_util import greedy
from _signals import sigint_default
from nanoqwen.paths import PACKAGE_DIR
from nanoqwen.backends import ReferenceEngine
from nanoqwen.modelcache import resolve
from nanoqwen.serve.prompts import stop_ids
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen import tokenizer

MAX_NEW = 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("chat-cache")


def chat(cache, *args, **kw):
    env = dict(os.environ, NANOQWEN_CACHE_DIR=str(cache), PYTHONPATH=str(PACKAGE_DIR.parent))
    return subprocess.Popen([sys.executable, "-m", "nanoqwen.cli.main", "chat", str(SMALL_PY_DIR), "--backend",
                             "reference", *args], env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_default, **kw)


def test_turns_clear_and_exit(cache, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(cache))
    path = resolve(SMALL_PY_DIR, log=lambda m: None)
    tok, engine = tokenizer.load(path), ReferenceEngine(path, 4096)
    stop = stop_ids(tok)

    def answer(messages):
        toks = greedy(engine, stop, tok.encode_chat(messages), MAX_NEW)
        return tok.decode([t for t in toks if t not in stop])
    first = [{"role": "user", "content": "hello"}]
    a1 = answer(first)
    second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "what is 2+2"}]
    a2 = answer(second)
    a3 = answer([{"role": "user", "content": "hi"}])

    p = chat(cache, "--max-new-tokens", str(MAX_NEW))
    out, err = p.communicate("hello\nwhat is 2+2\n/clear\nhi\n/nope\n/exit\n", timeout=120)
    assert p.returncode == 0, err
    assert out.split(">>> ")[1:4] == [a1 + "\n", a2 + "\n", ""] and out.split(">>> ")[4] == a3 + "\n"
    stats = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) tokens; (\d+) of (\d+) prompt tokens reused", err)]
    assert [s[2] for s in stats] == [len(tok.encode_chat(first)), len(tok.encode_chat(second)),
                                     len(tok.encode_chat([{"role": "user", "content": "hi"}]))]
    # the second turn extends the first: its prompt's common prefix with the kept sequence is reused
    assert stats[1][1] >= len(tok.encode_chat(first)) - 1
    assert "unknown command /nope" in err and "new conversation" in err


def test_ctrl_c_stops_the_reply_not_the_program(cache):
    p = chat(cache, "--max-new-tokens", "3000")
    p.stdin.write("def fibonacci(n):\n")
    p.stdin.flush()
    seen, deadline = "", time.monotonic() + 120
    while len(seen) < len(">>> ") + 3:   # the reply has started
        assert time.monotonic() < deadline, seen
        if select.select([p.stdout], [], [], 1)[0]:
            seen += os.read(p.stdout.fileno(), 100).decode()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate("/exit\n", timeout=60)
    assert p.returncode == 0, err
    assert "; stopped]" in err and "interrupted" not in err
