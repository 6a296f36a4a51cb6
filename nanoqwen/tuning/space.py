"""Search spaces: tune/spaces.yaml -> candidate specs per GEMV role and for the decode attention, constraints
applied before compiling."""

from __future__ import annotations

import itertools
from functools import cache

import yaml

from .. import NanoqwenError, config, paths
from ..codegen.gpu import DEFAULT, GpuProfile
from ..codegen.kernels import attention, gemv
from ..codegen.spec import SpecError, parse_params
from ..dims import ModelDims


class SpaceError(NanoqwenError):
    pass


ROWS_SPACE = "gemv_int4_rows"   # the m-row kernels' re-tilings (gemv.MULTIROW_TILE), swept per bucket
MMA_SPACE = "gemv_int4_mma"     # the tensor-core tiles, swept beside the CUDA-core ones (a space of its own:
                                # their lanes, rows and batches are not the CUDA-core kernel's)
TILE_SPACES = (gemv.GemvInt4Spec.family, MMA_SPACE)   # the m = 1 kernels' spaces
ATTENTION_SPACE = attention.AttentionDecodeSpec.family   # config attention's fields (attention.SINGLE_ROW_TILE)
ATTENTION_ROWS_SPACE = "attention_decode_rows"           # config multirow's ring, per bucket (MULTIROW_TILE)


@cache
def spaces() -> dict[str, dict[str, list]]:
    path = paths.data_path("tune", "spaces.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpaceError(f"{path}: cannot load search spaces: {e}") from None
    allowed = {gemv.GemvInt4Spec.family: gemv.GemvInt4Spec.parameters(), MMA_SPACE: gemv.GemvInt4Spec.parameters(),
               ROWS_SPACE: gemv.MULTIROW_TILE, ATTENTION_SPACE: attention.SINGLE_ROW_TILE,
               ATTENTION_ROWS_SPACE: attention.MULTIROW_TILE}
    for family, space in data.items():
        if family not in allowed:
            raise SpaceError(f"{path}: no tuner for kernel family {family!r}")
        for name, values in space.items():
            if name not in allowed[family]:
                raise SpaceError(f"{path}: {family}.{name} is not a template parameter it may sweep")
            if not isinstance(values, list) or not values:
                raise SpaceError(f"{path}: {family}.{name} must be a non-empty list")
    return data


def tile_spaces(names: tuple[str, ...] = TILE_SPACES) -> list[dict[str, list]]:
    """The m = 1 search spaces `names` (those tune/spaces.yaml holds); an unknown name is a SpaceError."""
    unknown = [n for n in names if n not in TILE_SPACES]
    if not names or unknown:
        raise SpaceError(f"no m = 1 search space {', '.join(unknown) or '(none named)'} "
                         f"(known: {', '.join(TILE_SPACES)})")
    return [spaces()[name] for name in names if name in spaces()]


def tile_fields() -> set[str]:
    """The fields of an m = 1 GEMV tile: what nanoqwen-tune sweeps, and the weight loads' L2 fetch size (no tile
    has won with it yet)."""
    return {name for s in tile_spaces() for name in s} | {"l2_fetch"}


def parse_tile(text: str, allowed: set[str]) -> dict:
    """FIELD=VALUE,... (values as `nanoqwen-gen --param` takes them) -> typed GEMV tile fields, each one of
    `allowed` (SpecError otherwise)."""
    fields = gemv.GemvInt4Spec.typed_params(parse_params(filter(None, text.split(","))))
    if other := sorted(set(fields) - allowed):
        raise SpecError(f"{', '.join(other)}: not a tile field (the tile: {', '.join(sorted(allowed))})")
    return fields


def _product(spaces_: list[dict[str, list]], default, make) -> tuple[list, int]:
    """([default] + every distinct valid make(params) over each space's cross product, number ruled out)."""
    out, rejected = [default], 0
    for space in spaces_:
        for values in itertools.product(*space.values()):
            try:
                spec = make(dict(zip(space, values)))
            except SpecError:
                rejected += 1
                continue
            if spec not in out:
                out.append(spec)
    return out, rejected


def retilings(one: gemv.GemvInt4Spec, cfg: config.Config) -> list[gemv.GemvInt4Spec]:
    """The m-row kernels the decoder derives from the m = 1 tile ``one``, one per multirow bucket (until a
    bucket is tuned beside it); SpecError where the multi-row step cannot re-tile it."""
    return [gemv.multirow_spec(one, m, cfg) for m in cfg.multirow.buckets if m > 1]


def _retiles(one: gemv.GemvInt4Spec, cfg: config.Config) -> gemv.GemvInt4Spec:
    """``one`` if the multi-row step can re-tile it for every bucket (the decoder builds them all from the
    stored m = 1 tile); else SpecError, so that no sweep stores a tile the decoder cannot build."""
    retilings(one, cfg)
    return one


def gemv_candidates(role: str, dims: ModelDims, cfg: config.Config, names: tuple[str, ...] = TILE_SPACES,
                    current: gemv.GemvInt4Spec | None = None) -> tuple[list[gemv.GemvInt4Spec], int]:
    """(valid candidate specs for `role` over the m = 1 spaces `names`, number ruled out by the spec's
    constraints). The config default is always first and `current` (the kernel this GPU runs now, from its
    tuned entry) second, so a sweep can never end worse than the fallback or than what is stored."""
    cands, rejected = _product(tile_spaces(names), gemv.role_spec(role, dims, cfg),
                               lambda params: _retiles(gemv.role_spec(role, dims, cfg, **params), cfg))
    if current is not None and current not in cands:
        cands.insert(1, current)
    return cands, rejected


def multirow_candidates(one: gemv.GemvInt4Spec, m: int, cfg: config.Config) -> tuple[list[gemv.GemvInt4Spec], int]:
    """(valid m-row kernels beside the m = 1 kernel `one`, number ruled out): the default re-tiling first,
    then every combination of the gemv_int4_rows space the spec allows (each keeps `one`'s row order)."""
    return _product([spaces()[ROWS_SPACE]], gemv.multirow_spec(one, m, cfg),
                    lambda tile: gemv.multirow_spec(one, m, cfg, tile=tile))


def tile_params(spec: gemv.GemvInt4Spec) -> dict:
    """The tunable fields of a spec (what the tuned-results file stores): m > 1, the re-tiling."""
    names = gemv.MULTIROW_TILE if spec.m > 1 else [n for space in tile_spaces() for n in space]
    return {n: getattr(spec, n) for n in dict.fromkeys(names)}


def attention_candidates(dims: ModelDims, cfg: config.Config, m: int = 1, one: dict | None = None,
                         current: dict | None = None, profile: GpuProfile = DEFAULT) -> tuple[list[tuple[dict, tuple]], int]:
    """(valid (fields, (attention_decode, attention_combine)) candidates, number ruled out). m = 1: config
    attention's fields over the attention_decode space; m > 1: config multirow's ring over
    attention_decode_rows beside the m = 1 fields ``one`` (their rounding kept). The config's fields come
    first and ``current`` (what this GPU runs now, a tuned entry) second, each set named in full."""
    fields = {}

    def make(params):
        tuned = dict(one=params) if m == 1 else dict(one=one, tile=params)
        pair = attention.decode_specs(dims, cfg, profile, m, **tuned)[1:]
        fields.setdefault(pair, dict(params))
        return pair

    a = cfg.attention if m == 1 else None
    default = ({n: getattr(a, n) for n in attention.SINGLE_ROW_TILE} if m == 1 else
               dict(stages=cfg.multirow.attention_stages, ctas_per_sm=cfg.multirow.attention_ctas_per_sm))
    pairs, rejected = _product([spaces()[ATTENTION_SPACE if m == 1 else ATTENTION_ROWS_SPACE]], make(default), make)
    try:   # a stale entry (the sweep of m > 1 reads its own) is no candidate
        now = None if current is None else make({**default, **current})
    except SpecError:
        now = None
    if now is not None and now not in pairs:
        pairs.insert(1, now)
    return [(fields[p], p) for p in pairs], rejected
