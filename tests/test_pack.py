"""`nanoqwen pack` on tiny generated HF directories, `pack --random`, `inspect`; HF reader errors."""

import json
import os
import re
import shutil
import struct

import numpy as np
import pytest

from nanoqwen import pack as pack_mod
from nanoqwen.cli.main import main
from nanoqwen.dims import DimsError
from nanoqwen.hf import HFCheckpoint, HFError
from nanoqwen.nqfile import INT4, NanoqwenFile, expected_tensors
from nanoqwen.pack import pack_hf, pack_random
from nanoqwen.quant import QuantError, quantize, to_fp16, unpack

from _corrupt import fifo, symlink_loop
from _hf_dirs import TINY, write_hf_dir


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Row blocks of a few rows, so every tensor is streamed in many blocks across the thread pool."""
    monkeypatch.setattr(pack_mod, "BLOCK_ELEMS", 3 * 256)


def _check_packed(path, weights):
    f = NanoqwenFile(path)
    f.verify()
    assert f.dims == TINY and not f.synthetic
    exp = expected_tensors(TINY)
    for name, w in weights.items():
        if exp[name][0] == INT4:
            q, s = quantize(w)
            packed, scales = f.int4(name)
            np.testing.assert_array_equal(unpack(packed), q, err_msg=name)
            np.testing.assert_array_equal(scales, s, err_msg=name)
        else:
            np.testing.assert_array_equal(f.array(name), to_fp16(w), err_msg=name)


@pytest.mark.parametrize("dtype,shards", [("bf16", 3), ("fp32", 1), ("fp16", 2)])
def test_pack_equals_quantize_of_original(tmp_path, dtype, shards):
    weights = write_hf_dir(tmp_path / "hf", dtype=dtype, shards=shards, seed=shards)
    out = tmp_path / "m.nanoqwen"
    pack_hf(HFCheckpoint(tmp_path / "hf"), out, workers=2)
    _check_packed(out, weights)


def test_cli_pack_and_inspect(tmp_path, capsys):
    weights = write_hf_dir(tmp_path / "hf", dtype="bf16", shards=2)
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(tmp_path / "hf"), "-o", str(out)]) == 0
    _check_packed(out, weights)
    assert main(["inspect", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "layout 1 (ValueShuffle)" in text and "real weights" in text and "checksums OK" in text
    assert "model.layers.1.mlp.down_proj.weight.scales" in text and "INT4 scales" in text
    assert "tokenizer unavailable: " in text and "packed from a directory without tokenizer.json" in text


def test_inspect_shows_the_stored_tokenizer(tmp_path, capsys):
    from nanoqwen import testmodels
    from nanoqwen.tokenizer import Tokenizer
    out = tmp_path / "m.nanoqwen"
    assert main(["pack", str(testmodels.SMALL_PY_DIR), "-o", str(out)]) == 0
    assert main(["inspect", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    gen = json.loads((testmodels.SMALL_PY_DIR / "generation_config.json").read_text())
    tok = Tokenizer(testmodels.SMALL_PY_DIR)
    assert f"tokenizer {tok.vocab_size:,} tokens; stored as tokenizer.json (" in text
    assert f"eos ids {list(tok.eos_ids)}" in text
    assert ("chat template yes" in text) == (tok.chat_template is not None)
    assert all(f"{k}={v}" in text for k, v in tok.special_tokens.items() if v is not None)
    assert tok.added_special_tokens and all(t in text for t in tok.added_special_tokens.values())
    assert f"generation config {json.dumps(gen)}" in text
    assert "BYTES" in text and "checksums OK" in text


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["pack", "-o", str(tmp_path / "x.nanoqwen")]) == 1
    assert main(["pack", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.nanoqwen")]) == 1
    (tmp_path / "bad.nanoqwen").write_bytes(b"\0" * 300)
    assert main(["inspect", str(tmp_path / "bad.nanoqwen")]) == 1
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(err) == 3 and "magic" in err[2] and "nowhere" in err[1]


def test_random_pack_deterministic_and_synthetic(tmp_path):
    a, b, c = (tmp_path / f"{n}.nanoqwen" for n in "abc")
    pack_random(TINY, a, seed=7, workers=2)
    pack_random(TINY, b, seed=7, workers=1)  # thread count must not change the bytes
    pack_random(TINY, c, seed=8, workers=2)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    f = NanoqwenFile(a)
    f.verify()
    assert f.synthetic and f.dims == TINY
    packed, scales = f.int4("model.layers.0.mlp.down_proj.weight")
    q = unpack(packed)
    assert q.min() == -7 and q.max() == 7  # never -8, full range used
    assert np.isfinite(scales).all() and (scales > 0).all()
    norm = f.array("model.layers.1.input_layernorm.weight").astype(np.float32)
    assert abs(norm.mean() - 1) < 0.01
    emb = f.array("model.embed_tokens.weight").astype(np.float32)
    assert 0.015 < emb.std() < 0.025
    # W x keeps the scale of x (the scales follow 1/sqrt(K))
    x = np.random.default_rng(0).standard_normal(TINY.intermediate).astype(np.float32)
    y = (q.astype(np.float32) * np.repeat(scales.astype(np.float32), 128, axis=1)) @ x
    assert 0.7 < y.std() < 1.4


def test_cli_random(tmp_path):
    out = tmp_path / "r.nanoqwen"
    assert main(["pack", "--random", "tiny", "--seed", "3", "-o", str(out)]) == 0
    assert NanoqwenFile(out).synthetic


def test_missing_shard(tmp_path):
    write_hf_dir(tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFError, match=r"index\.json: 1 shard\(s\) missing, first model-00002-of-00002"):
        HFCheckpoint(tmp_path)


def test_no_weights(tmp_path):
    write_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(HFError, match="neither model.safetensors nor model.safetensors.index.json"):
        HFCheckpoint(tmp_path)


def test_missing_tensor(tmp_path):
    from _hf_dirs import random_weights
    w = random_weights(TINY)
    del w["model.layers.1.self_attn.q_proj.bias"]
    write_hf_dir(tmp_path / "hf", weights=w)
    with pytest.raises(HFError, match=r"tensor model\.layers\.1\.self_attn\.q_proj\.bias is missing"):
        pack_hf(HFCheckpoint(tmp_path / "hf"), tmp_path / "m.nanoqwen")
    assert not (tmp_path / "m.nanoqwen").exists()


def test_config_disagrees_with_weights(tmp_path):
    write_hf_dir(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 512
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFError, match=r"gate_proj\.weight has shape \[384, 256\], config\.json implies \[512, 256\]"):
        pack_hf(HFCheckpoint(tmp_path / "hf"), tmp_path / "m.nanoqwen")


def test_not_qwen2(tmp_path):
    write_hf_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DimsError, match="not a Qwen2 model"):
        HFCheckpoint(tmp_path)


def test_unquantizable_dims(tmp_path):
    from _hf_dirs import random_weights
    from nanoqwen.dims import ModelDims
    dims = ModelDims(**{**TINY.to_dict(), "intermediate": 200})
    with pytest.raises(DimsError, match="intermediate=200 is not a multiple of the quant group size"):
        write_hf_dir(tmp_path, dims=dims, weights=random_weights(dims))


def test_truncated_shard(tmp_path):
    write_hf_dir(tmp_path)
    p = tmp_path / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(HFError, match=r"model\.safetensors: tensor \S+: data range .*truncated"):
        HFCheckpoint(tmp_path)


def test_out_of_range_fp16_and_nan_rejected(tmp_path):
    from _hf_dirs import random_weights
    w = random_weights(TINY)
    w["model.norm.weight"][3] = 1e6
    write_hf_dir(tmp_path / "a", weights=w, dtype="fp32")
    with pytest.raises(QuantError, match=r"model\.norm\.weight.*outside the fp16 range"):
        pack_hf(HFCheckpoint(tmp_path / "a"), tmp_path / "a.nanoqwen")
    w = random_weights(TINY)
    w["model.layers.0.mlp.up_proj.weight"][5, 9] = np.nan
    write_hf_dir(tmp_path / "b", weights=w, dtype="bf16")
    with pytest.raises(QuantError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*non-finite"):
        pack_hf(HFCheckpoint(tmp_path / "b"), tmp_path / "b.nanoqwen")
    assert not list(tmp_path.glob("*.nanoqwen*")) and not list(tmp_path.glob(".*.tmp"))


def _pack_fails(capsys, hf, pattern, out=None):
    """`nanoqwen pack HF -o OUT` ends in one line matching ``pattern``, exit 1, no file written."""
    out = out or hf.parent / "m.nanoqwen"
    assert main(["pack", str(hf), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the progress lines, if the pack got that far
    assert err.count("error: ") == 1 and last.startswith("error: ") and re.search(pattern, last), err
    assert "Traceback" not in err and not out.exists()
    assert not list(hf.parent.glob(".*.tmp"))


def _edit_config(hf, **changes):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,pattern", [
    (dict(num_hidden_layers=1e9), r"config\.json: num_hidden_layers: must be an integer, got 1000000000\.0"),
    (dict(num_hidden_layers=10**9), r"config\.json: num_hidden_layers: 1000000000 is outside \[1, 1024\]"),
    (dict(vocab_size=2**40), r"config\.json: vocab_size: 1099511627776 is outside"),
    (dict(hidden_size="256"), r"config\.json: hidden_size: must be an integer, got '256'"),
    (dict(intermediate_size=None), r"config\.json: missing field 'intermediate_size'"),
    (dict(rope_theta=float("nan")), r"config\.json: rope_theta: nan is not a finite number"),
    (dict(rope_theta=-1.0), r"config\.json: rope_theta: -1\.0 is not a finite number"),
    (dict(rms_norm_eps=float("inf")), r"config\.json: rms_norm_eps: inf is not a finite number"),
    (dict(rms_norm_eps=[1e-6]), r"config\.json: rms_norm_eps: must be a number"),
    (dict(tie_word_embeddings="no"), r"config\.json: tie_word_embeddings: must be true or false"),
    (dict(rope_scaling=["linear"]), r"config\.json: rope_scaling: must be an object"),
    (dict(architectures=7, model_type=None), r"config\.json: not a Qwen2 model"),
    (dict(num_key_value_heads=3), r"config\.json: model dims: heads \(4\) not a multiple of kv_heads \(3\)"),
])
def test_hostile_config_fields(tmp_path, capsys, changes, pattern):
    write_hf_dir(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **changes)
    _pack_fails(capsys, tmp_path / "hf", pattern)


@pytest.mark.parametrize("text,pattern", [
    ("[1, 2]", r"config\.json: must hold a JSON object, not a list"),
    ("{not json", r"config\.json: invalid JSON: "),
    ("[" * 100_000 + "]" * 100_000, r"config\.json: invalid JSON: nested too deeply"),
    ("\udcff", r"config\.json: invalid JSON: "),
])
def test_malformed_config(tmp_path, capsys, text, pattern):
    write_hf_dir(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    _pack_fails(capsys, tmp_path / "hf", pattern)


def _st_header(hf, header, hlen=None, data=b""):
    """Replace model.safetensors by ``header`` (a JSON value or raw bytes) and ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)


@pytest.mark.parametrize("header,hlen,pattern", [
    (b"{}", 2**63, r"header length 9223372036854775808 exceeds the file size"),
    (b"\x00" * 8, None, r"safetensors header: invalid JSON"),
    ([1, 2], None, r"safetensors header: must be a JSON object"),
    ({"w": [1]}, None, r"tensor w: header entry must be an object"),
    ({"w": {"dtype": 5, "shape": [2], "data_offsets": [0, 4]}}, None, r"tensor w: dtype 5 is not supported"),
    ({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}, None, r"tensor w: dtype 'I8' is not supported"),
    ({"w": {"dtype": "F16", "shape": "2", "data_offsets": [0, 4]}}, None, r"tensor w: shape '2' is not a list"),
    ({"w": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}, None, r"tensor w: shape \[-2\] is not"),
    ({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0]}}, None, r"tensor w: data_offsets \[0\] is not"),
    ({"w": {"dtype": "F16", "shape": [2], "data_offsets": ["0", 4]}}, None, r"tensor w: data_offsets \['0', 4\]"),
    ({"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}, None, r"tensor w: data_offsets \[4, 0\]"),
    ({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}, "v": {"dtype": "F16", "shape": [2**40, 2**40],
     "data_offsets": [0, 4]}}, None, r"tensor v: data range \[0, 4\) does not hold F16"),
    ({"w": {"dtype": "F16", "shape": [2], "data_offsets": [2**62, 2**62 + 4]}}, None, r"tensor w: data range"),
    ({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, "v": {"dtype": "F16", "shape": [2],
     "data_offsets": [4, 8]}}, None, r"tensor v: data_offsets overlap tensor w"),
])
def test_malformed_safetensors_header(tmp_path, capsys, header, hlen, pattern):
    write_hf_dir(tmp_path / "hf")
    _st_header(tmp_path / "hf", header, hlen, data=b"\0" * 8)
    _pack_fails(capsys, tmp_path / "hf", r"model\.safetensors: " + pattern)


@pytest.mark.parametrize("index,pattern", [
    ([], r"weight_map: missing or not an object"),
    ({"weight_map": ["a"]}, r"weight_map: missing or not an object"),
    ({"weight_map": {"w": 3}}, r"weight_map: tensor w: shard 3 is not a file name"),
    ({"weight_map": {"w": "../hf2/model.safetensors"}},
     r"weight_map: tensor w: shard '\.\./hf2/model\.safetensors' is not a file name"),
])
def test_malformed_index(tmp_path, capsys, index, pattern):
    write_hf_dir(tmp_path / "hf", shards=2)
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    _pack_fails(capsys, tmp_path / "hf", r"model\.safetensors\.index\.json: " + pattern)


@pytest.mark.parametrize("target,make,pattern", [
    ("hf", lambda p: fifo(p), r"hf: not a directory \(a FIFO\)"),
    ("hf", lambda p: symlink_loop(p), r"hf: too many levels of symbolic links"),
    ("hf/config.json", lambda p: fifo(p), r"config\.json: not a regular file \(a FIFO\)"),
    ("hf/config.json", lambda p: os.symlink("/dev/zero", p), r"config\.json: not a regular file \(a character"),
    ("hf/config.json", lambda p: symlink_loop(p), r"config\.json: cannot open: too many levels of symbolic"),
    ("hf/model.safetensors", lambda p: fifo(p), r"model\.safetensors: not a regular file \(a FIFO\)"),
    ("hf/model.safetensors", lambda p: os.symlink("/dev/zero", p), r"model\.safetensors: not a regular file"),
    ("hf/tokenizer.json", lambda p: fifo(p), r"tokenizer\.json: not a regular file \(a FIFO\)"),
])
def test_hostile_paths_in_an_hf_dir(tmp_path, capsys, target, make, pattern):
    write_hf_dir(tmp_path / "hf")
    path = tmp_path / target
    if path.is_dir():
        shutil.rmtree(path)
    path.unlink(missing_ok=True)
    make(path)
    _pack_fails(capsys, tmp_path / "hf", pattern)


@pytest.mark.parametrize("failure", ["nan weights", "interrupted"])
def test_failed_cache_pack_leaves_no_entry(tmp_path, monkeypatch, failure):
    """`nanoqwen run HF_DIR` packs into the cache: a pack that fails, or is interrupted, leaves no (empty)
    entry directory and no temporary behind."""
    from _hf_dirs import random_weights
    from nanoqwen import modelcache
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    w = random_weights(TINY)
    if failure == "nan weights":
        w["model.layers.1.mlp.down_proj.weight"][3, 4] = np.nan
        expected = QuantError
    else:
        def interrupted(ckpt, out, **kwargs):  # Ctrl-C (or SIGTERM, see cli.errors) in the middle of the pack
            raise KeyboardInterrupt
        monkeypatch.setattr(pack_mod, "pack_hf", interrupted)
        expected = KeyboardInterrupt
    write_hf_dir(tmp_path / "hf", weights=w)
    with pytest.raises(expected):
        modelcache.resolve(tmp_path / "hf", log=lambda msg: None)
    left = sorted(p.relative_to(tmp_path / "cache").as_posix() for p in (tmp_path / "cache").rglob("*"))
    assert left == ["models", "models/digests.json"], left
