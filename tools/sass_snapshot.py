"""Dump the SASS of every kernel the 7B, the tiny and the small-py test models need (plus the tuned GEMVs, the
GEMV variants the tests compile and the "plain" attention oracle) into DIR, one file per kernel, so a refactor can be checked by diff.

  python tools/sass_snapshot.py DIR                      dump
  python tools/sass_snapshot.py --compare BEFORE AFTER   which kernels differ, appeared or went

A file is named <model>-<index>-<uri without its hash>.sass; the entry name inside is replaced by KERNEL, so
a change of the spec hash alone (a new spec field) does not show as a difference. The first lines hold the
resource report (registers, static shared memory) and the launch shape. --compare pairs the files of two
dumps by (model, name), not by index (a kernel added to a list shifts the indices after it); names that
several kernels share (fields outside the URI, such as out_f16) pair by content first."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from nanoqwen import codegen, config
from nanoqwen.codegen import resources
from nanoqwen.codegen.kernels import attention, gemv
from nanoqwen.dims import QWEN25_7B, ModelDims
from nanoqwen.testmodels import SMALL_PY_DIR, tiny_dims
from nanoqwen.codegen import tuned


def model_specs() -> dict[str, list[codegen.KernelSpec]]:
    cfg = config.default()
    models = {"7b": QWEN25_7B, "tiny": tiny_dims(),
              "small-py": ModelDims.from_hf_dir(SMALL_PY_DIR)}
    return {name: list(dict.fromkeys(codegen.model_kernels(dims, cfg) + tuned.tuned_specs(dims, cfg)
                                     + tuned.tuned_attention_specs(dims, cfg) + gemv.variants(dims, cfg)
                                     + [_plain(dims, cfg)]))
            for name, dims in models.items()}


def _plain(dims, cfg):
    return dataclasses.replace(attention.decode_specs(dims, cfg)[1], pipeline="plain")


def main(out: str) -> int:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    named = [(f"{model}-{i:02d}-{spec.uri.rsplit('_', 1)[0]}", spec)
             for model, specs in model_specs().items() for i, spec in enumerate(specs)]
    built = codegen.build_many([s for _, s in named], progress=codegen.ProgressLine())
    for (name, spec), b in zip(named, built):
        launch = f"launch grid {b.launch.grid} block {b.launch.block} smem {b.launch.smem}\n"
        text = f"{b.resources.to_dict()}\n{launch}{resources.sass(b.cubin)}"
        (folder / f"{name}.sass").write_text(text.replace(spec.entry, "KERNEL"))
    print(f"{len(named)} kernels -> {folder}")
    return 0


def _by_name(folder: Path) -> dict[tuple[str, str], list[str]]:
    """(model, name) -> the contents of the files of that name (several when fields outside the URI differ)."""
    out: dict[tuple[str, str], list[str]] = {}
    for f in sorted(folder.glob("*.sass")):
        model, _, name = re.fullmatch(r"(.+?)-(\d+)-(.+)\.sass", f.name).groups()
        out.setdefault((model, name), []).append(f.read_text())
    return out


def compare(before: str, after: str) -> int:
    old, new = _by_name(Path(before)), _by_name(Path(after))
    changed = []
    for key in sorted(old.keys() & new.keys()):
        unmatched = list(new[key])
        for text in old[key]:
            if text in unmatched:
                unmatched.remove(text)
        if unmatched or len(old[key]) != len(new[key]):
            changed.append(key)
    for label, keys in (("differ", changed), ("only before", sorted(old.keys() - new.keys())),
                        ("only after", sorted(new.keys() - old.keys()))):
        for model, name in keys:
            print(f"{label}: {model} {name}")
    print(f"{sum(map(len, old.values()))} kernels before, {sum(map(len, new.values()))} after: {len(changed)} "
          f"names differ, {len(old.keys() - new.keys())} only before, {len(new.keys() - old.keys())} only after")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/sass_snapshot.py DIR | --compare BEFORE AFTER")
    sys.exit(main(sys.argv[1]))
