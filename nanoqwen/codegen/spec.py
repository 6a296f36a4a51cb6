"""A kernel variant is a frozen, hashable dataclass: its fields are the template parameters, its
``uri`` / ``entry`` name the generated module and its ``extern "C"`` function, ``launch()`` gives the
grid it was written for, ``kernel_params`` declares the kernel's parameters once: the C++ parameter
list (render) and the launch packing (runtime/driver.py, by ``signature``) are both generated from it.
Families subclass ``KernelSpec`` in ``codegen/kernels/<family>.py``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar

from .. import NanoqwenError
from . import probe


class SpecError(NanoqwenError):
    """An impossible or malformed kernel spec (unknown family/parameter, bad value, broken invariant)."""


# sm_90: 1024 threads per block. The shared-memory limit is the device's (gpu.GpuProfile.max_smem),
# checked by the specs that ask for dynamic shared memory.
MAX_THREADS = 1024
_GRID_MAX = (2**31 - 1, 65535, 65535)


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0  # dynamic shared memory bytes

    def __post_init__(self):
        for name in ("grid", "block"):
            v = getattr(self, name)
            if not (isinstance(v, tuple) and len(v) == 3 and all(_is_int(x) and x > 0 for x in v)):
                raise SpecError(f"Launch.{name} must be three positive ints, got {v!r}")
        if any(g > m for g, m in zip(self.grid, _GRID_MAX)):
            raise SpecError(f"Launch.grid {self.grid} exceeds the CUDA limits {_GRID_MAX}")
        if math.prod(self.block) > MAX_THREADS:
            raise SpecError(f"Launch.block {self.block} has {math.prod(self.block)} threads > {MAX_THREADS}")
        if not (_is_int(self.smem) and self.smem >= 0):
            raise SpecError(f"Launch.smem must be a byte count >= 0, got {self.smem!r}")

    @property
    def threads(self) -> int:
        return math.prod(self.block)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Field types a template parameter may have: they hash, compare and repr deterministically.
_SCALARS = (bool, int, float, str)


# C++ scalar type of a kernel parameter -> the driver's slot kind (runtime/driver.py packs by kind)
_SCALAR_KINDS = {"int": "i32", "u32": "u32", "u64": "u64", "float": "f32"}


@dataclass(frozen=True)
class Param:
    """One kernel parameter. ``ctype`` is the pointee type of a pointer, or the scalar's own type.
    ``restrict`` (__restrict__) is off for data the previous kernel wrote: a .nc load of it could be
    hoisted above griddepcontrol.wait (common.cuh ld_act_*)."""
    name: str
    ctype: str
    pointer: bool = True
    const: bool = True        # pointer to const: the kernel only reads through it
    restrict: bool = True
    note: str = ""            # a comment after the declaration in the generated source

    def __post_init__(self):
        if not self.pointer and self.ctype not in _SCALAR_KINDS:
            raise SpecError(f"kernel parameter {self.name}: scalar type {self.ctype!r} is not one of "
                            f"{', '.join(_SCALAR_KINDS)}")

    @property
    def kind(self) -> str:
        return "ptr" if self.pointer else _SCALAR_KINDS[self.ctype]

    @property
    def cpp_type(self) -> str:
        if not self.pointer:
            return self.ctype
        return f"{'const ' if self.const else ''}{self.ctype}*{' __restrict__' if self.restrict else ''}"

    def declaration(self) -> str:
        return f"{self.cpp_type} {self.name}" + (f" /* {self.note} */" if self.note else "")

    def null_constant(self) -> str:
        """A variant that does not take this parameter sees it as a null (pointer) or zero (scalar)
        constant, so one kernel body compiles for every variant (the branches it discards read it)."""
        if not self.pointer:
            return f"constexpr {self.ctype} {self.name} = 0;"
        return f"constexpr {'const ' if self.const else ''}{self.ctype}* {self.name} = nullptr;"


def inp(name: str, ctype: str, restrict: bool = True, note: str = "") -> Param:
    """A pointer the kernel reads."""
    return Param(name, ctype, restrict=restrict, note=note)


def out(name: str, ctype: str, note: str = "") -> Param:
    """A pointer the kernel writes (and may read)."""
    return Param(name, ctype, const=False, note=note)


def scalar(name: str, ctype: str, note: str = "") -> Param:
    return Param(name, ctype, pointer=False, restrict=False, const=False, note=note)


# the last parameter of a timed kernel: its launch's slots of the probe table (codegen/probe.py)
PROBE_PARAM = out(probe.PARAM_NAME, "u64", note=probe.PARAM_NOTE)


class VariantParams:
    """Mixin of the families whose variants take different parameters: ``_family_params()`` lists every
    parameter of the family in C++ order with whether this variant takes it. ``kernel_params`` are the ones
    it takes; the template variable ``absent_params`` holds the constants standing for the others
    (Param.null_constant), which the template reads only in branches the variant discards."""

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        raise NotImplementedError(f"{type(self).__name__}._family_params()")

    @property
    def kernel_params(self) -> tuple[Param, ...]:
        return tuple(p for p, taken in self._family_params() if taken)

    @property
    def absent_params(self) -> str:
        return "\n".join(p.null_constant() for p, taken in self._family_params() if not taken)

    def context(self) -> dict:
        return super().context() | {"absent_params": self.absent_params}


@dataclass(frozen=True)
class KernelSpec:
    family: ClassVar[str]
    template: ClassVar[str]            # file name inside templates/
    uri_fields: ClassVar[tuple[str, ...]] = ()   # fields shown in the readable URI, in this order
    kernel_params: ClassVar[tuple[Param, ...]]   # in C++ order; a property where variants differ
    timeable: ClassVar[bool] = False   # the template carries the timeline probe's hooks (codegen/probe.py)
    # Fields added after kernels were named (tuned entries, caches): left out of spec_repr and the URI while
    # they hold their default, so every earlier spec keeps its repr, URI and cache key.
    late_fields: ClassVar[tuple[str, ...]] = ("timed",)

    # Timeline variant (codegen/probe.py): one more parameter, `probe`, and %globaltimer stamps. Keyword-only
    # (families declare required fields after it) and a late field: an untimed spec's repr, URI, cache key
    # and source are exactly what they were before this field existed.
    timed: bool = dataclasses.field(default=False, kw_only=True)

    # ---- subclass hooks ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise SpecError for a malformed or impossible spec. Subclasses call super().validate() first,
        then check their own invariants (divisibility, resource limits) with messages naming the field."""
        hints = self.field_types()
        for f in dataclasses.fields(self):
            _check_type(self.family, f.name, hints[f.name], getattr(self, f.name))
        for name in self.uri_fields:
            if name not in hints:
                raise SpecError(f"{type(self).__name__}.uri_fields names unknown field {name!r}")
        params = getattr(self, "kernel_params", None)
        if not (isinstance(params, tuple) and all(isinstance(p, Param) for p in params)):
            raise SpecError(f"{type(self).__name__} declares no kernel_params (a tuple of Param)")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise SpecError(f"{type(self).__name__}.kernel_params repeats a name: {names}")
        if self.timed and not self.timeable:
            raise SpecError(f"{self.family}: timed=True, but templates/{self.template} has no timeline probe hooks")
        if self.timed and PROBE_PARAM.name in names:
            raise SpecError(f"{self.family}: a kernel parameter is named {PROBE_PARAM.name!r}, the timeline probe's")

    def context(self) -> dict:
        """Template variables: every field, plus ``entry`` (the extern "C" name), ``spec_repr`` and
        ``params`` (the C++ parameter list generated from ``all_params``) and the probe hooks (probe.hooks)."""
        ctx = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        ctx.update(entry=self.entry, spec_repr=self.spec_repr, params=cpp_params(self.all_params),
                   **probe.hooks(self.timed))
        return ctx

    def launch(self) -> Launch:
        raise NotImplementedError(f"{type(self).__name__}.launch()")

    # ---- derived names -------------------------------------------------------------------------------
    def _shown(self, name: str) -> bool:
        """Whether field `name` is part of the spec's names (a late field only away from its default)."""
        if name not in self.late_fields:
            return True
        f = next(f for f in dataclasses.fields(self) if f.name == name)
        return getattr(self, name) != f.default

    @property
    def spec_repr(self) -> str:
        """Canonical text of the spec (family, template, every field in declaration order; late fields only
        away from their defaults): hashed into the URI and embedded in the generated source."""
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if self._shown(f.name))
        return f"{self.family}[{self.template}]({fields})"

    @property
    def hash8(self) -> str:
        return hashlib.sha256(self.spec_repr.encode()).hexdigest()[:8]

    @property
    def uri(self) -> str:
        """``<family>_<field><value>..._<8hex>``, a valid C identifier, e.g. gemv_int4_n18944_k3584_<8hex>."""
        parts = ([self.family] + [_uri_part(n, getattr(self, n)) for n in self.uri_fields if self._shown(n)]
                 + ["timed"] * self.timed + [self.hash8])
        return re.sub(r"[^0-9A-Za-z_]", "_", "_".join(parts))

    @property
    def entry(self) -> str:
        return self.uri

    @property
    def all_params(self) -> tuple[Param, ...]:
        """The parameters the kernel is compiled with: ``kernel_params``, then the probe when timed."""
        return self.kernel_params + ((PROBE_PARAM,) if self.timed else ())

    @property
    def signature(self) -> tuple[tuple[str, str], ...]:
        """(name, kind) per kernel parameter: what the driver packs launch arguments by."""
        return tuple((p.name, p.kind) for p in self.all_params)

    # ---- construction from text (CLI, tuned results) ----------------------------------------------------
    @classmethod
    def field_types(cls) -> dict[str, type]:
        return _field_types(cls)

    @classmethod
    def parameters(cls) -> dict[str, tuple[type, object]]:
        """name -> (type, default); default is dataclasses.MISSING for a required parameter. ``timed``
        comes last, and only for a family whose template has the probe hooks."""
        hints = cls.field_types()
        fields = [f for f in dataclasses.fields(cls) if f.name != "timed"]
        fields += [f for f in dataclasses.fields(cls) if f.name == "timed" and cls.timeable]
        return {f.name: (hints[f.name], f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING))
                for f in fields}

    @classmethod
    def typed_params(cls, kv: dict) -> dict:
        """``kv`` with every text value coerced to its field's type; SpecError names unknown parameters."""
        params = cls.parameters()
        unknown = sorted(set(kv) - set(params))
        if unknown:
            raise SpecError(f"{cls.family}: unknown parameter(s) {', '.join(unknown)} "
                            f"(known: {', '.join(params)})")
        return {n: coerce(cls.family, n, params[n][0], v) if isinstance(v, str) else v for n, v in kv.items()}

    @classmethod
    def from_params(cls, **kv) -> "KernelSpec":
        """Build and validate a spec; text values are coerced to the field's type ("4", "true", "1,2")."""
        values = cls.typed_params(kv)
        missing = [n for n, (_, d) in cls.parameters().items() if d is dataclasses.MISSING and n not in values]
        if missing:
            raise SpecError(f"{cls.family}: missing required parameter(s) {', '.join(missing)}")
        spec = cls(**values)
        spec.validate()
        return spec


def whole_splits(k: int, unit: int, most: int) -> int:
    """The most splits of k, at most `most`, that cut it into whole `unit`s (how a small test model's shapes
    shrink a configured K split)."""
    splits = most
    while splits > 1 and k % (unit * splits):
        splits -= 1
    return splits


def cpp_params(params) -> str:
    """The C++ parameter list, one parameter per line (the template writes ``entry(`` before it)."""
    return "\n" + ",\n".join(f"        {p.declaration()}" for p in params)


@functools.cache
def _field_types(cls) -> dict[str, type]:
    """Resolved annotations of the dataclass fields (string annotations under `from __future__`)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _uri_part(name: str, value) -> str:
    """n18944, fast1, tile4x8; a str field shows its value alone (epilogue "swiglu" -> swiglu)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return f"{name}{int(value)}"
    if isinstance(value, tuple):
        return name + "x".join(str(v) for v in value)
    return f"{name}{value}"


def _check_type(family: str, name: str, tp, value) -> None:
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            raise SpecError(f"{family}.{name} must be a tuple, got {value!r}")
        elems = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(elems) != len(value):
            raise SpecError(f"{family}.{name} must have {len(elems)} elements, got {value!r}")
        for i, (t, v) in enumerate(zip(elems, value)):
            _check_type(family, f"{name}[{i}]", t, v)
        return
    if tp not in _SCALARS:
        raise SpecError(f"{family}.{name}: field type {tp!r} is not a template parameter type "
                        f"(bool, int, float, str or tuples of them)")
    ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    if tp is float and _is_int(value):
        ok = False  # 1 and 1.0 repr differently: keep one spelling per spec
    if not ok:
        raise SpecError(f"{family}.{name} must be {tp.__name__}, got {value!r}")
    if tp is float and not math.isfinite(value):
        raise SpecError(f"{family}.{name} must be finite, got {value!r}")


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce(family: str, name: str, tp, text: str):
    """Parse ``text`` as field type ``tp``: ints accept 0x.., bools true/false/1/0, tuples are
    comma-separated."""
    try:
        if typing.get_origin(tp) is tuple:
            args = typing.get_args(tp)
            items = [s.strip() for s in text.split(",") if s.strip()] if text.strip() else []
            elems = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
            if len(elems) != len(items):
                raise ValueError(f"expected {len(elems)} comma-separated values")
            return tuple(coerce(family, name, t, s) for t, s in zip(elems, items))
        if tp is bool:
            low = text.strip().lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise ValueError("expected true/false")
        if tp is int:
            return int(text, 0)
        if tp is float:
            return float(text)
        return text
    except ValueError as e:
        raise SpecError(f"{family}.{name}: cannot parse {text!r} as {getattr(tp, '__name__', tp)}: {e}") from None


def parse_params(items) -> dict[str, str]:
    """["k=v", ...] -> {k: v} (values stay text; from_params coerces them per field)."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"parameter {item!r} is not of the form name=value")
        parsed[key.strip()] = value.strip()
    return parsed
