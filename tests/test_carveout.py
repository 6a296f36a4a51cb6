"""config launch.smem_carveout reaches each kernel loaded: ``driver.load`` asks the driver for that shared-memory
share on the function (a stand-in for the driver API records the calls); -1 leaves the driver's own choice.
No GPU needed."""

import types

import pytest

from nanoqwen.runtime import driver


@pytest.mark.parametrize("carveout, expected", [(100, [100]), (0, [0]), (-1, [])])
def test_load_sets_the_preferred_carveout(monkeypatch, carveout, expected):
    real, calls = driver.cu, []
    ok = real.CUresult.CUDA_SUCCESS
    fake = types.SimpleNamespace(
        CUresult=real.CUresult, CUfunction_attribute=real.CUfunction_attribute,
        cuModuleLoadData=lambda image: (ok, "module"),
        cuModuleGetFunction=lambda module, entry: (ok, "function"),
        cuFuncSetAttribute=lambda fn, attr, value: calls.append((fn, attr, value)) or (ok,))
    monkeypatch.setattr(driver, "cu", fake)
    monkeypatch.setattr(driver, "device", lambda: None)
    monkeypatch.setattr(driver, "_MODULES", {})
    built = types.SimpleNamespace(cubin=b"cubin", entry="k", spec=None, signature=())
    fn = driver.load(built, carveout=carveout)
    assert fn.handle == "function"
    attr = real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    assert calls == [("function", attr, v) for v in expected]


@pytest.mark.parametrize("threads, registers, static, dynamic, percent", [
    (128, 168, 7373, 0, 11),        # the CUDA-core gate_up: 3 CTAs (registers) of 8.2 KB -> 25 of 228 KB
    (256, 122, 18698, 0, 17),       # the tensor-core gate_up: 2 CTAs of 19.3 KB
    (256, 64, 10650, 0, 21),        # the CUDA-core down: 4 CTAs of 11.4 KB
    (128, 32, 1024, 200 * 1024, 89),  # one CTA of 202 KB: shared memory, not registers, bounds it
])
def test_fitted_carveout_holds_the_ctas_registers_allow(monkeypatch, threads, registers, static, dynamic, percent):
    """FIT_CARVEOUT: the least shared-memory share that still holds every CTA the registers and threads let an
    SM run (each CTA's static + dynamic shared memory + the 1 KB the system reserves), in whole percent of 228 KB."""
    real, calls = driver.cu, []
    ok, A = real.CUresult.CUDA_SUCCESS, real.CUfunction_attribute
    attrs = {A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: static, A.CU_FUNC_ATTRIBUTE_NUM_REGS: registers}
    fake = types.SimpleNamespace(
        CUresult=real.CUresult, CUfunction_attribute=A,
        cuFuncGetAttribute=lambda attr, fn: (ok, attrs[attr]),
        cuFuncSetAttribute=lambda fn, attr, value: calls.append(value) or (ok,))
    monkeypatch.setattr(driver, "cu", fake)
    fn = driver.Function("function", "k")
    fn._fit_carveout(threads, dynamic)
    assert calls == [percent] and fn._carved == dynamic
