"""Dump the SASS of every kernel the 7B, the tiny and the small-py test models need (plus the tuned GEMVs, the
GEMV variants the tests compile and the "plain" attention oracle) into DIR, one file per kernel, so a refactor can be checked by diff.

  python tools/sass_snapshot.py DIR            then   diff -r BEFORE AFTER

A file is named <model>-<index>-<uri without its hash>.sass; the entry name inside is replaced by KERNEL, so
a change of the spec hash alone (a new spec field) does not show as a difference. The first lines hold the
resource report (registers, static shared memory) and the launch shape."""

from __future__ import annotations

import dataclasses
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/sass_snapshot.py DIR")
    sys.exit(main(sys.argv[1]))
