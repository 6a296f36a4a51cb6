"""Search spaces: tune/spaces.yaml -> candidate specs per GEMV role, constraints applied before compiling."""

from __future__ import annotations

import itertools
from functools import cache

import yaml

from .. import ROOT, NanoqwenError, config
from ..codegen.kernels import gemv
from ..codegen.spec import SpecError
from ..dims import ModelDims

SPACES_PATH = ROOT / "tune" / "spaces.yaml"


class SpaceError(NanoqwenError):
    pass


@cache
def spaces() -> dict[str, dict[str, list]]:
    try:
        data = yaml.safe_load(SPACES_PATH.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpaceError(f"{SPACES_PATH}: cannot load search spaces: {e}") from None
    params = gemv.GemvInt4Spec.parameters()
    for family, space in data.items():
        if family != gemv.GemvInt4Spec.family:
            raise SpaceError(f"{SPACES_PATH}: no tuner for kernel family {family!r}")
        for name, values in space.items():
            if name not in params:
                raise SpaceError(f"{SPACES_PATH}: {family}.{name} is not a template parameter")
            if not isinstance(values, list) or not values:
                raise SpaceError(f"{SPACES_PATH}: {family}.{name} must be a non-empty list")
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
