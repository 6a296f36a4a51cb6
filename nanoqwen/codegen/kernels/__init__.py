"""Kernel families. Each family is a KernelSpec subclass in ``kernels/<module>.py``, registered here as
``family name -> "module:Class"`` (imported lazily, so one family's import cost stays its own).

Adding a family:
1. ``templates/<name>.cu.j2``: CUDA only; ``#include`` nothing but ``templates/*.cuh`` (NVRTC gets them
   in memory, no CUDA headers); declare the kernel ``extern "C" __global__ void {{ entry }}({{ params }})``
   (the parameter list is generated from the spec); emit every template parameter as a constant
   (``{{ x | c }}`` writes a C literal: true/false, 1.5f, {1, 2}) and switch variants with ``if constexpr``
   on those constants, never with Jinja tags; ``static_assert`` each divisibility assumption.
2. ``kernels/<module>.py``: ``@dataclass(frozen=True) class FooSpec(KernelSpec)`` with ClassVars
   ``family``, ``template``, ``uri_fields`` and ``kernel_params`` (``inp``/``out``/``scalar`` Params in
   C++ order; a property where variants differ); fields are the template parameters (bool/int/float/str
   or tuples of them, defaults allowed); ``validate()`` calls ``super().validate()`` then raises SpecError
   naming the field for impossible combinations; ``launch()`` returns ``Launch(grid, block, smem)``.
3. If the model needs it, the module defines
       def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]
   (the GPU's SM count and shared memory come from ``gpu``, never from constants; called once per module by ``codegen.manifest.model_kernels``; tests/test_kernels_compile.py then compiles
   every spec it returns for the 7B and the test model and asserts no spills and no local memory).
4. One line in FAMILIES below. ``nanoqwen-gen list`` / ``emit <family> --param k=v`` work at once.
5. A kernel of the decode step also gets a timed variant (the in-graph timeline, codegen/probe.py): set
   ``timeable = True`` and place the three hooks in the template, ``{{ probe_code }}`` before the kernel,
   ``{ {{- probe_enter }}`` as its opening brace and ``{{ probe_wait }}`` right after ``pdl_wait();`` (empty
   strings when untimed, so the untimed source does not change)."""

from __future__ import annotations

import importlib

from ..spec import KernelSpec, SpecError

FAMILIES: dict[str, str] = {
    "copy": "copy:CopySpec",
    "gemv_int4": "gemv:GemvInt4Spec",
    "attention_decode": "attention:AttentionDecodeSpec",
    "attention_combine": "attention:AttentionCombineSpec",
    "rope_append": "attention:RopeAppendSpec",
    "gemm_int4": "gemm:GemmInt4Spec",
    "gemm_wgmma": "gemm_wgmma:GemmWgmmaSpec",
    "rmsnorm_prefill": "gemm:RmsnormPrefillSpec",
    "rope_append_prefill": "attention_prefill:RopeAppendPrefillSpec",
    "attention_prefill": "attention_prefill:AttentionPrefillSpec",
    "attention_prefill_combine": "attention_prefill:AttentionPrefillCombineSpec",
    "embed": "embed:EmbedSpec",
    "embed_prefill": "embed_prefill:EmbedPrefillSpec",
    "lm_head_argmax": "lm_head:LmHeadArgmaxSpec",
}


def family(name: str) -> type[KernelSpec]:
    """The spec class registered as ``name``; SpecError lists the known families otherwise."""
    try:
        target = FAMILIES[name]
    except KeyError:
        raise SpecError(f"unknown kernel family {name!r} (known: {', '.join(sorted(FAMILIES))})") from None
    mod_name, _, cls = target.partition(":")
    try:
        return getattr(module(mod_name), cls)
    except AttributeError:
        raise SpecError(f"kernels/__init__.py registers {name} as {target}, but kernels/{mod_name}.py "
                        f"defines no {cls}") from None


def from_params(name: str, **kv) -> KernelSpec:
    """The registered family's spec built from keyword values (text values are coerced per field)."""
    return family(name).from_params(**kv)


def modules() -> list[str]:
    """Registered family modules, each once, in registration order."""
    return list(dict.fromkeys(t.partition(":")[0] for t in FAMILIES.values()))


def module(name: str):
    """The family module ``kernels/<name>.py``; a registered but missing module is a SpecError."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise  # the module exists but imports something missing: show the real traceback
        raise SpecError(f"kernels/__init__.py registers a family in kernels/{name}.py, which does not exist") from None
