"""What every command line shares: --version, help that shows defaults, sizes in human units, and bad
input (an existing directory as -o, a path that cannot be written) as one line, never a traceback."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _corrupt import denied, fifo, symlink_loop
from _signals import sigint_default

from nanoqwen import __version__
from nanoqwen.cli import gen, main, tune
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.units import size

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cli,prog", [(main.main, "nanoqwen"), (gen.main, "nanoqwen-gen"),
                                      (tune.main, "nanoqwen-tune")])
def test_version(cli, prog, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"{prog} {__version__}\n"


@pytest.mark.parametrize("argv,shown", [
    (["run", "--help"], ["--max-new-tokens N  stop after this many tokens (default: 128)", "(default: auto)",
                         "(default: 1.0)"]),
    (["pack", "--help"], ["seed for --random (default: 0)"]),
    (["bench", "--help"], ["(default: qkv,o_proj,gate_up,down)"]),
])
def test_help_shows_defaults(argv, shown, capsys):
    with pytest.raises(SystemExit) as e:
        main.main(argv)
    out = " ".join(capsys.readouterr().out.split())   # undo argparse's line wrapping
    assert e.value.code == 0
    for text in shown:
        assert " ".join(text.split()) in out


def test_tune_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 600.0)" in out and "(default: 7b)" in out


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3.5 * 2**20, "3.50 MiB"),
                                    (15.23 * 2**30, "15.2 GiB"), (1000 * 1024, "1000 KiB"), (5 * 2**40, "5.00 TiB")])
def test_sizes_in_human_units(n, text):
    assert size(n) == text


def test_pack_into_an_existing_directory(tmp_path, capsys):
    assert main.main(["pack", "--random", "tiny", "-o", str(tmp_path)]) == 0
    out = tmp_path / "random-tiny.nanoqwen"
    assert NanoqwenFile(out).dims.layers == 2
    err = capsys.readouterr().err
    assert f"wrote {out} (" in err and " MiB)" in err and "0.00 GB" not in err


@pytest.mark.parametrize("argv,message", [
    (["pack", "--random", "tiny", "-o", "{tmp}/missing/dir/x.nanoqwen"], "missing/dir"),
    (["pack", "--random", "tiny", "--workers", "0", "-o", "{tmp}/x.nanoqwen"], "--workers must be at least 1"),
    (["pack", "{tmp}/not-a-model", "-o", "{tmp}/x.nanoqwen"], "not-a-model"),
    (["inspect", "{tmp}"], "{tmp}"),
    (["bench", "--kernels", "--out", "{tmp}/missing/k.json"], "no directory {tmp}/missing to write it into"),
    (["bench", "7b", "--plot", "{tmp}/missing/itl.png"], "no directory {tmp}/missing to write it into"),
])
def test_bad_paths_are_one_line(argv, message, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(tmp=tmp_path) in err, err


def test_gen_list_with_a_bad_model_prints_only_the_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert gen.main(["list", "--model", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "config.json" in err


def test_gen_cubin_onto_a_directory_is_one_line(tmp_path, capsys):
    assert gen.main(["emit", "copy", "--cubin", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path}: Is a directory\n"


def test_a_missing_extra_names_the_extra_to_install(monkeypatch):
    import importlib.util

    from nanoqwen import extras
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "transformers" else real(name))
    assert extras.missing("torch") == ["transformers"]
    with pytest.raises(extras.MissingExtra) as e:
        extras.require("torch", "the baseline")
    assert str(e.value) == "the baseline needs transformers: pip install 'nanoqwen[torch]'"


def _one_line(argv, pattern, capsys) -> str:
    """The command ends in exit 1 and one line matching ``pattern``, quickly (a FIFO must not hang it)."""
    t0 = time.monotonic()
    assert main.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(pattern, err), err
    assert time.monotonic() - t0 < 10
    return err


HOSTILE_MODELS = {  # what MODEL is -> how to make it, what the one line says
    "fifo": (lambda p, mp: fifo(p), r"not a regular file \(a FIFO\)"),
    "/dev/zero": (lambda p, mp: os.symlink("/dev/zero", p), r"not a regular file \(a character device\)"),
    "symlink loop": (lambda p, mp: symlink_loop(p), r"too many levels of symbolic links"),
    "no permission": (lambda p, mp: denied(main.main(["pack", "--random", "tiny", "-o", str(p)]) or p, mp),
                      r"cannot open: permission denied"),
}


@pytest.mark.parametrize("what", HOSTILE_MODELS)
@pytest.mark.parametrize("command", [["inspect"], ["run", "--prompt", "hi", "--backend", "reference"]])
def test_hostile_model_paths_are_one_line(tmp_path, monkeypatch, capsys, what, command):
    make, pattern = HOSTILE_MODELS[what]
    path = tmp_path / "m.nanoqwen"
    make(path, monkeypatch)
    capsys.readouterr()
    err = _one_line([command[0], str(path), *command[1:]], pattern, capsys)
    assert str(path) in err and "no such file" not in err.lower()


def test_inspect_a_directory_is_one_line(tmp_path, capsys):
    _one_line(["inspect", str(tmp_path)], rf"{re.escape(str(tmp_path))}: not a regular file \(a directory\)", capsys)


@pytest.mark.parametrize("what", ["fifo", "symlink to /dev/null", "symlink to a fifo", "symlink loop"])
def test_pack_never_replaces_what_is_not_a_regular_file(tmp_path, capsys, what):
    out = tmp_path / "out.nanoqwen"
    if what == "fifo":
        fifo(out)
    elif what == "symlink to /dev/null":
        os.symlink("/dev/null", out)
    elif what == "symlink to a fifo":
        os.symlink(fifo(tmp_path / "pipe"), out)
    else:
        symlink_loop(out)
    before = {p.name: os.lstat(p).st_mode for p in tmp_path.iterdir()}
    pattern = "too many levels of symbolic links" if what == "symlink loop" else \
        r"exists and is a (FIFO|character device), not a regular file: refusing to replace it"
    _one_line(["pack", "--random", "tiny", "-o", str(out)], pattern, capsys)
    assert {p.name: os.lstat(p).st_mode for p in tmp_path.iterdir()} == before  # nothing replaced or left
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_pack_replaces_a_regular_file(tmp_path):
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"old")
    assert main.main(["pack", "--random", "tiny", "-o", str(out)]) == 0
    assert NanoqwenFile(out).synthetic and [p.name for p in tmp_path.iterdir()] == ["m.nanoqwen"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # a new file's mode, not a temporary's 0600


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_pack_leaves_no_temporary(tmp_path, sig):
    """A real `nanoqwen pack --random 7b` (4.4 GB, seconds of work) stopped as soon as its temporary file
    exists: the temporary is removed, nothing is written under the final name, one line says why, and the
    process ends by that signal."""
    out = tmp_path / "7b.nanoqwen"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, "-m", "nanoqwen.cli.main", "pack", "--random", "7b", "--workers", "1",
                          "-o", str(out)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".7b.nanoqwen.*.tmp")):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.005)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -sig, err
    assert err.splitlines()[-1] == ("terminated" if sig == signal.SIGTERM else "interrupted"), err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_gen_model_that_is_a_fifo_is_one_line(tmp_path, capsys):
    path = fifo(tmp_path / "m.nanoqwen")
    assert gen.main(["list", "--model", str(path)]) == 1
    assert capsys.readouterr().err == f"error: {path}: not a regular file (a FIFO); MODEL is a .nanoqwen file or a " \
                                      "HF directory\n"


def test_signal_removes_a_new_cache_entry(tmp_path):
    """SIGTERM while a pack fills a new cache entry (`nanoqwen run HF_DIR`): the temporary and then the entry
    directory go, directories that existed before stay, and the process ends by the signal."""
    code = """if True:
        import os, signal, sys, time
        from pathlib import Path
        from nanoqwen import interrupt, modelcache
        from nanoqwen.cli.errors import run_main

        def command(argv):
            entry = Path(argv[0]) / "models" / "m-0123"
            with modelcache.new_entry(entry):
                tmp = entry / ".model.nanoqwen.tmp"
                interrupt.register(tmp)
                tmp.write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        run_main(command, [sys.argv[1]])
    """
    (tmp_path / "models").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -signal.SIGTERM and r.stderr == "terminated\n", r.stderr
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["models"]
