"""spec -> cached cubin. ``build`` renders, looks the source up in the on-disk cache and compiles on a
miss; ``build_many`` does that for a whole plan in parallel. Threads suffice: cuda.bindings releases
the GIL inside nvrtcCompileProgram (measured: 4 compiles on 2 cores in 0.61x the serial time)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import config
from . import cache, nvrtc, resources
from .render import render
from .spec import KernelSpec, Launch, SpecError


@dataclass(frozen=True)
class Built:
    spec: KernelSpec
    cubin: bytes = field(repr=False)
    path: Path                      # the cached .cubin (load it with cuModuleLoadData(cubin) or by path)
    entry: str                      # extern "C" kernel name inside the cubin
    launch: Launch
    resources: resources.Resources
    cached: bool                    # True when no compile happened in this call
    log: str = field(default="", repr=False)  # NVRTC/ptxas log of the compile that produced the cubin


def build(spec: KernelSpec, cfg: config.Codegen | None = None) -> Built:
    cfg = cfg or config.default().codegen
    source = render(spec)
    options = nvrtc.full_options(cfg.arch, cfg.nvrtc_options)
    headers = nvrtc.headers(source)
    key = cache.key(source, headers, options, nvrtc.version(), cfg.arch)
    entry = cache.Entry.at(config.cache_root(cfg) / cfg.arch, spec.uri, key)
    launch = spec.launch()
    hit = entry.load()
    res = _cached_resources(hit[1]) if hit else None
    if res is not None:
        cache.STATS.add(True)
        return Built(spec, hit[0], entry.cubin_path, spec.entry, launch, res, cached=True,
                     log=hit[1].get("log", ""))
    if cache.jit_disabled():
        raise cache.JitDisabled(f"{spec.uri} is not in the kernel cache {entry.cubin_path.parent} and "
                                f"NANOQWEN_DISABLE_JIT is set (build it first: nanoqwen-gen compile --model M)")
    t0 = time.perf_counter()
    compiled = nvrtc.compile(source, f"{spec.uri}.cu", cfg.arch, cfg.nvrtc_options, spec_repr=spec.spec_repr,
                             hdrs=headers)
    seconds = time.perf_counter() - t0
    report = resources.report(compiled.cubin, compiled.log)
    if spec.entry not in report:
        raise SpecError(f"templates/{spec.template} defines no kernel named {spec.entry} "
                        f"(found: {', '.join(report) or 'none'}); use {{{{ entry }}}} as the extern \"C\" name")
    res = report[spec.entry]
    meta = {
        "spec": spec.spec_repr, "uri": spec.uri, "family": spec.family, "template": spec.template,
        "options": options, "nvrtc_version": nvrtc.version(), "arch": cfg.arch, "key": key,
        "resources": res.to_dict(), "log": compiled.log, "compile_s": round(seconds, 3),
        "launch": {"grid": launch.grid, "block": launch.block, "smem": launch.smem},
    }
    try:
        entry.store(compiled.cubin, meta)
    except OSError as e:  # a read-only or full cache costs compile time, never the run
        warnings.warn(f"kernel cache {entry.cubin_path.parent} not writable ({e.strerror}); "
                      f"set NANOQWEN_CACHE_DIR", stacklevel=2)
    cache.STATS.add(False, seconds)
    return Built(spec, compiled.cubin, entry.cubin_path, spec.entry, launch, res, cached=False, log=compiled.log)


def _cached_resources(meta: dict) -> resources.Resources | None:
    """The entry's resource report; None (a miss) when written by a version with other fields."""
    try:
        return resources.Resources(**meta["resources"])
    except (KeyError, TypeError):
        return None


Progress = Callable[[int, int, int], None]  # (done, total, cached)


class ProgressLine:
    """"compiled 12/40 kernels (7 cached)" on stderr once the wait passes 1 s: redrawn in place on a
    terminal, one line per quarter elsewhere (logs, CI)."""

    def __init__(self, stream=None, after_s: float = 1.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.after_s = after_s
        self.start = time.perf_counter()
        self.shown = False
        self.quarter = 0

    def __call__(self, done: int, total: int, cached: int) -> None:
        if not self.shown and time.perf_counter() - self.start < self.after_s:
            return
        self.shown = True
        line = f"compiled {done}/{total} kernels ({cached} cached)"
        if self.tty:
            self.stream.write(f"\r{line}" + ("\n" if done == total else ""))
        elif 4 * done // total > self.quarter or done == total:
            self.quarter = 4 * done // total
            self.stream.write(line + "\n")
        self.stream.flush()


def build_many(specs, workers: int | None = None, progress: Progress | None = None,
               cfg: config.Codegen | None = None, return_exceptions: bool = False) -> list:
    """Build every spec (duplicates once), in parallel; results in input order. ``progress`` (e.g.
    ``ProgressLine()``) is called after each kernel; None is silent. The first failure is raised once
    the running compiles finish, unless ``return_exceptions``: then a failed kernel's slot holds its
    exception and every other kernel is still built (CI and `nanoqwen-gen compile` report all at once)."""
    cfg = cfg or config.default().codegen
    specs = list(specs)
    unique = list(dict.fromkeys(specs))
    workers = workers or cfg.compile_workers or os.cpu_count() or 1
    nvrtc.version()  # load NVRTC once, before the threads race to
    done = cached = 0
    results: dict[KernelSpec, object] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(unique) or 1))) as pool:
        futures = {pool.submit(build, s, cfg): s for s in unique}
        for fut in as_completed(futures):
            spec = futures[fut]
            try:
                results[spec] = fut.result()
            except Exception as e:
                if not return_exceptions:
                    for f in futures:
                        f.cancel()
                    raise
                results[spec] = e
            done += 1
            cached += getattr(results[spec], "cached", False)
            if progress:
                progress(done, len(unique), cached)
    return [results[s] for s in specs]
