""".nanoqwen writer/reader: round trip, and every corruption is a one-line error naming the file and field."""

import os
import re
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from _corrupt import denied, fifo, flip_payload_bytes, rewrite_header, symlink_loop

from nanoqwen import checksum
from nanoqwen.config import default
from nanoqwen.dims import ModelDims
from nanoqwen.nqfile import (ALIGNMENT, FP16, HEADER_BYTES, INT4, NanoqwenFile, NqFileError, TensorInfo, Writer,
                             VERSION, _encode_table, expected_tensors, weight_tensors)
from nanoqwen.quant import LAYOUT_ID, pack, quantize

CFG = default()
DIMS = ModelDims(hidden=128, layers=1, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=96,
                 max_positions=512, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


def _tensors(dims: ModelDims, seed: int = 0):
    """name -> (packed, scales) for INT4, fp16 array otherwise; fresh random values."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (tag, shape) in weight_tensors(dims).items():
        if tag == INT4:
            q, s = quantize(rng.standard_normal(shape).astype(np.float32))
            out[name] = (pack(q), s)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float16)
    return out


def _write(path: Path, dims=DIMS, synthetic=False, order=None, seed=0, blobs=None):
    t = _tensors(dims, seed)
    with Writer(path, dims, synthetic=synthetic, blobs=blobs) as w:
        for name in order or t:
            v = t[name]
            w.add_int4(name, *v) if isinstance(v, tuple) else w.add_fp16(name, v)
    return t


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "m.nanoqwen"
    _write(path)
    return path


def _rewrite_table(path: Path, edit) -> None:
    """Apply ``edit(list[TensorInfo]) -> list[TensorInfo]`` to the table, keeping its size and fixing CRCs."""
    f = NanoqwenFile(path)
    h = f.header
    entries = edit(sorted(f.tensors.values(), key=lambda e: e.offset))
    table = _encode_table(entries)
    del f
    data = bytearray(path.read_bytes())
    data[h["table_offset"]:h["table_offset"] + len(table)] = table
    path.write_bytes(bytes(data))
    rewrite_header(path, table_bytes=len(table), table_crc=zlib.crc32(table), entry_count=len(entries))


def _fails(path: Path, pattern: str, verify=False):
    with pytest.raises(NqFileError) as ei:
        f = NanoqwenFile(path)
        if verify:
            f.verify()
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    assert re.search(pattern, msg), msg
    return msg


def test_round_trip(tmp_path):
    path = tmp_path / "m.nanoqwen"
    order = list(_tensors(DIMS))[::-1]  # any add order; the file keeps the expected order
    t = _write(path, synthetic=True, order=order)
    f = NanoqwenFile(path)
    f.verify()
    assert f.dims == DIMS and f.synthetic
    assert f.header["layout_id"] == LAYOUT_ID and f.header["group_size"] == CFG.quant.group_size
    assert list(f.tensors) == list(expected_tensors(DIMS))
    for name, v in t.items():
        if isinstance(v, tuple):
            packed, scales = f.int4(name)
            np.testing.assert_array_equal(packed, v[0])
            np.testing.assert_array_equal(scales, v[1])
            assert packed.dtype == np.uint32 and not packed.flags.writeable and not packed.flags.owndata
        else:
            np.testing.assert_array_equal(f.array(name), v)
    for e in f.tensors.values():
        assert e.offset % ALIGNMENT == 0
    assert f.header["data_offset"] % ALIGNMENT == 0 and f.size == path.stat().st_size


BLOBS = {"tokenizer.json": b'{"model": {}}' * 50, "empty": b"", "notes.txt": bytes(range(256)) * 3}


def test_blobs_round_trip(tmp_path):
    path = tmp_path / "m.nanoqwen"
    _write(path, blobs=BLOBS)
    f = NanoqwenFile(path)
    f.verify()
    assert f.version == VERSION == 2 and list(f.blobs) == list(BLOBS)
    assert all(f.blob(n) == data for n, data in BLOBS.items()) and f.blob("missing") is None
    assert list(f.tensors) == list(expected_tensors(DIMS))  # blobs stay out of the tensor view
    assert all(e.offset % ALIGNMENT == 0 and e.tag_name == "BYTES" for e in f.blobs.values())


def test_corrupt_blob_is_named(tmp_path):
    path = tmp_path / "m.nanoqwen"
    _write(path, blobs=BLOBS)
    e = NanoqwenFile(path).blobs["notes.txt"]
    data = bytearray(path.read_bytes())
    data[e.offset + 100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(NqFileError, match=r"m\.nanoqwen: blob notes\.txt: payload checksum"):
        NanoqwenFile(path).blob("notes.txt")
    _fails(path, r": blob notes\.txt: payload checksum", verify=True)


def test_version_1_file_still_opens(good):
    rewrite_header(good, version=1)
    f = NanoqwenFile(good)
    f.verify()
    assert f.version == 1 and f.blobs == {}


def test_version_1_file_with_blobs_refused(tmp_path):
    path = tmp_path / "m.nanoqwen"
    _write(path, blobs=BLOBS)
    rewrite_header(path, version=1)
    _fails(path, r": blob tokenizer\.json: format version 1 has no blobs")


def test_blob_names_checked(tmp_path):
    for name in ("", "model.norm.weight"):
        with pytest.raises(NqFileError, match="a blob needs a name of its own"):
            Writer(tmp_path / "m.nanoqwen", DIMS, blobs={name: b"x"})


def test_parallel_check_finds_flips_in_any_chunk(good, monkeypatch):
    """Payloads cut into many chunks across the pool: a flip in a middle chunk of one tensor is found, named,
    and the tensors checked before it pass."""
    monkeypatch.setattr(checksum, "CHUNK", 1000)
    target = "model.layers.0.mlp.up_proj.weight"
    assert NanoqwenFile(good).tensors[target].nbytes > 5 * 1000
    flip_payload_bytes(good, target, start=2500)  # in the third chunk
    f = NanoqwenFile(good)
    with f.checker(workers=3) as c:
        for name in f.tensors:
            if name == target:
                break
            c.check(name)
        with pytest.raises(NqFileError, match=rf"{re.escape(str(good))}: tensor {re.escape(target)}: payload checksum"):
            c.check(target)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    dims = ModelDims(**{**DIMS.to_dict(), "tie_embeddings": True})
    _write(tmp_path / "t.nanoqwen", dims)
    f = NanoqwenFile(tmp_path / "t.nanoqwen")
    assert f.dims.tie_embeddings and "lm_head.weight" not in f.tensors


def test_wrong_magic(good):
    data = bytearray(good.read_bytes())
    data[:8] = b"GGUF\0\0\0\0"
    good.write_bytes(bytes(data))
    _fails(good, r": magic: .*not a \.nanoqwen file")


def test_unknown_version(good):
    rewrite_header(good, fix_crc=False, version=99)
    _fails(good, r": version: format version 99 is not supported")


def test_bad_header_checksum(good):
    data = bytearray(good.read_bytes())
    data[100] ^= 0x40  # inside the header struct, outside magic/version
    good.write_bytes(bytes(data))
    _fails(good, r": header checksum: ")


def test_unknown_layout_id(good):
    rewrite_header(good, layout_id=2)
    _fails(good, r": layout id: 2 is not 1 \(ValueShuffle\)")


def test_wrong_group_size(good):
    rewrite_header(good, group_size=64)
    _fails(good, r": group size: 64")


def test_unknown_flag(good):
    rewrite_header(good, flags=0x80)
    _fails(good, r": flags: unknown flag bits 0x80")


def test_truncated(good):
    data = good.read_bytes()
    good.write_bytes(data[:-1000])
    _fails(good, r": file size: .*\(truncated\)")
    good.write_bytes(data[:100])
    _fails(good, r": header: file is 100 bytes")
    good.write_bytes(b"")
    _fails(good, r": header: file is 0 bytes")


def test_trailing_bytes(good):
    good.write_bytes(good.read_bytes() + b"\0" * 128)
    _fails(good, r": file size: .*trailing bytes")


def test_bad_table_checksum(good):
    data = bytearray(good.read_bytes())
    data[HEADER_BYTES + 5] ^= 1
    good.write_bytes(bytes(data))
    _fails(good, r": table checksum: ")


def test_bad_tensor_checksum_found_by_verify(good):
    f = NanoqwenFile(good)
    e = f.tensors["model.layers.0.mlp.down_proj.weight"]
    del f
    data = bytearray(good.read_bytes())
    data[e.offset + 17] ^= 0x10
    good.write_bytes(bytes(data))
    NanoqwenFile(good)  # opening checks structure, not payloads
    _fails(good, r": tensor model\.layers\.0\.mlp\.down_proj\.weight: payload checksum", verify=True)


def test_misaligned_offset(good):
    def edit(es):
        e = es[3]
        es[3] = TensorInfo(e.name, e.tag, e.shape, e.offset + 4, e.nbytes, e.crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor \S+: offset \d+ is not 128-byte aligned")


def test_offset_outside_file(good):
    def edit(es):
        e = es[-1]
        es[-1] = TensorInfo(e.name, e.tag, e.shape, e.offset + 1 << 20, e.nbytes, e.crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor lm_head\.weight: payload .* outside the data region")


def test_overlapping_payloads(good):
    def edit(es):
        e = es[2]
        es[2] = TensorInfo(e.name, e.tag, e.shape, es[1].offset, e.nbytes, e.crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor \S+: payload overlaps")


def test_shape_dims_mismatch(good):
    # the header claims a smaller intermediate than the tensors were written for
    rewrite_header(good, intermediate=128)
    _fails(good, r": tensor model\.layers\.0\.mlp\.gate_proj\.weight: shape \[256, 128\] does not match "
                 r"the dims \(\[128, 128\]\)")
    # a bigger one needs more bytes than the file holds: refused before the table is read
    rewrite_header(good, intermediate=384)
    _fails(good, r": dims: the tensors of these dims need [\d,]+ bytes, the data region holds [\d,]+$")


def test_bad_dims_in_header(good):
    rewrite_header(good, kv_heads=3)
    _fails(good, r": dims: .*heads \(2\) not a multiple of kv_heads \(3\)")


def test_wrong_storage_tag(good):
    def edit(es):
        i = next(i for i, e in enumerate(es) if e.name == "model.norm.weight")
        e = es[i]
        es[i] = TensorInfo(e.name, INT4, e.shape, e.offset, e.nbytes, e.crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor model\.norm\.weight: storage INT4 is not FP16")


def test_duplicate_tensor(good):
    def edit(es):
        i = next(i for i, e in enumerate(es) if e.name == "model.norm.weight")
        j = next(i for i, e in enumerate(es) if e.name == "model.layers.0.input_layernorm.weight")
        es[j] = TensorInfo(es[i].name, es[j].tag, es[j].shape, es[j].offset, es[j].nbytes, es[j].crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor model\.norm\.weight: appears twice")


def test_missing_tensor(good):
    _rewrite_table(good, lambda es: [e for e in es if e.name != "model.layers.0.self_attn.k_proj.bias"])
    _fails(good, r": tensor model\.layers\.0\.self_attn\.k_proj\.bias: missing")


def test_unknown_tensor(good):
    def edit(es):
        i = next(i for i, e in enumerate(es) if e.name == "model.norm.weight")
        e = es[i]
        es[i] = TensorInfo("model.norm.weigh", e.tag, e.shape, e.offset, e.nbytes, e.crc)
        return es
    _rewrite_table(good, edit)
    _fails(good, r": tensor model\.norm\.weigh: not a tensor of a model with these dims")


def test_not_a_file(tmp_path):
    with pytest.raises(NqFileError, match=r"missing\.nanoqwen: cannot open"):
        NanoqwenFile(tmp_path / "missing.nanoqwen")


def test_failing_writer_leaves_no_file(tmp_path):
    path = tmp_path / "m.nanoqwen"
    t = _tensors(DIMS)
    with pytest.raises(RuntimeError):
        with Writer(path, DIMS) as w:
            w.add_fp16("model.embed_tokens.weight", t["model.embed_tokens.weight"])
            raise RuntimeError("disk on fire")
    assert list(tmp_path.iterdir()) == []
    # an incomplete model (tensors missing at close) is refused, also without leaving a file
    with pytest.raises(NqFileError, match=r"m\.nanoqwen: \d+ tensors never added"):
        with Writer(path, DIMS) as w:
            w.add_fp16("model.embed_tokens.weight", t["model.embed_tokens.weight"])
    assert list(tmp_path.iterdir()) == []
    # a previous good file under the final name survives a failed rewrite
    _write(path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with Writer(path, DIMS) as w:
            raise RuntimeError("x")
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_writer_rejects_wrong_inputs(tmp_path):
    t = _tensors(DIMS)
    with pytest.raises(NqFileError, match=r"tensor model\.norm\.weight: expected float16 \[128\], got float32"):
        with Writer(tmp_path / "m.nanoqwen", DIMS) as w:
            w.add_fp16("model.norm.weight", t["model.norm.weight"].astype(np.float32))
    with pytest.raises(NqFileError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight: stored as INT4"):
        with Writer(tmp_path / "m.nanoqwen", DIMS) as w:
            w.add_fp16("model.layers.0.mlp.up_proj.weight", np.zeros((256, 128), np.float16))
    with pytest.raises(NqFileError, match=r"tensor model\.norm\.weight: added twice"):
        with Writer(tmp_path / "m.nanoqwen", DIMS) as w:
            w.add_fp16("model.norm.weight", t["model.norm.weight"])
            w.add_fp16("model.norm.weight", t["model.norm.weight"])
    with pytest.raises(NqFileError, match=r"tensor lm_head\.bias: not a tensor of this model"):
        with Writer(tmp_path / "m.nanoqwen", DIMS) as w:
            w.add_fp16("lm_head.bias", np.zeros(96, np.float16))
    assert list(tmp_path.iterdir()) == []


def test_expected_tensors_for_7b():
    from nanoqwen.dims import QWEN25_7B
    exp = expected_tensors(QWEN25_7B)
    int4 = [n for n, (t, _) in exp.items() if t == INT4]
    assert len(int4) == 7 * 28 and len(exp) == 1 + 28 * (2 + 3 + 7 * 2) + 2
    assert exp["model.layers.3.mlp.down_proj.weight"] == (INT4, (3584, 18944))
    assert exp["model.layers.3.mlp.down_proj.weight.scales"] == (FP16, (3584, 148))
    assert exp["model.layers.0.self_attn.k_proj.bias"] == (FP16, (512,))
    assert exp["lm_head.weight"] == (FP16, (152064, 3584))


@pytest.mark.parametrize("field,value", [("layers", 2**31), ("hidden", 2**32 - 1), ("vocab", 2**31),
                                         ("intermediate", 2**31), ("heads", 2**20), ("max_positions", 2**32 - 1)])
def test_huge_dims_refused_before_memory_grows(good, field, value):
    """A CRC-valid header may claim any size; the reader bounds each dimension before it sizes anything."""
    rewrite_header(good, **{field: value})
    tracemalloc.start()
    try:
        _fails(good, rf": dims: model dims: {field}: {value} is outside \[1, \d+\]$")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_dims_within_limits_cannot_exceed_the_file(good):
    """The largest dims the limits allow describe petabytes of tensors: refused from the header, as the
    file cannot hold them, before the table is parsed."""
    rewrite_header(good, layers=1024, hidden=1 << 16, intermediate=1 << 18, vocab=1 << 22)
    tracemalloc.start()
    try:
        _fails(good, r": dims: the tensors of these dims need [\d,]+ bytes, the data region holds [\d,]+$")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # the expected-tensor list of 1024 layers, nothing sized from the shapes


def test_entry_count_bounded_by_the_table(good):
    rewrite_header(good, entry_count=2**32 - 1)
    _fails(good, r": entry count: 4294967295 entries do not fit a \d+-byte table$")


@pytest.mark.parametrize("field,value", [("rope_theta", float("nan")), ("rope_theta", float("inf")),
                                         ("rope_theta", -1e6), ("rope_theta", 0.0), ("rms_eps", float("nan")),
                                         ("rms_eps", float("-inf")), ("rms_eps", -1e-6), ("rms_eps", 1.0)])
def test_non_finite_or_out_of_range_floats_refused(good, field, value):
    rewrite_header(good, **{field: value})
    _fails(good, rf": dims: model dims: {field}: {value} is not a finite number in \(0, [\d.e+-]+\]$")


@pytest.mark.parametrize("make,message", [
    (lambda p, mp: fifo(p), r"not a regular file \(a FIFO\)"),
    (lambda p, mp: p.mkdir(), r"not a regular file \(a directory\)"),
    (lambda p, mp: symlink_loop(p), r"cannot open: too many levels of symbolic links"),
    (lambda p, mp: os.symlink("/dev/zero", p), r"not a regular file \(a character device\)"),
    (lambda p, mp: denied(_write(p) and p, mp), r"cannot open: permission denied"),
])
def test_opens_only_regular_files(tmp_path, monkeypatch, make, message):
    """Never a hang on a FIFO, never an endless read of a device, and the real reason for what exists."""
    path = tmp_path / "m.nanoqwen"
    make(path, monkeypatch)
    t0 = time.monotonic()
    _fails(path, message + "$")
    assert time.monotonic() - t0 < 5
