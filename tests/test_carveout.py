"""``driver.load(built, carveout=...)`` asks the driver for that shared-memory share on the function (a stand-in for
the driver API records the calls) and the function reports it; -1, the default, leaves the driver's own choice. No
GPU needed (which kernels a session gives which split: tests/test_decoder_plan.py, test_session_wires_the_parts)."""

import types

import pytest

from nanoqwen.runtime import driver


@pytest.mark.parametrize("carveout, expected", [(100, [100]), (43, [43]), (0, [0]), (-1, [])])
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
    assert fn.handle == "function" and fn.carveout == carveout
    attr = real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    assert calls == [("function", attr, v) for v in expected]
    calls.clear()
    assert driver.load(built).carveout == -1 and calls == []   # by default the driver's choice
