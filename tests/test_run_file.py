"""One file runs anywhere, and corruption never runs silently: `nanoqwen run FILE` with nothing beside the
packed file prints what running the HF directory prints; a bad file reports its own error before anything
about the tokenizer; a format-1 file asks for --tokenizer; a file with 4 flipped payload bytes fails in one
line naming the file and the tensor unless --no-verify. CPU, reference backend, small-py packed at test time."""

from __future__ import annotations

import shutil

import pytest
from _corrupt import flip_payload_bytes, set_version

from nanoqwen import testmodels
from nanoqwen.cli.main import main
from nanoqwen.hf import HFCheckpoint
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.pack import pack_hf
from nanoqwen.tokenizer import FILES

PROMPT = "def fibonacci(n):"
ARGS = ["--prompt", PROMPT, "--max-new-tokens", "6", "--backend", "reference"]
TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The packed small model, alone in its directory."""
    path = tmp_path_factory.mktemp("alone") / "model.nanoqwen"
    pack_hf(HFCheckpoint(testmodels.SMALL_PY_DIR), path, workers=1)
    return path


def run(capsys, model, *extra):
    rc = main(["run", str(model), *ARGS, *extra])
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_file_runs_alone_like_the_directory(capsys, alone, tmp_path, monkeypatch):
    assert list(alone.parent.iterdir()) == [alone]
    rc, out, errors = run(capsys, alone)
    assert rc == 0 and not errors and out.startswith(PROMPT) and len(out) > len(PROMPT) + 1
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    assert run(capsys, testmodels.SMALL_PY_DIR)[:2] == (0, out)


@pytest.mark.parametrize("content, field", [(b"", "header: file is 0 bytes"), (bytes(range(256)) * 40, "magic: ")])
def test_bad_file_reports_its_own_error(capsys, tmp_path, content, field):
    path = tmp_path / "bad.nanoqwen"
    path.write_bytes(content)
    rc, _, errors = run(capsys, path)
    assert rc == 1 and len(errors) == 1 and errors[0].startswith(f"error: {path}: {field}"), errors


def test_version_1_file_needs_tokenizer(capsys, alone, tmp_path):
    hf = tmp_path / "hf"  # the same model packed without its tokenizer, then labelled format 1
    shutil.copytree(testmodels.SMALL_PY_DIR, hf, ignore=shutil.ignore_patterns(*FILES))
    v1 = tmp_path / "v1.nanoqwen"
    pack_hf(HFCheckpoint(hf), v1, workers=1)
    set_version(v1, 1)
    assert NanoqwenFile(v1).version == 1
    rc, _, errors = run(capsys, v1)
    assert rc == 1 and errors == [f"error: {v1}: the file holds no tokenizer (format version 1 stores none); "
                                  "pass --tokenizer DIR"]
    rc, out, errors = run(capsys, v1, "--tokenizer", str(testmodels.SMALL_PY_DIR))
    assert rc == 0 and not errors and out == run(capsys, alone)[1]


def test_flipped_payload_bytes_fail_unless_no_verify(capsys, alone, tmp_path):
    bad = tmp_path / "flipped.nanoqwen"
    shutil.copyfile(alone, bad)
    flip_payload_bytes(bad, TENSOR)
    rc, out, errors = run(capsys, bad)
    assert rc == 1 and out == "" and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {bad}: tensor {TENSOR}: payload checksum ") and "corrupted" in errors[0]
    rc, out, errors = run(capsys, bad, "--no-verify")
    assert rc == 0 and not errors and out.startswith(PROMPT)


def test_cache_key_covers_every_stored_tokenizer_file(tmp_path, monkeypatch):
    """The packed file carries the tokenizer, so a new chat_template.jinja must repack a cached directory."""
    from nanoqwen.modelcache import resolve
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    hf = tmp_path / "hf"
    shutil.copytree(testmodels.SMALL_PY_DIR, hf)
    first = resolve(hf, log=lambda m: None)
    (hf / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    second = resolve(hf, log=lambda m: None)
    assert second != first and NanoqwenFile(second).blob("chat_template.jinja") is not None
