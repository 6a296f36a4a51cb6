"""`nanoqwen-gen`: list kernel families and the kernels a model needs (the multi-row step's m > 1 kernels
included; `--param m=K` picks one, the decode kernel m = 1 otherwise); emit any kernel's CUDA source,
PTX, SASS, resource report or cubin; compile a model's whole kernel set into the cache (ahead of
serving with NANOQWEN_DISABLE_JIT=1).

  nanoqwen-gen list [--model 7b|tiny|HF_DIR|FILE.nanoqwen]
  nanoqwen-gen emit FAMILY|URI [--model M] [--param k=v ...] [--ptx | --sass | --resources | --cubin PATH]
  nanoqwen-gen emit --all [--model M] [--resources] [--cubin DIR]
  nanoqwen-gen compile [--model M]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from .. import codegen, config
from ..codegen import kernels, nvrtc, resources
from ..codegen.cache import STATS
from ..codegen.spec import SpecError, parse_params
from ..dims import QWEN25_7B, DimsError, ModelDims
from .args import parser
from .errors import run_main


def model_dims(arg: str) -> ModelDims:
    """'7b', 'tiny' (the test model), a Hugging Face directory, or a .nanoqwen file."""
    if arg.lower() == "7b":
        return QWEN25_7B
    if arg.lower() == "tiny":
        from ..testmodels import tiny_dims
        return tiny_dims()
    path = Path(arg)
    if not os.path.lexists(path):
        raise DimsError(f"--model {arg}: not '7b', 'tiny', a model directory or a .nanoqwen file")
    from ..modelcache import is_file  # only when asked: the model readers are not codegen's concern
    if not is_file(path):  # is_file: a symlink loop or a FIFO is one line saying so
        return ModelDims.from_hf_dir(path)
    from ..nqfile import NanoqwenFile
    with NanoqwenFile(path) as f:
        return f.dims


def _model_specs(args):
    """The decode kernels of --model, then the multi-row step's m > 1 kernels (config multirow.buckets)."""
    if not args.model:
        return []
    dims, cfg = model_dims(args.model), config.default()
    return list(dict.fromkeys(codegen.model_kernels(dims, cfg) + codegen.multirow_kernels(dims, cfg)))


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def cmd_list(args) -> int:
    specs = _model_specs(args)   # a bad --model fails before anything is printed
    for name in sorted(kernels.FAMILIES):
        cls = kernels.family(name)
        print(f"{name}  (templates/{cls.template})")
        for pname, (tp, default) in cls.parameters().items():
            shown = "required" if default is dataclasses.MISSING else f"default {default!r}"
            print(f"    {pname}: {_type_name(tp)}  {shown}")
    if args.model:
        print(f"\nkernels for --model {args.model} ({len(specs)}):")
        for s in specs:
            print(f"  {s.uri}\n      {s.spec_repr}")
    return 0


def select(args, specs) -> codegen.KernelSpec:
    """KERNEL is a URI from `list --model`, or a family: built from --param alone, or, with --model,
    the one model kernel of that family whose fields match every --param (m = 1 unless --param m=...)."""
    params = parse_params(args.param)
    by_uri = {s.uri: s for s in specs}
    if args.kernel in by_uri:
        if params:
            raise SpecError("--param cannot modify a kernel named by URI; name its family instead")
        return by_uri[args.kernel]
    if args.kernel not in kernels.FAMILIES:
        where = f"a kernel of --model {args.model}" if args.model else "a URI (URIs need --model)"
        raise SpecError(f"unknown kernel {args.kernel!r}: neither a family ({', '.join(sorted(kernels.FAMILIES))}) "
                        f"nor {where}")
    cls = kernels.family(args.kernel)
    if not args.model:
        return cls.from_params(**params)
    want = cls.typed_params(params)
    if "m" in cls.parameters() and "m" not in want:
        want["m"] = 1   # a row-count family without --param m: its decode kernel
    candidates = [s for s in specs if s.family == cls.family]
    match = [s for s in candidates if all(getattr(s, k) == v for k, v in want.items())]
    if len(match) == 1:
        return match[0]
    if not match:
        raise SpecError(f"--model {args.model} needs no {cls.family} kernel with {_fmt(want)} "
                        f"(it needs: {', '.join(s.uri for s in candidates) or 'none'}); "
                        f"drop --model to build any shape")
    raise SpecError(f"{len(match)} {cls.family} kernels of --model {args.model} match {_fmt(want) or 'no --param'}: "
                    f"{', '.join(s.uri for s in match)}; pick one by URI or add --param")


def _fmt(kv: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kv.items())


def resource_table(built) -> str:
    rows = [("kernel", "grid", "block", "dyn smem", "regs", "static smem", "local", "spill st/ld", "cached")]
    for b in built:
        r, l = b.resources, b.launch
        rows.append((b.entry, "x".join(map(str, l.grid)), "x".join(map(str, l.block)), str(l.smem),
                     str(r.registers), str(r.shared_static), str(r.local_bytes),
                     f"{r.spill_stores}/{r.spill_loads}", "yes" if b.cached else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _resources_text(b) -> str:
    lines = [f"{b.entry}", f"  spec: {b.spec.spec_repr}", f"  launch: grid {b.launch.grid} block {b.launch.block} "
             f"dynamic smem {b.launch.smem} B", f"  cubin: {b.path} ({len(b.cubin)} B)"]
    lines += [f"  {k}: {v}" for k, v in b.resources.to_dict().items()]
    return "\n".join(lines)


def _build_all(specs):
    t0 = time.perf_counter()
    built = codegen.build_many(specs, progress=codegen.ProgressLine())
    print(f"{len(built)} kernels in {time.perf_counter() - t0:.1f} s ({STATS.hits} cached, {STATS.misses} "
          f"compiled, NVRTC {nvrtc.version()}, cache {config.cache_root()})", file=sys.stderr)
    return built


def cmd_emit(args) -> int:
    modes = [m for m in ("ptx", "sass", "resources") if getattr(args, m)] + (["cubin"] if args.cubin else [])
    if len(modes) > 1 and not (args.all and set(modes) <= {"resources", "cubin"}):
        raise SpecError(f"choose one of --ptx, --sass, --resources, --cubin (got {', '.join(modes)})")
    if args.all:
        if args.kernel or args.param:
            raise SpecError("--all emits every kernel of --model; drop KERNEL and --param")
        if not args.model:
            raise SpecError("--all needs --model (7b, tiny, a model directory or a .nanoqwen file)")
        return _emit_all(args, _model_specs(args))
    if not args.kernel:
        raise SpecError("emit needs a KERNEL (a family or a URI from `nanoqwen-gen list --model M`) or --all")
    spec = select(args, _model_specs(args))
    if args.ptx:
        cfg = config.default().codegen
        print(nvrtc.compile(codegen.render(spec), f"{spec.uri}.cu", cfg.arch, cfg.nvrtc_options, ptx=True,
                            spec_repr=spec.spec_repr).ptx, end="")
    elif args.sass:
        print(resources.sass(codegen.build(spec).cubin), end="")
    elif args.resources:
        print(_resources_text(codegen.build(spec)))
    elif args.cubin:
        b = codegen.build(spec)
        Path(args.cubin).write_bytes(b.cubin)
        print(f"wrote {args.cubin} ({len(b.cubin)} B, entry {b.entry})", file=sys.stderr)
    else:
        print(codegen.render(spec), end="")
    return 0


def _emit_all(args, specs) -> int:
    if args.ptx or args.sass:
        raise SpecError("--all supports source, --resources and --cubin DIR")
    if not (args.resources or args.cubin):
        for s in specs:
            print(codegen.render(s), end="\n")
        return 0
    built = _build_all(specs)
    if args.cubin:
        out = Path(args.cubin)
        out.mkdir(parents=True, exist_ok=True)
        for b in built:
            (out / f"{b.entry}.cubin").write_bytes(b.cubin)
        print(f"wrote {len(built)} cubins to {out}", file=sys.stderr)
    if args.resources:
        print(resource_table(built))
    return 0


def cmd_compile(args) -> int:
    if not args.model:
        raise SpecError("compile needs --model (7b, tiny, a model directory or a .nanoqwen file)")
    print(resource_table(_build_all(_model_specs(args))))
    return 0


def _main(argv) -> int:
    top = parser("nanoqwen-gen", __doc__)
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    model_help = "7b, tiny, a Hugging Face model directory, or a .nanoqwen file"
    p = sub.add_parser("list", help="kernel families, their parameters, and the kernels a model needs")
    p.add_argument("--model", help=model_help)
    p.set_defaults(_run=cmd_list)
    p = sub.add_parser("emit", help="CUDA source (default), PTX, SASS, resources or cubin of a kernel")
    p.add_argument("kernel", nargs="?", help="family name or kernel URI")
    p.add_argument("--model", help=model_help)
    p.add_argument("--param", action="append", default=[], metavar="K=V", help="template parameter (repeatable)")
    p.add_argument("--ptx", action="store_true", help="print PTX")
    p.add_argument("--sass", action="store_true", help="print SASS (needs cuobjdump or nvdisasm)")
    p.add_argument("--resources", action="store_true", help="registers, shared/local memory, spills")
    p.add_argument("--cubin", metavar="PATH", help="write the cubin (a directory with --all)")
    p.add_argument("--all", action="store_true", help="every kernel --model needs")
    p.set_defaults(_run=cmd_emit)
    p = sub.add_parser("compile", help="build every kernel --model needs into the cache; print resources")
    p.add_argument("--model", help=model_help)
    p.set_defaults(_run=cmd_compile)
    args = top.parse_args(argv)
    return args._run(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
