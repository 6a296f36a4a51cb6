"""Search spaces: tune/spaces.yaml -> candidate specs per GEMV role, constraints applied before compiling."""

from __future__ import annotations

import itertools
from functools import cache

import yaml

from .. import NanoqwenError, config, paths
from ..codegen.kernels import gemv
from ..codegen.spec import SpecError
from ..dims import ModelDims


class SpaceError(NanoqwenError):
    pass


@cache
def spaces() -> dict[str, dict[str, list]]:
    path = paths.data_path("tune", "spaces.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpaceError(f"{path}: cannot load search spaces: {e}") from None
    params = gemv.GemvInt4Spec.parameters()
    for family, space in data.items():
        if family != gemv.GemvInt4Spec.family:
            raise SpaceError(f"{path}: no tuner for kernel family {family!r}")
        for name, values in space.items():
            if name not in params:
                raise SpaceError(f"{path}: {family}.{name} is not a template parameter")
            if not isinstance(values, list) or not values:
                raise SpaceError(f"{path}: {family}.{name} must be a non-empty list")
    return data


def gemv_candidates(role: str, dims: ModelDims, cfg: config.Config) -> tuple[list[gemv.GemvInt4Spec], int]:
    """(valid candidate specs for `role`, number ruled out by the spec's constraints). The config default
    is always first, so a sweep can never end worse than the fallback."""
    space = spaces()[gemv.GemvInt4Spec.family]
    names = list(space)
    default = gemv.role_spec(role, dims, cfg)
    out, rejected = [default], 0
    for values in itertools.product(*(space[n] for n in names)):
        try:
            spec = gemv.role_spec(role, dims, cfg, **dict(zip(names, values)))
        except SpecError:
            rejected += 1
            continue
        if spec not in out:
            out.append(spec)
    return out, rejected


def tile_params(spec: gemv.GemvInt4Spec) -> dict:
    """The tunable fields of a spec (what the tuned-results file stores)."""
    return {n: getattr(spec, n) for n in spaces()[spec.family]}
