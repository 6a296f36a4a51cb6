"""`nanoqwen bench` on the CPU: the byte budget per region (DESIGN.md section 5: ~4.46 GB per 7B token at
small context, 3.37 GB INT4 + 1.09 GB lm_head), the llama-bench table and JSON, MBU arithmetic, the
region grouping of the ITL breakdown, the README table renderer, and the CLI's argument errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

from nanoqwen.bench import itl, mbu, protocol
from nanoqwen.cli.main import main
from nanoqwen.cli.pack import RANDOM_DIMS
from nanoqwen.dims import QWEN25_7B
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.pack import pack_random
from nanoqwen.backends import cuda_available

from _tools import tool

results_table, ab_bench = tool("results_table"), tool("ab_bench")
BENCH_RESULT = Path(__file__).resolve().parents[1] / "results" / "bench-h200-random7b-2026-12-03.json"

D = QWEN25_7B


# ---- byte budget ------------------------------------------------------------------------------------

def test_7b_bytes_per_token_match_the_design_budget():
    rb = mbu.region_bytes(D, context=64)
    assert list(rb) == list(mbu.REGIONS)
    int4_params = D.layers * (D.hidden * (D.q_dim + 2 * D.kv_dim) + D.q_dim * D.hidden
                              + 3 * D.hidden * D.intermediate)
    int4 = sum(rb[r]["weights"] for r in mbu.GEMV_REGION.values())
    assert int4 == int4_params * (0.5 + 2 / 128)          # packed nibbles + one fp16 scale per 128
    assert abs(int4 - 3.37e9) < 0.01e9
    assert rb["lm_head_argmax"]["weights"] == D.vocab * D.hidden * 2
    assert abs(rb["lm_head_argmax"]["weights"] - 1.09e9) < 0.01e9
    total = mbu.step_bytes(D, 64)
    assert total == sum(r["total"] for r in rb.values())
    assert abs(total - 4.46e9) / 4.46e9 < 0.005, total
    for name, r in rb.items():   # the QKV GEMV does rope_append's work (gemv.with_rope): its region moves nothing
        assert r["total"] == r["weights"] + r["kv"] + r["activations"] and (r["total"] > 0) == (name != "rope_append")
    # the QKV GEMV's activations: h and the norm weight in, the bias, q_rot (fp32), k and v (fp16), a cos and a sin
    qkv = D.hidden * 4 + D.hidden * 2 + 2 * (D.q_dim + 2 * D.kv_dim) + 4 * D.q_dim + 2 * 2 * D.kv_dim + 4 * D.head_dim
    assert rb["qkv_gemv"]["activations"] == D.layers * qkv


def test_kv_bytes_grow_with_context_only_in_attention():
    a, b = mbu.region_bytes(D, 512), mbu.region_bytes(D, 4096)
    per_token = D.layers * 2 * D.kv_dim * 2                   # K and V, fp16, every layer
    pages = D.layers * 4 * (4096 // 16 - 512 // 16)
    assert b["paged_attention"]["kv"] - a["paged_attention"]["kv"] == per_token * (4096 - 512) + pages
    assert all(a[r] == b[r] for r in mbu.REGIONS if r != "paged_attention")
    assert abs(mbu.step_bytes(D, 4096) - 4.46e9 - per_token * 4096) / 4.7e9 < 0.005   # still "small" at 4k


def test_floor_and_mbu_arithmetic():
    assert mbu.floor_ms(4.22e9, 4220.0) == pytest.approx(1.0)
    assert mbu.mbu(4.22e9, 2e-3, 4220.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mbu.region_bytes(D, 0)


# ---- region grouping ---------------------------------------------------------------------------------

def fake_sequence(layers: int = 2):
    roles = ["embed"] + ["qkv", "rope_append", "attention_decode", "attention_combine", "o_proj", "gate_up",
                         "down"] * layers + ["lm_head"]
    return [(r, None, None, {}) for r in roles]


def test_groups_merge_decode_and_combine_and_follow_launch_order():
    seq = fake_sequence(2)
    groups = itl._groups(seq, per_launch=False)
    names = [g for g, _ in groups]
    assert names == ["embed"] + ["qkv_gemv", "rope_append", "paged_attention", "o_proj", "gate_up_gemv",
                                 "down"] * 2 + ["lm_head_argmax"]
    assert [i for _, idx in groups for i in idx] == list(range(len(seq)))   # every launch exactly once
    assert groups[3][1] == [3, 4]                                           # decode + combine
    per = itl._groups(seq, per_launch=True)
    assert [idx for _, idx in per] == [[i] for i in range(len(seq))]


# ---- table and JSON ----------------------------------------------------------------------------------

def fake_result(synthetic: bool = True) -> dict:
    rng = np.random.default_rng()
    P, G = 512, 128
    info = {"path": "/cache/model.nanoqwen", "synthetic": synthetic, "n_params": 7_615_616_512,
            "size_bytes": 4_600_000_000, "dims": D.to_dict(),
            "label": "qwen2 7.6B INT4-g128" + (" (synthetic: random weights)" if synthetic else "")}
    common = {"model_filename": info["path"], "model_type": info["label"], "model_size": info["size_bytes"],
              "model_n_params": info["n_params"], "backends": "CUDA (cuda NVIDIA H200, graph)",
              "gpu_info": "NVIDIA H200", "build_commit": "abc1234", "n_batch": 1, "test_time": "2026-12-02"}
    ttft = list(0.05 + 0.01 * rng.random(5))
    tg = list(0.2 + 0.01 * rng.random(5))
    regions = {r: 0.01 + 0.1 * rng.random() for r in mbu.REGIONS}
    total = sum(regions.values())
    res = {"kind": "nanoqwen-bench", "schema": protocol.SCHEMA, "commit": "abc1234", "config_hash": "0" * 16,
           "date": "2026-12-02T14:00:00+00:00", "model": info,
           "gpu": {"name": "NVIDIA H200", "driver_version": 13000, "lock_clocks": False, "clocks_before": {}},
           "tests": [protocol.bench_record(f"pp{P}", P, 0, 0, ttft, P, common),
                     protocol.bench_record(f"tg{G}", 0, G, P, tg, G, common)],
           "latency": {"ttft_ms": {"median": 55.0, "min": 50.0, "max": 60.0},
                       "ms_per_token": {"p50": 1.6, "p90": 1.7, "mean": 1.62, "min": 1.5, "max": 1.9, "n": 640}},
           "itl": {"context": P + G // 2, "reps": 20, "gated": True, "gate_timed_out": False,
                   "regions_ms": regions, "regions_sum_ms": total, "eager_step_ms": total * 1.05,
                   "eager_step_ms_min": total, "graph_step_ms": total * 1.1, "graph_minus_regions_ms": total * 0.1,
                   "launches": 198},
           "copy": {"GBps": 4220.0}}
    res["mbu"] = protocol.mbu_report(D, None, res)
    return res


def test_bench_record_uses_llama_bench_fields():
    t = fake_result()["tests"][1]
    for key in ("model_filename", "model_type", "model_size", "model_n_params", "backends", "gpu_info",
                "build_commit", "n_batch", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns",
                "avg_ts", "stddev_ts", "samples_ns", "samples_ts"):
        assert key in t, key
    assert t["samples_ts"] == pytest.approx([128 / (ns * 1e-9) for ns in t["samples_ns"]])
    assert t["avg_ts"] == pytest.approx(np.mean(t["samples_ts"]))
    assert t["stddev_ts"] == pytest.approx(np.std(t["samples_ts"], ddof=1))


def test_table_is_llama_bench_like_and_labels_synthetic():
    res = fake_result()
    text = protocol.table(res)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["model", "size", "params", "backend", "test", "t/s"]
    pp, tg = lines[2], lines[3]
    assert "pp512" in pp and "tg128 @ d512" in tg and "±" in pp and "GiB" in pp and "7.62 B" in pp
    assert f"{res['tests'][0]['avg_ts']:.2f} ± {res['tests'][0]['stddev_ts']:.2f}" in pp
    assert "synthetic" in text and "TTFT 55.0 ms" in text and "p50 1.600" in text and "p90 1.700" in text
    for r in (*mbu.REGIONS, "graph - sum of eager regions", "graph step", "eager step", "floor"):
        assert r in text, r
    assert "synthetic" not in protocol.table(fake_result(synthetic=False))


def test_mbu_report_divides_region_bytes_by_region_time():
    res = fake_result()
    mb = res["mbu"]
    rb = mbu.region_bytes(D, res["itl"]["context"])
    for r in mbu.REGIONS:
        want = rb[r]["total"] / (res["itl"]["regions_ms"][r] * 1e-3) / 4220e9
        assert mb["regions"][r]["mbu"] == pytest.approx(want)
    step = mbu.step_bytes(D, res["itl"]["context"])
    assert mb["bytes_per_token"] == step
    assert mb["decode_mbu"] == pytest.approx(step / 1.62e-3 / 4220e9)
    assert mb["floor_ms_per_token"] == pytest.approx(step / 4220e9 * 1e3)


def test_json_roundtrip(tmp_path):
    res = fake_result()
    out = tmp_path / "sub" / "r.json"
    protocol.write_json(res, out)
    back = json.loads(out.read_text())
    assert back == json.loads(json.dumps(res)) and not list(tmp_path.glob("sub/*.tmp"))
    assert back["gpu"]["lock_clocks"] is False


def test_plot_writes_a_png_or_says_why_not(tmp_path):
    msg = protocol.plot(fake_result(), tmp_path / "itl.png")
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "itl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in msg and not (tmp_path / "itl.png").exists()


def test_slowest_lists_launches_in_order_of_time():
    prof = {"context": 576, "reps": 3, "gated": True, "total_us": 6.0,
            "kernels": [{"us": float(u), "layer": None if i == 0 else 0, "role": r, "uri": f"k{i}"}
                        for i, (u, r) in enumerate(((1, "embed"), (3, "qkv"), (2, "down")))]}
    lines = itl.slowest(prof, 2).splitlines()
    assert "k1" in lines[2] and "k2" in lines[3] and "k0" not in "\n".join(lines[:4])


# ---- the synthetic model and the README table ------------------------------------------------------

def test_synthetic_model_info(tmp_path):
    path = pack_random(RANDOM_DIMS["tiny"], tmp_path / "tiny.nanoqwen", seed=1)
    info = protocol.model_info(NanoqwenFile(path))
    assert info["synthetic"] and "synthetic" in info["label"] and info["n_params"] > 0


def test_results_table_renders_committed_results_only(tmp_path):
    res = fake_result()
    table = results_table.render({"results/h200.json": res})
    header, _sep, row = table.splitlines()
    assert "tg t/s" in header and "h200.json" in row and "abc1234" in row
    assert f"{res['tests'][1]['avg_ts']:.2f}" in row and f"{100 * res['mbu']['decode_mbu']:.1f}%" in row
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.json").write_text(json.dumps(res))
    git("add", "results/a.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "r")
    (tmp_path / "results" / "b.json").write_text(json.dumps(res))          # not committed: never quoted
    assert list(results_table.committed_results(tmp_path)) == ["results/a.json"]
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{results_table.BEGIN}\nold\n{results_table.END}\ntail\n")
    results_table.update(readme, table)
    assert readme.read_text() == f"# x\n{results_table.BEGIN}\n{table}\n{results_table.END}\ntail\n"
    readme.write_text("no markers")
    with pytest.raises(results_table.TableError):
        results_table.update(readme, table)


# ---- CLI errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (["bench"], "give MODEL"),
    (["bench", "--kernels", "7b"], "--kernels takes no MODEL"),
    (["bench", "--kernels", "--gen-tokens", "4"], "--kernels takes no --gen-tokens"),
    (["bench", "no/such/model.nanoqwen"], "no such file"),
    (["bench", "7b", "--gen-tokens", "1"], "--gen-tokens must be at least 2"),
    (["bench", "7b", "--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    (["bench", "7b", "--repetitions", "0"], "--repetitions must be at least 1"),
    (["bench", "7b", "--warmup", "-1"], "--warmup must be at least 0"),
    (["bench", "7b", "--plot", "itl.jpg"], "expected a .png"),
    (["bench", "7b", "--profile", "p.txt"], "expected a .json"),
    (["bench", "7b", "--timeline", "t.svg"], "expected a .png"),
    (["bench", "--kernels", "--timeline", "t.png"], "--kernels takes no --timeline"),
    (["bench", "7b", "--timeline-rows", "8"], "--timeline-rows needs --timeline"),
    (["bench", "7b", "--timeline", "t.png", "--timeline-rows", "3"], "--timeline-rows 3: not a multi-row bucket"),
])
def test_cli_argument_errors(capsys, argv, msg):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_cli_bad_number_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "7b", "--warmup", "three"])
    assert e.value.code == 2


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU error")
def test_cli_without_a_gpu_fails_in_one_line_before_packing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path))
    assert main(["bench", "7b", "--no-baseline"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "CUDA" in err and err.count("\n") == 1, err
    assert not (tmp_path / "models").exists()     # nothing packed


# ---- the GPU-side glue, on fakes: a simulated clock advanced by each "launch" -----------------------

class FakeClock:
    t = 0.0


ROLE_US = {"embed": 2, "qkv": 10, "rope_append": 3, "attention_decode": 6, "attention_combine": 2, "o_proj": 8,
           "gate_up": 50, "down": 30, "lm_head": 260}


class FakeEvent:
    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = FakeClock.t
        return self

    @staticmethod
    def elapsed_ms(a, b):
        return (b.t - a.t) * 1e3

    def synchronize(self):   # the simulated clock has run every launch already
        pass

    def close(self):
        pass


class FakeHostBuffer:
    def __init__(self, n):
        self.ptr, self._a = 1, np.zeros(n // 4, np.uint32)

    def array(self, dtype):
        return self._a

    def free(self):
        pass


class FakeFn:
    def __init__(self, role):
        self.role, self.uri = role, f"{role}_kernel_abcd1234"

    def launch(self, launch, stream, pdl, **args):
        FakeClock.t += ROLE_US[self.role] * 1e-6


class FakeLaunch:
    grid, block, smem = (132, 1, 1), (128, 1, 1), 0


class FakeGraph:
    def __init__(self, dec):
        self.dec = dec

    def launch(self, stream):
        self.dec.launch_kernels(stream)
        FakeClock.t -= 5e-6                      # PDL overlap: the graph beats the eager sum


class FakeDecoder:
    def __init__(self, layers: int):
        self.sequence = [(r, FakeFn(r), FakeLaunch(), {}) for r, *_ in fake_sequence(layers)]
        self.stream, self.pdl, self.graph = type("Stream", (), {"handle": 7})(), True, FakeGraph(self)
        self.resets = []

    def reset(self, token, pos=0, step=0):
        self.resets.append((token, pos, step))

    def launch_kernels(self, stream=None):
        for _r, fn, launch, args in self.sequence:
            fn.launch(launch, stream, self.pdl, **args)

    def drain(self):
        pass

    def check_errors(self):
        pass


@pytest.fixture
def fake_driver(monkeypatch):
    class FakeCu:
        class CUstreamWaitValue_flags:
            CU_STREAM_WAIT_VALUE_GEQ = 0

        @staticmethod
        def cuMemHostGetDevicePointer(ptr, flags):
            return (0, ptr)

        @staticmethod
        def cuStreamWaitValue32(stream, ptr, value, flags):
            return (0,)

    monkeypatch.setattr(itl.driver, "Event", FakeEvent)
    monkeypatch.setattr(itl.driver, "HostBuffer", FakeHostBuffer)
    monkeypatch.setattr(itl, "cu", FakeCu)
    monkeypatch.setattr(itl, "check", lambda res, what="": res[1] if len(res) > 1 else None)


def test_breakdown_sums_regions_over_layers_on_a_simulated_clock(fake_driver):
    layers = 3
    dec = FakeDecoder(layers)
    res = itl.breakdown(dec, context=100, reps=4)
    assert res["gated"] and not res["gate_timed_out"], res["gate_error"]
    assert all(r == (0, 99, 99) for r in dec.resets)          # pos = context - 1: attention covers 100 tokens
    us = {r: 1e3 * ms for r, ms in res["regions_ms"].items()}
    assert us["qkv_gemv"] == pytest.approx(layers * 10) and us["paged_attention"] == pytest.approx(layers * 8)
    assert us["lm_head_argmax"] == pytest.approx(260) and us["embed"] == pytest.approx(2)
    assert res["regions_sum_ms"] == pytest.approx(res["eager_step_ms"])
    assert res["graph_minus_regions_ms"] == pytest.approx(-5e-3) and res["launches"] == 2 + 7 * layers
    prof = itl.profile(dec, context=100, reps=2)
    assert [k["layer"] for k in prof["kernels"]] == [None] + [i for i in range(layers) for _ in range(7)] + [None]
    assert prof["total_us"] == pytest.approx(1e3 * res["regions_sum_ms"])
    assert "lm_head_kernel" in itl.slowest(prof).splitlines()[2]


def test_protocol_run_glue_on_fakes(fake_driver, monkeypatch, tmp_path, capsys):
    """protocol.run end to end with the session, device and copy faked: every figure is computed and the
    table, plot, profile and JSON are written (on the GPU the same code meets the real driver)."""
    from nanoqwen.bench import kernels
    from nanoqwen.runtime import driver, session as session_mod

    path = pack_random(RANDOM_DIMS["tiny"], tmp_path / "tiny.nanoqwen", seed=2)

    class Props:
        name, sm_count, l2_bytes, total_mem = "Fake H200", 132, 60 << 20, 1 << 40
        driver_version, compute_capability = 13000, (9, 0)

    class FakeSession:
        def __init__(self, p, context, eager, log, cfg):
            self.decoder, self.name, self.closed = FakeDecoder(RANDOM_DIMS["tiny"].layers), "fake", False
            log("loaded fake")

        def generate(self, prompt, n):
            assert n == 9 and len(prompt) == 16
            for _ in range(n):
                yield 1

        def close(self):
            self.closed = True

    monkeypatch.setattr(driver, "device", lambda: type("D", (), {"props": Props()})())
    monkeypatch.setattr(session_mod, "CudaSession", FakeSession)
    monkeypatch.setattr(driver, "Stream", lambda: type("S", (), {"close": lambda self: None})())
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda s: {"GBps": 4000.0})
    monkeypatch.setattr(kernels, "clocks", lambda: {"clocks.sm": "1980 MHz"})
    prof = tmp_path / "prof.json"
    res = protocol.run(str(path), warmup=1, prompt_tokens=16, gen_tokens=8, repetitions=2, profile_path=prof,
                       log=lambda m: None)
    assert [t["test"] for t in res["tests"]] == ["pp16", "tg8"] and res["tests"][1]["n_depth"] == 16
    assert res["latency"]["ms_per_token"]["n"] == 16 and res["itl"]["context"] == 20
    assert res["mbu"]["bytes_per_token"] == mbu.step_bytes(RANDOM_DIMS["tiny"], 20)
    assert json.loads(prof.read_text())["kernels"] and res["profile"]["path"] == str(prof)
    assert res["gpu"]["clocks_after"] == {"clocks.sm": "1980 MHz"} and res["gpu"]["lock_clocks"] is False
    b = res["baseline"]
    assert "skipped" in b["transformers"] and "skipped" in b["int4_gemv"]   # no CUDA torch here
    text = protocol.table(res)
    assert "pp16" in text and "tg8 @ d16" in text and "synthetic" in text and "transformers: skipped" in text
    protocol.write_json(res, tmp_path / "r.json")
    assert results_table.render({"results/r.json": json.loads((tmp_path / "r.json").read_text())}).count("\n") == 2


def test_baseline_summary_prints_ratios_to_nanoqwen():
    from nanoqwen.bench import baseline
    res = fake_result()
    res["baseline"] = {
        "transformers": {"transformers": "5.17", "cache": "static", "n_prompt": 512, "pp_ms": 81.0,
                         "ms_per_token": 3.24},
        "int4_gemv": {"op": "torch._weight_int4pack_mm", "shapes": [
            {"role": "qkv", "n": 4608, "k": 3584, "us": 12.0, "GBps": 700.0, "pct_copy": 16.6, "rel_err": 3e-3,
             "nanoqwen_us": 6.0, "torch_over_nanoqwen": 2.0},
            {"role": "down", "n": 3584, "k": 18944, "skipped": "RuntimeError: boom"}]}}
    text = baseline.summary(res)
    nq_pp = res["tests"][0]["avg_ns"] / 1e6
    assert f"{81.0 / nq_pp:.2f}x nanoqwen's {nq_pp:.1f} ms" in text
    assert "3.24 ms/token (2.00x nanoqwen's 1.620)" in text
    assert "torch/nanoqwen 2.00x" in text and "skipped (RuntimeError: boom)" in text


def test_cli_kernels_mode_calls_the_gemv_bench(monkeypatch, capsys, tmp_path):
    from nanoqwen.bench import kernels
    seen = {}
    monkeypatch.setattr(kernels, "run", lambda **kw: seen.update(kw) or {"gemv": []})
    assert main(["bench", "--kernels", "--roles", "qkv,down", "--out", str(tmp_path / "k.json")]) == 0
    assert seen == {"roles": ("qkv", "down")} and json.loads((tmp_path / "k.json").read_text()) == {"gemv": []}
    assert main(["bench", "--kernels", "--roles", "qkv,nope"]) == 1
    assert "unknown role(s) nope" in capsys.readouterr().err


def test_ab_bench_alternates_and_compares(tmp_path, monkeypatch):
    """tools/ab_bench.py on a committed bench record (the new side 1% slower per token): old and new
    alternate, each side's figures come out of the real JSON layout, the summary is the medians' ratio."""
    order = []

    def fake_run(cmd, cwd, env, check):
        order.append(Path(cwd).name)
        d = json.loads(BENCH_RESULT.read_text())
        if Path(cwd).name != "old":
            d["latency"]["ms_per_token"]["p50"] *= 1.01
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(d))
    monkeypatch.setattr(ab_bench.subprocess, "run", fake_run)
    monkeypatch.setattr(ab_bench, "ROOT", tmp_path / "new")
    (tmp_path / "old" / "nanoqwen").mkdir(parents=True)
    out = tmp_path / "ab.json"
    assert ab_bench.main([str(tmp_path / "old"), "--old-commit", "13da7d5", "--rounds", "2", "--out", str(out)]) == 0
    assert order == ["old", "new", "old", "new"]
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["old"]["commit"] == "13da7d5" and len(doc["new"]["runs"]) == 2
    assert doc["summary"]["ms_per_token_p50"]["new_vs_old_pct"] == pytest.approx(1.0)
    assert doc["summary"]["graph_step_ms"]["new_vs_old_pct"] == pytest.approx(0.0)
    assert doc["old"]["runs"][0]["eager_regions_ms"]["down"] > 0


def test_ab_bench_gate_and_extra_trees(tmp_path, monkeypatch):
    """--gate fails the run when new is slower than old by more than the given percent on any summary figure
    (here TTFT, +2%), passes within it; --also trees run in every round and are reported, not gated."""
    order = []

    def fake_run(cmd, cwd, env, check):
        order.append(Path(cwd).name)
        d = json.loads(BENCH_RESULT.read_text())
        d["latency"]["ttft_ms"]["median"] *= {"old": 1.0, "mid": 1.5, "new": 1.02}[Path(cwd).name]
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(d))
    monkeypatch.setattr(ab_bench.subprocess, "run", fake_run)
    monkeypatch.setattr(ab_bench, "ROOT", tmp_path / "new")
    for tree in ("old", "mid"):
        (tmp_path / tree / "nanoqwen").mkdir(parents=True)
    args = [str(tmp_path / "old"), "--also", f"abc123={tmp_path / 'mid'}", "--rounds", "1", "--out", str(tmp_path / "ab.json")]
    assert ab_bench.main(args + ["--gate", "1.0"]) == 1
    assert order == ["old", "mid", "new"]
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert doc["gate_failed"] == ["ttft_ms_median"] and doc["abc123"]["commit"] == "abc123"
    assert doc["summary"]["ttft_ms_median"]["abc123"] == pytest.approx(1.5 * doc["summary"]["ttft_ms_median"]["old"])
    assert ab_bench.main(args + ["--gate", "2.5"]) == 0
    with pytest.raises(SystemExit, match="ID=TREE"):
        ab_bench.main(args[:1] + ["--also", "nope", "--out", str(tmp_path / "x.json")])


def test_multirow_bench_glue_on_fakes(monkeypatch):
    """bench/multirow.run with the device faked: every bucket of every role and the lm_head is timed on its
    m-row kernel, each row's ratio is to that kernel's m = 1 time, bytes count m rows of activations, and
    the weights-only step sums layers x the GEMVs + the configured lm_head; the lm_head's valid variants
    at m > 1 come after, a spilling one left out."""
    import types
    from nanoqwen import config
    from nanoqwen.bench import multirow
    from nanoqwen.codegen.kernels import gemv

    from nanoqwen.codegen.resources import Resources

    cfg = config.default()
    def fake_build(spec):   # rows_per_warp 4 at m = 16 "spills"
        spills = getattr(spec, "rows_per_warp", 1) == 4 and spec.m == 16
        return types.SimpleNamespace(spec=spec, resources=Resources(
            registers=64, shared_static=0, local_bytes=0, max_stack=0, constant0=0, barriers=0,
            spill_stores=4 * spills, spill_loads=4 * spills))
    monkeypatch.setattr(multirow.codegen, "build_many", lambda specs, progress=None: [fake_build(s) for s in specs])
    monkeypatch.setattr(multirow.driver, "load", lambda built: built)
    monkeypatch.setattr(multirow, "_gemv_seconds", lambda spec, fn, *a: (1e-6 * (1 + 0.1 * (spec.m - 1)),) * 3)
    monkeypatch.setattr(multirow, "_lm_head_seconds", lambda spec, fn, *a: (1e-4 * (1 + 0.05 * (spec.m - 1)),) * 3)
    res = multirow.run(stream=None, copy_GBps=4000.0, cfg=cfg)
    rows = res["rows"]
    configured = [(n, m) for n in (*gemv.ROLES, "lm_head") for m in cfg.multirow.buckets]
    assert [(r["name"], r["m"]) for r in rows[:len(configured)]] == configured
    variants = ("lm_head:rows_per_warp1", "lm_head:rows_per_warp4,unroll8", "lm_head:warps16")
    assert [(r["name"], r["m"]) for r in rows[len(configured):]] == [
        (v, m) for m in (2, 4, 8, 16) for v in variants
        if (v, m) not in (("lm_head:rows_per_warp4,unroll8", 16),   # spills (faked)
                          ("lm_head:warps16", 16))]                 # invalid: 16 rows of x + 16 warps' bests > 227 KB
    for r in rows:
        assert r["x_m1"] == pytest.approx(1 + (0.05 if r["name"].startswith("lm_head") else 0.1) * (r["m"] - 1))
        assert f"_m{r['m']}_" in r["uri"] and r["pct_copy"] == pytest.approx(100 * r["GBps"] / 4000.0)
    qkv = {r["m"]: r["bytes"] for r in rows if r["name"] == "qkv"}
    assert qkv[16] - qkv[1] == 15 * (3584 * 4 + 4608 * 4)   # h in, y out per extra row
    step = res["weights_step"]
    assert step[1]["us"] == pytest.approx(QWEN25_7B.layers * 4 * 1.0 + 100.0)
    assert step[16]["x_m1"] == pytest.approx((QWEN25_7B.layers * 4 * 2.5 + 100 * 1.75) / (QWEN25_7B.layers * 4 + 100))
    text = multirow.table(res)
    assert "lm_head                   16" in text and "weights-only step, m=16" in text and "goal: m=8 <= 1.25x" in text


def test_speculate_bench_edit_cases_and_oracle():
    """bench/speculate.py: the code-edit workload has 24 cases of the three kinds from the committed source,
    each prompt ending with the changed copy's first line; the oracle drafter drafts the known continuation."""
    from nanoqwen.bench import edits, speculate
    text = (Path(__file__).parent / "data" / "textwrap-cpython-3.11.7.py.txt").read_text()
    cases = edits.edit_cases(text)
    assert len(cases) == 24 and {k for _, k in cases} == {"rename", "argument", "constant"}
    assert all(p.rstrip().split("\n")[-1].lstrip().startswith("def ") for p, _ in cases)
    assert any("_v2(" in p for p, k in cases if k == "rename")
    src = "    def f(self, x):\n        return x[0] + 10 + 0.5 + a0 + 0\n"
    fn = edits.functions(src)[0]
    assert fn == (src, "    ", "f", "self, x")
    rest = "        return x[0] + 10 + 0.5 + a0 + 0\n"
    assert [edits.edit(*fn, k)[1] for k in edits.KINDS] == [rest, rest, "        return x[1] + 10 + 0.5 + a0 + 1\n"]
    assert edits.edit(*fn, "argument")[0].endswith("    def f(self, x, verbose=False):\n")
    o = speculate.Oracle([1, 2], [7, 8, 9, 10], k=3)
    assert o.draft(10) == [7, 8, 9] and o.draft(2) == [7, 8]
    o.append([7, 8])
    assert o.draft(10) == [9, 10]


def test_speculate_wall_times_time_each_verify_as_the_host_waits_for_it(monkeypatch):
    """bench/speculate.wall_times on a simulated device: the decode step (reset, step, wait) and each
    bucket's RowStep.run at positions 512.., every call timed whole (what the host waits for), medians in
    ms per bucket, the kept sequences dropped afterwards."""
    from nanoqwen.bench import speculate
    clock = [0.0]
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    calls = []

    class Dec:
        def reset(self, *state):
            calls.append(("reset", state))

        def step(self, i, feed=None, read_token=False, read_logits=False):
            calls.append(("step", i, read_token))

    class State:
        def wait_step(self, i):
            clock[0] += 0.2e-3   # the decode step, waited for

    class Rows:
        m, buckets = 4, [2, 4]

        def run(self, tokens, positions):
            assert tokens == [0] * len(positions) and positions == list(range(512, 512 + len(positions)))
            clock[0] += 0.1e-3 * (1 + len(tokens))

    class Cache:
        cleared = 0

        def clear(self):
            Cache.cleared += 1

    runner = types.SimpleNamespace(reserve=lambda n: calls.append(("reserve", n)), cache=Cache())
    session = types.SimpleNamespace(decoder=Dec(), rows=Rows(), state=State(), runner=runner)
    wall = speculate.wall_times(session, reps=3)
    assert wall == pytest.approx({"1": 0.2, "2": 0.3, "4": 0.5})
    assert calls[0] == ("reserve", 512 + 4 + 1) and calls[1:3] == [("reset", (0, 512, 512)), ("step", 512, True)]
    assert Cache.cleared == 1
    assert speculate.wall_line("7B", wall).startswith("7B, a step as a verify runs it (host included): m=1 0.200 ms")


def test_speculate_sequence_steps_give_each_row_a_sequence_of_its_own(monkeypatch):
    """bench/speculate.sequence_step_times on a simulated device: a session of its own whose KV cache holds the
    largest bucket's sequences; one sequence a row (a distinct prompt, pages of its own) at position 512; the
    decode graph over the first one's table and each bucket's graph over the first m tables, as multiples of
    the decode graph; the session closed."""
    from nanoqwen import config
    from nanoqwen.bench import speculate
    from nanoqwen.runtime import session as session_module
    from nanoqwen.runtime.prefix_cache import PrefixCache
    seen = {"loads": []}

    class Rows:
        m, buckets = 4, [2, 4]
        graphs = {m: types.SimpleNamespace(launch=lambda stream, m=m: m) for m in (2, 4)}

        def load(self, tokens, positions, tables):
            seen["loads"].append((tokens, positions, tables))

    class Session:
        def __init__(self, path, context, log, cfg, kv_tokens):
            seen.update(context=context, kv_tokens=kv_tokens)
            self.runner = types.SimpleNamespace(cache=PrefixCache(kv_tokens // 16, 16))
            self.state = types.SimpleNamespace(stream="s", kv=types.SimpleNamespace(
                load=lambda table, stream: seen.update(decode_table=table)))
            self.decoder = types.SimpleNamespace(reset=lambda *state: seen.update(reset=state),
                                                 graph=types.SimpleNamespace(launch=lambda stream: 1))
            self.rows = Rows()

        def close(self):
            seen["closed"] = True
    monkeypatch.setattr(session_module, "CudaSession", Session)
    monkeypatch.setattr(speculate, "replay_seconds", lambda launch, stream, reps: 1e-3 * launch())
    cfg = config.default()
    out = speculate.sequence_step_times("model.nanoqwen", cfg, log=None)
    assert out == {"1": {"ms": 1.0, "vs_m1": 1.0}, "2": {"ms": 2.0, "vs_m1": 2.0}, "4": {"ms": 4.0, "vs_m1": 4.0}}
    assert seen["kv_tokens"] == cfg.multirow.buckets[-1] * seen["context"] and seen["closed"]
    tables = seen["loads"][-1][2]
    assert len(tables) == 4 and len(set().union(*map(set, tables))) == sum(map(len, tables))   # pages of their own
    assert seen["decode_table"] == tables[0] and seen["reset"] == (0, 512, 512)
    assert len(tables[0]) * 16 >= 512 + 50 + 1 + 1   # the positions the decode graph's replays append, and 512
    assert [(t, p, len(tb)) for t, p, tb in seen["loads"]] == [([0, 0], [512, 512], 2), ([0] * 4, [512] * 4, 4)]


def test_write_json_never_replaces_a_fifo(tmp_path):
    """bench --out / eval --out go through write_json: a FIFO (or any non-regular file) there is refused in
    one line and stays what it was; a regular file is replaced whole."""
    import os
    import stat

    from nanoqwen.bench import protocol
    from nanoqwen.safefile import FileError
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(FileError, match="not a regular file"):
        protocol.write_json({"a": 1}, fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    regular = tmp_path / "r.json"
    regular.write_text("old")
    protocol.write_json({"a": 1}, regular)
    assert json.loads(regular.read_text()) == {"a": 1}
