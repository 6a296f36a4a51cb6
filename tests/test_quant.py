"""INT4 quantizer and ValueShuffle packing: properties against DESIGN.md section 3."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from nanoqwen.config import default
from nanoqwen.quant import BIT_OFFSETS, FP16_MAX, QuantError, dequantize, pack, quantize, to_fp16, unpack

Q = default().quant
G = Q.group_size
SPEC_OFFSETS = (0, 16, 4, 20, 8, 24, 12, 28)  # DESIGN.md: logical lane k at bit offset [..][k]

shapes = st.tuples(st.integers(1, 9), st.integers(1, 3))  # rows, groups


def _weights(seed: int, rows: int, groups: int, scale: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, groups * G)) * scale).astype(np.float32)


def _check_error_bound(w: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> None:
    """|w - dequant| <= s16/2 per element, except where |w| > 7.5 s16 (only possible when a subnormal fp16
    scale rounded down): there q = +-7 and the error is |w| - 7 s16."""
    deq = dequantize(packed, scales)
    s = np.repeat(scales.astype(np.float32), G, axis=1)
    err = np.abs(w - deq)
    clamped = np.abs(w) > 7.5 * s
    assert (err[~clamped] <= s[~clamped] / 2).all(), (err - s / 2).max()
    assert np.allclose(err[clamped], np.abs(w[clamped]) - 7 * s[clamped], rtol=0, atol=1e-30)
    normal = scales.astype(np.float32) >= np.finfo(np.float16).tiny
    assert not clamped[np.repeat(normal, G, axis=1)].any(), "a normal-range scale must never clamp"


def test_lane_map_matches_spec():
    assert BIT_OFFSETS == SPEC_OFFSETS


@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(1, 4))
def test_pack_unpack_round_trip(seed, rows, words):
    q = np.random.default_rng(seed).integers(-8, 8, (rows, 8 * words)).astype(np.int8)
    packed = pack(q)
    assert packed.dtype == np.uint32 and packed.shape == (rows, words)
    np.testing.assert_array_equal(unpack(packed), q)


@given(st.lists(st.integers(-8, 7), min_size=8, max_size=8))
def test_lane_map_bit_for_bit(lanes):
    """Build the word by hand from the spec offsets; pack must produce it and unpack must invert it."""
    word = 0
    for k, v in enumerate(lanes):
        word |= (v & 0xF) << SPEC_OFFSETS[k]
    q = np.array([lanes], dtype=np.int8)
    assert int(pack(q)[0, 0]) == word
    np.testing.assert_array_equal(unpack(np.array([[word]], dtype=np.uint32))[0], lanes)


def test_even_lanes_low_half_odd_lanes_high_half():
    q = np.array([[7, 0, 7, 0, 7, 0, 7, 0]], dtype=np.int8)
    assert int(pack(q)[0, 0]) == 0x7777
    assert int(pack(np.array([[0, 1, 0, 1, 0, 1, 0, 1]], dtype=np.int8))[0, 0]) == 0x11110000


def test_all_sixteen_nibbles_sign_extend():
    for nib in range(16):
        word = sum(nib << off for off in SPEC_OFFSETS)
        got = unpack(np.array([[word]], dtype=np.uint32))
        assert (got == (nib - 16 if nib >= 8 else nib)).all(), nib


@given(st.integers(0, 2**32 - 1), shapes, st.sampled_from([1e-2, 1.0, 300.0, 4e4]))
def test_quantize_error_at_most_half_scale(seed, shape, scale):
    w = _weights(seed, *shape, scale)
    q, s = quantize(w)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (shape[0], shape[1])
    assert q.min() >= -7 and q.max() <= 7  # never -8
    # the stored scale is fp16(absmax / 7) computed in fp32 (class (a): the quantizer's own arithmetic)
    absmax = np.abs(w.reshape(shape[0], shape[1], G)).max(axis=2)
    np.testing.assert_array_equal(s, (absmax / np.float32(7)).astype(np.float16))
    _check_error_bound(w, pack(q), s)
    # quantization uses the stored fp16 scale, so dequantization is exactly q * f32(scale) (class (a): each
    # product of a small integer and an fp16 value is exact in fp32)
    np.testing.assert_array_equal(dequantize(pack(q), s),
                                  q.astype(np.float32) * np.repeat(s.astype(np.float32), G, axis=1))


@given(st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1e-5, 3e-7, 1e-8, 1e-9]))
def test_tiny_subnormal_scale_groups(seed, scale):
    w = _weights(seed, 3, 2, scale)
    q, s = quantize(w)
    assert q.min() >= -7 and q.max() <= 7
    _check_error_bound(w, pack(q), s)
    np.testing.assert_array_equal(q[np.repeat(s == 0, G, axis=1)], 0)


def test_extreme_magnitudes_near_fp16_max():
    w = _weights(1, 2, 2, 1.0)
    w[0, 5] = FP16_MAX * 7  # scale exactly 65504: the largest representable
    w[1, G + 3] = -FP16_MAX * 6.5
    q, s = quantize(w)
    assert s[0, 0] == np.float16(FP16_MAX) and q[0, 5] == 7 and q[1, G + 3] == -7
    assert np.isfinite(dequantize(pack(q), s)).all()
    _check_error_bound(w, pack(q), s)


def test_scale_overflow_rejected():
    w = _weights(1, 2, 2, 1.0)
    w[1, G + 1] = FP16_MAX * 7 * 1.01
    with pytest.raises(QuantError, match=r"^blk\.w: .*row 1.*fp16 scale range"):
        quantize(w, name="blk.w")


def test_all_zero_groups():
    w = _weights(2, 3, 3, 1.0)
    w[1, G:2 * G] = 0
    w[2] = 0
    q, s = quantize(w)
    assert s[1, 1] == 0 and (s[2] == 0).all() and (s[0] > 0).all()
    assert (q[1, G:2 * G] == 0).all() and (q[2] == 0).all()
    assert (dequantize(pack(q), s)[2] == 0).all()


@given(st.integers(0, 2**32 - 1), st.integers(0, G - 1), st.floats(10, 1e4))
def test_single_outlier(seed, col, mag):
    w = _weights(seed, 1, 1, 0.01)
    w[0, col] = mag
    q, s = quantize(w)
    assert q[0, col] == 7 and s[0, 0] == np.float16(np.float32(mag) / np.float32(7))
    _check_error_bound(w, pack(q), s)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(bad):
    w = _weights(3, 2, 2, 1.0)
    w[1, G + 7] = bad
    with pytest.raises(QuantError, match=r"^model\.layers\.0\.mlp\.up_proj\.weight: non-finite .*row 1"):
        quantize(w, name="model.layers.0.mlp.up_proj.weight")


def test_ragged_k_rejected():
    with pytest.raises(QuantError, match="multiple of the group size"):
        quantize(np.ones((2, G + 8), np.float32), name="x")


def test_to_fp16_rejects_out_of_range():
    np.testing.assert_array_equal(to_fp16(np.array([1.5, -FP16_MAX])), np.array([1.5, -FP16_MAX], np.float16))
    with pytest.raises(QuantError, match=r"^model\.norm\.weight: value 70000 is outside the fp16 range"):
        to_fp16(np.array([1.0, 7e4], np.float32), "model.norm.weight")
    with pytest.raises(QuantError, match="non-finite"):
        to_fp16(np.array([np.nan]), "b")
