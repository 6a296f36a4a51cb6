"""A kernel's parameters are declared once, on its spec (``kernel_params``): for every family the rendered
``__global__`` declaration is exactly that list (parsed back here independently of the generator), the
driver packs launch arguments by the same list and refuses a wrong argument set before any launch, and the
templates are plain C++ (no Jinja branches in kernel bodies, no runs of blank lines). No GPU needed."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from nanoqwen import codegen, config, paths
from nanoqwen.codegen import kernels
from nanoqwen.codegen.kernels import attention, gemv
from nanoqwen.codegen.kernels.copy import CopySpec
from nanoqwen.codegen.spec import KernelSpec, Param, SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
SPECS = list(dict.fromkeys(
    codegen.model_kernels(QWEN25_7B, CFG) + codegen.model_kernels(tiny_dims(), CFG) + gemv.variants(QWEN25_7B, CFG)
    + [CopySpec(), dataclasses.replace(attention.decode_specs(QWEN25_7B, CFG)[1], pipeline="plain")]))
_DECL = re.compile(r"^(const )?(\w+)(\*)?( __restrict__)? (\w+)$")


def test_every_family_is_covered():
    assert {s.family for s in SPECS} == set(kernels.FAMILIES)


def declared(src: str, entry: str) -> list[Param]:
    """The parameters of ``entry``'s definition in ``src``, parsed back into Params."""
    m = re.search(re.escape(entry) + r"\((.*?)\)\s*\{", src, re.S)
    assert m, f"{entry} not defined in the rendered source"
    params = []
    for text in re.sub(r"/\*.*?\*/", "", m.group(1)).split(","):
        d = _DECL.match(" ".join(text.split()))
        assert d, f"{entry}: cannot parse parameter {text!r}"
        const, ctype, star, restrict, name = d.groups()
        params.append(Param(name, ctype, pointer=bool(star), const=bool(const), restrict=bool(restrict)))
    return params


@pytest.mark.parametrize("spec", SPECS, ids=[s.uri for s in SPECS])
def test_rendered_declaration_is_the_spec_declaration(spec):
    src = codegen.render(spec)
    assert declared(src, spec.entry) == [dataclasses.replace(p, note="") for p in spec.kernel_params]
    assert spec.signature == tuple((p.name, p.kind) for p in spec.kernel_params)
    assert "\n\n\n" not in src, "runs of blank lines in the emitted source"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.family == "gemv_int4"], ids=lambda s: s.uri)
def test_gemv_variant_sees_the_parameters_it_lacks_as_null(spec):
    src = codegen.render(spec)
    taken = {p.name for p in spec.kernel_params}
    nulls = set(re.findall(r"^constexpr (?:const )?\w+\* (\w+) = nullptr;$", src, re.M))
    assert taken.isdisjoint(nulls) and taken | nulls == {"w0", "s0", "w1", "s1", "h", "norm_w", "x", "bias", "y",
                                                         "state", "page_table", "rope_cos", "rope_sin", "q_rot",
                                                         "k_pool", "v_pool"}


def test_templates_have_no_jinja_branches():
    for path in sorted(paths.data_path("templates").glob("*.j2")):
        assert "{%" not in path.read_text(), f"{path.name}: a Jinja tag (variants are if constexpr in C++)"


def _good_args(spec) -> dict:
    return {name: 4096 * (i + 1) if kind == "ptr" else 3 for i, (name, kind) in enumerate(spec.signature)}


@pytest.mark.parametrize("spec", SPECS, ids=[s.uri for s in SPECS])
def test_launch_packing_follows_the_declaration(spec):
    n = len(spec.signature)
    memory, params = driver.pack_args(spec.signature, _good_args(spec), spec.uri)
    assert list(memory[:2]) == list(_good_args(spec).values())[:2]
    assert params == memory.ctypes.data + 8 * n and list(memory[n:2 * n]) == [memory.ctypes.data + 8 * i for i in range(n)]
    first, (last, last_kind) = spec.signature[0][0], spec.signature[-1]
    bad = {"missing": {k: v for k, v in _good_args(spec).items() if k != last},
           "unexpected": {**_good_args(spec), "stray": 1},
           "must be": {**_good_args(spec), first: 1.5},
           "out of range": {**_good_args(spec), last: -1 if last_kind in ("ptr", "u32", "u64") else 2**31}}
    for what, args in bad.items():
        with pytest.raises(driver.CudaError) as e:
            driver.pack_args(spec.signature, args, spec.uri)
        assert spec.uri in str(e.value) and what in str(e.value)
        assert (last if what in ("missing", "out of range") else "stray" if what == "unexpected" else first) \
            in str(e.value)


def test_scalar_kinds_and_bad_declarations():
    assert [Param("n", t, pointer=False).kind for t in ("int", "u32", "u64", "float")] == ["i32", "u32", "u64", "f32"]
    with pytest.raises(SpecError, match="scalar type 'size_t'"):
        Param("n", "size_t", pointer=False)

    @dataclasses.dataclass(frozen=True)
    class Undeclared(KernelSpec):
        family = "undeclared"
        template = "copy.cu.j2"
    with pytest.raises(SpecError, match="Undeclared declares no kernel_params"):
        Undeclared().validate()

    @dataclasses.dataclass(frozen=True)
    class Twice(CopySpec):
        kernel_params = CopySpec.kernel_params + CopySpec.kernel_params[:1]
    with pytest.raises(SpecError, match="repeats a name"):
        Twice().validate()


@pytest.mark.parametrize("spec", [s for s in SPECS if s.family in ("gemv_int4", "lm_head_argmax")][:3],
                         ids=lambda s: s.uri)
def test_function_launch_refuses_before_touching_the_driver(spec):
    """The runtime's call shape fn.launch(spec.launch(), stream, pdl, **args): a wrong argument set raises
    from the packing, before any driver call (the handle here is not even a real function)."""
    fn = driver.Function(None, spec.entry, spec.signature, spec.uri)
    args = _good_args(spec)
    args.pop(spec.signature[0][0])
    with pytest.raises(driver.CudaError, match=rf"{spec.uri}: .*missing \['{spec.signature[0][0]}'\]"):
        fn.launch(spec.launch(), None, True, **args)


def test_fast_packing_is_the_checked_packing():
    """The struct fast path and the converting, checking path lay out the same bytes; what struct would
    take but the signature refuses (a bool) still goes to the check."""
    packer = driver.ArgPacker((("p", "ptr"), ("i", "i32"), ("u", "u32"), ("q", "u64"), ("f", "f32")), "k")
    args = {"p": 2**64 - 1, "i": -5, "u": 2**32 - 1, "q": 7, "f": 0.5}
    memory, params = packer.pack(args)
    slots = memory[:5]
    assert slots.tobytes() == packer.struct.pack(*packer._checked(args))
    assert slots.view(np.int32)[2] == -5 and slots.view(np.float32)[8] == 0.5 and slots[0] == 2**64 - 1
    assert params == memory.ctypes.data + 40 and memory[5:10].tolist() == [memory.ctypes.data + 8 * i for i in range(5)]
    assert driver.ArgPacker((), "k").pack({})[1] == 0   # no parameters: NULL kernelParams
    typed = {"p": np.uint64(2**64 - 1), "i": np.int32(-5), "u": np.uint32(2**32 - 1), "q": np.int64(7),
             "f": np.float32(0.5)}
    assert packer.pack(typed)[0][:5].tobytes() == slots.tobytes()
    with pytest.raises(driver.CudaError, match="argument 'i' must be an integer, got bool"):
        packer.pack({**args, "i": True})
