"""A copy of an A/B tree (tools/ab_tree.sh) with one GEMV's m = 1 tile changed in its tune/tuned.json, to run
beside its base in one same-run A/B (tools/gpu_check.sh GPU_CHECK_AB_ALSO="ID=TREE ..."):

    bash tools/ab_tree.sh 9f4bb65
    python tools/ab_variant.py .ab/9f4bb65 .ab/mma-l2 gate_up mma=1,lanes=4,rows=2,warps=8,kwarps=8,l2_fetch=256

The role's entry for --gpu (default the H100) takes FIELD=VALUE,... over its params (the tile fields
nanoqwen-tune sweeps, and l2_fetch; values as `nanoqwen-gen --param` takes them), and loses its measured
figures. Its m-row entries are dropped: they were tuned beside the kernel replaced, so the m-row kernels of
the variant take the config's default tiles (the decode A/B does not run them)."""

from __future__ import annotations

import argparse
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


def make_variant(base: Path, dest: Path, role: str, fields: str, gpu: str = H100) -> dict:
    """Write ``dest``, a copy of the tree ``base`` whose tune/tuned.json has ``role``'s m = 1 tile on ``gpu``
    with ``fields`` over its params; returns the new entry (NanoqwenError when a field, value or the tile is
    bad, before anything is written)."""
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
        gemv.role_spec(role, QWEN25_7B, cfg, **params)   # a tile the kernel cannot take is refused here
    except SpecError as e:
        raise NanoqwenError(f"{role}:{fields}: {e}") from None
    entry = {"params": params, "note": f"tools/ab_variant.py: {fields} over the entry of {base}"}
    entries = {k: v for k, v in data["entries"].items() if not k.startswith(key + "_m")} | {key: entry}
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest)
    tuned_store.write(data | {"entries": entries}, dest / "tune" / "tuned.json")
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path, help="the tree to copy (.ab/COMMIT)")
    p.add_argument("dest", type=Path, help="the variant's tree (replaced if it exists)")
    p.add_argument("role", help=f"the GEMV whose tile changes: {', '.join(gemv.ROLES)}")
    p.add_argument("fields", metavar="FIELD=VALUE,...", help="tile fields over the entry's params")
    p.add_argument("--gpu", default=H100, help=f"the GPU whose entry changes (default {H100!r})")
    args = p.parse_args(argv)
    try:
        entry = make_variant(args.base, args.dest, args.role, args.fields, args.gpu)
    except NanoqwenError as e:
        print(f"ab_variant: {e}", file=sys.stderr)
        return 2
    print(f"{args.dest}: {args.role} {entry['params']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
