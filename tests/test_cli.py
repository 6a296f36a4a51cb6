"""What every command line shares: --version, help that shows defaults, sizes in human units, and bad
input (an existing directory as -o, a path that cannot be written) as one line, never a traceback."""

from __future__ import annotations

import pytest

from nanoqwen import __version__
from nanoqwen.cli import gen, main, tune
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.units import size


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
