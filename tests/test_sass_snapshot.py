"""tools/sass_snapshot.py --compare: two dumps paired by (model, name), not by index, and names that several
kernels share (fields outside the URI) paired by content."""

from __future__ import annotations

from _tools import tool

snapshot = tool("sass_snapshot")


def _dump(folder, files):
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)


def test_compare_pairs_kernels_by_name_and_shared_names_by_content(tmp_path, capsys):
    _dump(tmp_path / "a", {"7b-00-gemv_m1.sass": "A", "7b-01-plain_m1.sass": "f32", "7b-02-plain_m1.sass": "f16",
                           "7b-03-gemv_m8.sass": "B", "tiny-00-gone.sass": "G"})
    # an added kernel shifts the indices; the two "plain" kernels swap places; gemv_m8 changed
    _dump(tmp_path / "b", {"7b-00-new.sass": "N", "7b-01-gemv_m1.sass": "A", "7b-02-plain_m1.sass": "f16",
                           "7b-03-plain_m1.sass": "f32", "7b-04-gemv_m8.sass": "B2"})
    assert snapshot.compare(str(tmp_path / "a"), str(tmp_path / "b")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == ["differ: 7b gemv_m8", "only before: tiny gone", "only after: 7b new"]
    assert out[-1] == "5 kernels before, 5 after: 1 names differ, 1 only before, 1 only after"
