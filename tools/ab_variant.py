"""A copy of an A/B tree (tools/ab_tree.sh) with one GEMV's m = 1 tile changed in its tune/tuned.json, to run
beside its base in one same-run A/B (tools/gpu_check.sh GPU_CHECK_AB_ALSO="ID=TREE ..."):

    bash tools/ab_tree.sh 9f4bb65
    python tools/ab_variant.py .ab/9f4bb65 .ab/mma-l2 gate_up mma=1,lanes=4,rows=2,warps=8,kwarps=8,l2_fetch=256

The role's entry for --gpu (default the H100) takes FIELD=VALUE,... over its params (the tile fields
nanoqwen-tune sweeps, and l2_fetch; values as `nanoqwen-gen --param` takes them), and loses its measured
figures. Its m-row entries are dropped: they were tuned beside the kernel replaced, so the m-row kernels of
the variant take the config's default tiles (the decode A/B does not run them), unless `--rows-from FILE`
names a tuner's results (tuned.json form) whose entry for the role holds the same m = 1 tile: its m-row tiles
then come along, re-based on the variant's m = 1 kernel (the steps A/B, GPU_CHECK_STEPS_AB, runs them):

    python tools/ab_variant.py .ab/72a71f9 .ab/mmagu gate_up mma=1,lanes=4,rows=2,warps=8,kwarps=8 \
        --rows-from results/tuned-h100-2026-12-06-mma-gate_up-rows.json"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from nanoqwen import NanoqwenError, config
from nanoqwen.codegen import tuned, tuned_store
from nanoqwen.codegen.kernels import gemv
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.tuning import space

H100 = "NVIDIA H100 80GB HBM3"


def make_variant(base: Path, dest: Path, role: str, fields: str, gpu: str = H100,
                 rows_from: Path | None = None) -> dict:
    """Write ``dest``, a copy of the tree ``base`` whose tune/tuned.json has ``role``'s m = 1 tile on ``gpu``
    with ``fields`` over its params, and the m-row tiles of ``rows_from`` if given; returns the new m = 1 entry
    (NanoqwenError when a field, value, tile or the rows' file is bad, before anything is written)."""
    if role not in gemv.ROLES:
        raise NanoqwenError(f"unknown role {role!r} (known: {', '.join(gemv.ROLES)})")
    store = base / "tune" / "tuned.json"
    if not store.is_file():
        raise NanoqwenError(f"{base}: no tune/tuned.json (a tree of tools/ab_tree.sh?)")
    cfg = config.default()
    data = tuned_store.load(store)
    key = tuned.entry_key(role, QWEN25_7B, cfg, gpu)
    try:
        params = data["entries"].get(key, {}).get("params", {}) | space.parse_tile(fields, space.tile_fields())
        one = gemv.role_spec(role, QWEN25_7B, cfg, **params)   # a tile the kernel cannot take is refused here
    except SpecError as e:
        raise NanoqwenError(f"{role}:{fields}: {e}") from None
    entry = {"params": params, "note": f"tools/ab_variant.py: {fields} over the entry of {base}"}
    rows = {} if rows_from is None else _row_entries(rows_from, role, gpu, one, cfg)
    entries = {k: v for k, v in data["entries"].items() if not k.startswith(key + "_m")} | {key: entry} | rows
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest)
    tuned_store.write(data | {"entries": entries}, dest / "tune" / "tuned.json")
    return entry


def _row_entries(path: Path, role: str, gpu: str, one: gemv.GemvInt4Spec, cfg: config.Config) -> dict:
    """The m-row entries of the results file ``path`` for ``role`` on ``gpu``, re-based on ``one``: only when
    the file's m = 1 tile is ``one``'s (m-row tiles keep their m = 1 kernel's order, and were tuned beside it)."""
    try:
        src = json.loads(path.read_text())["entries"]
        key = tuned.entry_key(role, QWEN25_7B, cfg, gpu)
        theirs = src.get(key, {}).get("params")
        same = theirs is not None and gemv.role_spec(role, QWEN25_7B, cfg, **theirs) == one
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SpecError) as e:
        raise NanoqwenError(f"{path}: not a tuner's results ({type(e).__name__}: {e})") from None
    if not same:
        raise NanoqwenError(f"{path}: its {role} m = 1 tile on {gpu} is {theirs}, not the variant's: its m-row "
                            f"tiles were tuned beside another kernel")
    rows = {}
    for m in cfg.multirow.buckets[1:]:
        mkey = tuned.entry_key(role, QWEN25_7B, cfg, gpu, m)
        if mkey in src:
            try:
                tile = src[mkey]["params"]
                gemv.multirow_spec(one, m, cfg, tile=tile)
            except (KeyError, TypeError, SpecError) as e:
                raise NanoqwenError(f"{path}: {mkey}: {e}") from None
            rows[mkey] = {"m": m, "params": tile, "base_uri": one.uri, "note": f"tools/ab_variant.py: from {path}"}
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path, help="the tree to copy (.ab/COMMIT)")
    p.add_argument("dest", type=Path, help="the variant's tree (replaced if it exists)")
    p.add_argument("role", help=f"the GEMV whose tile changes: {', '.join(gemv.ROLES)}")
    p.add_argument("fields", metavar="FIELD=VALUE,...", help="tile fields over the entry's params")
    p.add_argument("--gpu", default=H100, help=f"the GPU whose entry changes (default {H100!r})")
    p.add_argument("--rows-from", type=Path, metavar="FILE", help="a tuner's results holding this m = 1 tile: "
                   "its m-row tiles come along")
    args = p.parse_args(argv)
    try:
        entry = make_variant(args.base, args.dest, args.role, args.fields, args.gpu, args.rows_from)
    except NanoqwenError as e:
        print(f"ab_variant: {e}", file=sys.stderr)
        return 2
    print(f"{args.dest}: {args.role} {entry['params']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
