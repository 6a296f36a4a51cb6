"""CPU checks of the chunked prefill's wiring, no GPU (the fakes of tests/test_decoder_plan.py): chunk
planning, buffer sizing against what the kernels write, the launch sequence of every chunk of positions
[p0, p1) against each kernel's signature and grid (every pointer inside the buffer or weight region it
names, every row range inside its buffer), the device state handed to the lm_head, and the Runner's
host logic over a prefill that is not the decode step, with prefix reuse."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from test_decoder_plan import MEM, PROMPT, FakeBuf, fake_device, fake_runner, nqfile, reference_generation  # noqa: F401
from test_pdl_order import _before_wait

from nanoqwen import config
from nanoqwen.codegen.kernels import gemm
from nanoqwen.dims import QWEN25_7B
from nanoqwen.reference import Reference
from nanoqwen.runtime import prefill as prefill_mod
from nanoqwen.runtime.sampler import Sampling

PER_LAYER = ["rmsnorm", "qkv", "rope_append", "attention", "o_proj", "rmsnorm", "gate_up", "down"]
# prefill kernels without weights: under PDL nothing global may be read before griddepcontrol.wait (the
# GEMMs' weight prefetch before it is by design; their X copies come after it in the source)
NO_WEIGHTS = {role: spec for role, spec in prefill_mod.prefill_specs(QWEN25_7B, config.default()).items()
              if not isinstance(spec, gemm.GemmInt4Spec)}
SMALL_M = config.default().prefill.small_m_tokens
SPLIT_ATTENTION = prefill_mod.prefill_specs(QWEN25_7B, config.default())["prefill.small.attention"]


@pytest.mark.parametrize("P", [1, 15, 16, 17, 100, 511, 512, 513, 600, 1024, 1025])
@pytest.mark.parametrize("C", [1, 16, 100, 512])
@pytest.mark.parametrize("p0", [0, 7])
def test_chunks_cover_the_range(P, C, p0):
    plan = prefill_mod.chunks(p0, p0 + P, C)
    assert [c0 for c0, _ in plan] == list(range(p0, p0 + P, C))
    assert sum(n for _, n in plan) == P and all(1 <= n <= C for _, n in plan)
    assert all(n == C for _, n in plan[:-1])


def test_chunks_reject_empty():
    for p0, p1 in ((0, 0), (5, 5), (6, 5), (-1, 3)):
        with pytest.raises(ValueError):
            prefill_mod.chunks(p0, p1, 512)


def test_buffer_sizes_match_the_kernels():
    """Each chunk buffer has the columns its producer writes and its consumer reads; 7B at 512 tokens."""
    d, C = QWEN25_7B, 512
    shapes = prefill_mod.buffer_shapes(d, C)
    g = gemm.model_gemms(d)
    assert shapes["qkv"][0] == (C, g["qkv"].n) and shapes["xn"][0] == (C, g["qkv"].k) == (C, g["gate_up"].k)
    assert shapes["a16"][0] == (C, g["gate_up"].n // 2) == (C, g["down"].k)
    assert shapes["o16"][0] == (C, g["o_proj"].k) and shapes["h"][0] == (C, g["down"].n) == (C, g["o_proj"].n)
    acts = 4 * C * (d.hidden + d.q_dim + 2 * d.kv_dim + d.q_dim) + 2 * C * (d.hidden + d.q_dim + d.intermediate)
    assert acts == 50_855_936   # 48.5 MiB of activations for 512-token chunks of the 7B
    assert sum(prefill_mod.buffer_bytes(d, C, 4096, 0, 256).values()) == acts + 4 * 4096
    # split-KV partials: 4096 / 256 = 16 key blocks x 64 rows x 28 heads x (128 + 2) fp32, none without short
    # chunks; the chunk graphs' inputs: p0, n and the ids of the largest usable bucket
    parts = prefill_mod.buffer_bytes(d, C, 4096, 64, 256, (8, 16, 32, 64))
    assert (parts["part_acc"], parts["part_ml"]) == (16 * 64 * 28 * 128 * 4, 16 * 64 * 28 * 2 * 4)
    assert parts["graph_in"] == 4 * (2 + 64)
    assert prefill_mod.buffer_bytes(d, 32, 4096, 64, 256)["part_acc"] == 16 * 32 * 28 * 128 * 4  # rows <= chunk
    assert prefill_mod.buffer_bytes(d, C, 4100, 64, 512)["part_acc"] == 9 * 64 * 28 * 128 * 4   # blocks round up
    assert prefill_mod.buffer_bytes(d, 32, 4096, 64, 256, (8, 16, 32, 64))["graph_in"] == 4 * (2 + 32)
    assert "graph_in" not in prefill_mod.buffer_bytes(d, C, 4096, 0, 256, (8, 16))   # no small chunks: no graphs


@pytest.mark.parametrize("role", NO_WEIGHTS)
def test_no_global_load_before_the_wait(role):
    spec = NO_WEIGHTS[role]
    early = [ln.strip() for ln in _before_wait(spec) if re.search(r"\bLDG\b|\bLDG\.|LDGSTS", ln)]
    assert not early, f"{spec.uri}: global loads before griddepcontrol.wait: {early[:4]}"


class RecFn:
    """A kernel that only records its launches."""

    def __init__(self, role, log):
        self.role, self.log = role, log

    def launch(self, launch, stream=None, pdl=False, **args):
        self.log.append((self.role, launch, pdl, args))


def inside(ptr: int, nbytes: int) -> bool:
    return any(b.ptr <= ptr and ptr + nbytes <= b.ptr + b.nbytes for b in MEM)


@pytest.mark.parametrize("p0,P,C", [(0, 1, 512), (0, 17, 16), (0, 100, 512), (0, 100, 32), (0, 600, 512),
                                    (16, 17, 16), (5, 100, 32), (99, 100, 512), (150, 200, 512),
                                    (37, 600, 512)])
def test_prefill_launch_sequence(nqfile, monkeypatch, p0, P, C):
    """Positions [p0, P) of a sequence through Runner.prefill: the chunks start at p0, read the ids of
    their own positions, and the lm_head runs on the last row as step P - 1."""
    d = nqfile.dims
    log = []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=C, fn=lambda role, spec: RecFn(role, log))
    dec, pre, sh = run.decoder, run.prefiller, run.shared
    w, kv, kernels = sh.weights, sh.kv, dec.kernels
    prompt = ((np.arange(P) * 37 + 5) % d.vocab).tolist()
    sh.bufs.argmax_done.mem.view(np.uint32)[:] = 7
    run.prefill(prompt[p0:], p0, read_token=True)
    plan = prefill_mod.chunks(p0, P, C)

    # device state as the lm_head finds it: "step P - 1" at position P - 1; the new ids uploaded once
    assert sh.bufs.state.mem.view(np.int32).tolist() == [prompt[-1], P - 1, P - 1, 0]
    assert pre.bufs.tokens.mem.view(np.int32)[:P - p0].tolist() == prompt[p0:]
    assert int(sh.bufs.argmax_done.mem.view(np.uint32)[0]) == 0

    roles = [r for r, *_ in log]
    assert roles == [role for c0, n in plan for role in chunk_roles(c0, n, d.layers)] + ["lm_head"]
    b, hid = pre.bufs, d.hidden
    k = 0
    for c0, n in plan:
        per_layer = len(chunk_roles(c0, n, 1)) - 1
        splits = kernels["prefill.small.attention"][0].splits_for(c0 + n)
        split_kv = n <= SMALL_M and splits > 1
        for role, launch, pdl, args in log[k:k + 1 + per_layer * d.layers]:
            spec = kernels[role][0]
            assert pdl == (role.removeprefix("prefill.") not in prefill_mod.NO_PDL), f"{role}: PDL {pdl}"
            want = spec.launch(n, splits) if role == "prefill.small.attention" else spec.launch(n)
            assert launch == want, f"{role}: grid {launch} for a chunk of {n}"
            if role == "prefill.small.attention_combine":   # it folds the blocks of each row's own position
                assert (args["p0"], args["n"]) == (c0, n)
            assert set(args) == {name for name, _ in spec.signature}, role
            for name, kind in spec.signature:
                v = args[name]
                if kind == "ptr" and v != 0:
                    assert inside(int(v.ptr if isinstance(v, FakeBuf) else v), 1), f"{role}.{name} points nowhere"
            for name in ("p0", "n", "m"):
                if name in args:
                    assert args[name] == (c0 if name == "p0" else n), f"{role}.{name}"
        emb = log[k][3]
        assert emb["tokens"] == b.tokens.ptr + 4 * (c0 - p0) and inside(emb["tokens"], 4 * n)
        assert at_tokens(emb["tokens"], n) == prompt[c0:c0 + n]
        assert emb["h"] is b.h and emb["embed"] == w.ptr("embed")
        names = PER_LAYER[:3] + (["attention", "combine"] if split_kv else ["attention"]) + \
            ["o_proj", "post_norm"] + PER_LAYER[6:]
        for i in range(d.layers):
            L = f"L{i}."
            first = k + 1 + per_layer * i
            layer = dict(zip(names, (a for *_, a in log[first:first + per_layer])))
            assert layer["rmsnorm"]["w"] == w.ptr(L + "input_norm")
            assert layer["post_norm"]["w"] == w.ptr(L + "post_norm")
            assert (layer["qkv"]["w"], layer["qkv"]["s"], layer["qkv"]["bias"]) == \
                (w.ptr(L + "qkv.packed"), w.ptr(L + "qkv.scales"), w.ptr(L + "qkv.bias"))
            gu = layer["gate_up"]
            assert (gu["w"], gu["s"], gu["w2"], gu["s2"]) == (w.ptr(L + "gate.packed"), w.ptr(L + "gate.scales"),
                                                               w.ptr(L + "up.packed"), w.ptr(L + "up.scales"))
            assert layer["down"]["w"] == w.ptr(L + "down.packed") and layer["o_proj"]["w"] == w.ptr(L + "o.packed")
            for role in ("rope_append", "attention"):
                assert (layer[role]["k_pool"], layer[role]["v_pool"]) == (kv.k_ptr(i), kv.v_ptr(i))
            # the chain: residual h in, the GEMMs' X from the previous kernel's output, h += by o_proj and down
            assert layer["qkv"]["x"] is b.xn and layer["qkv"]["y"] is b.qkv and layer["o_proj"]["x"] is b.o16
            assert layer["gate_up"]["x"] is b.xn and layer["gate_up"]["y"] is b.a16
            assert layer["down"]["x"] is b.a16 and layer["o_proj"]["y"] is layer["down"]["y"] is b.h
            assert layer["rope_append"]["q_rot"] is b.q_rot and layer["attention"]["q_rot"] is b.q_rot
            if split_kv:   # partials from the attention to the combine, which writes o16
                att, comb = layer["attention"], layer["combine"]
                assert att["part_acc"] is comb["part_acc"] is b.part_acc and att["part_ml"] is comb["part_ml"] is b.part_ml
                assert comb["o16"] is b.o16 and comb["n"] == n and att["p0"] == c0
                assert splits * n * d.heads * d.head_dim * 4 <= b.part_acc.nbytes
                assert splits * n * d.heads * 2 * 4 <= b.part_ml.nbytes
            else:
                assert layer["attention"]["o16"] is b.o16
        k += 1 + per_layer * d.layers
    # the lm_head on the last prompt row (decode step's argmax/state advance), row inside the chunk buffer
    role, launch, pdl, args = log[-1]
    want = dict(dec.sequence[-1][3], h=b.h.ptr + 4 * hid * (P - 1 - plan[-1][0]))
    assert args == want and launch == kernels["lm_head"][0].launch()
    assert inside(args["h"], 4 * hid) and args["h"] + 4 * hid <= b.h.ptr + 4 * hid * plan[-1][1]


def chunk_roles(c0: int, n: int, layers: int, small_m: int = SMALL_M) -> list[str]:
    """The roles the chunk of n tokens at c0 launches: its GEMMs small-M ones up to small_m rows, and then
    its attention split-KV (plus the combine) where its keys make 2 splits or more, else the unsplit one."""
    small = n <= small_m
    split = small and SPLIT_ATTENTION.splits_for(c0 + n) > 1
    per_layer = [("small." if r in gemm.model_gemms(QWEN25_7B) and small or r == "attention" and split else "") + r
                 for r in PER_LAYER]
    if split:
        per_layer.insert(per_layer.index("small.attention") + 1, "small.attention_combine")
    return ["prefill.embed"] + ["prefill." + r for r in per_layer] * layers


@pytest.mark.parametrize("small_m", [0, 16, 64, 512])
def test_chunks_pick_their_gemm_tiles(nqfile, monkeypatch, small_m):
    """Chunks of at most prefill.small_m_tokens rows launch the small-M GEMMs, longer ones the default
    tiles (0: never small); 100 tokens in chunks of 32 are chunks of 32, 32, 32 and 4."""
    log = []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=32, fn=lambda role, spec: RecFn(role, log))
    run.prefiller.small_m_tokens = small_m
    run.prefill(list(range(1, 101)), 0, read_token=True)
    assert [r for r, *_ in log] == [r for c0, n in ((0, 32), (32, 32), (64, 32), (96, 4))
                                    for r in chunk_roles(c0, n, nqfile.dims.layers, small_m)] \
        + ["lm_head"]
    kernels = run.decoder.kernels
    for role, launch, _, args in log:
        if isinstance(kernels[role][0], gemm.GemmInt4Spec):
            assert launch == kernels[role][0].launch(args["m"])
            assert role.startswith("prefill.small.") == (args["m"] <= small_m), role


def test_small_m_tiles_fill_the_gpu():
    """7B at M = 32: the small-M tiles give every GEMM role >= 224 CTAs (132 SMs; gate_up's 32 x 64 tiles
    592), the long chunks' tiles N/128 (qkv's N/64); both variants are in the kernel table."""
    specs = prefill_mod.prefill_specs(QWEN25_7B, config.default())
    ctas = {r: specs["prefill.small." + r].launch(32).grid for r in gemm.model_gemms(QWEN25_7B)}
    assert ctas == {"qkv": (144, 2, 1), "o_proj": (112, 2, 1), "gate_up": (592, 1, 1), "down": (112, 2, 1)}
    assert {r: specs["prefill." + r].launch(32).grid[0] for r in ctas} == {"qkv": 72, "o_proj": 28, "gate_up": 296,
                                                                          "down": 28}
    for r in ctas:   # same GEMM, other tiles
        big, small = specs["prefill." + r], specs["prefill.small." + r]
        assert (small.n, small.k, small.epilogue, small.bias) == (big.n, big.k, big.epilogue, big.bias)
        assert (small.bm, small.bn, small.split_k) == ((32, 64) if r == "gate_up" else (16, 32)) + (1,)


def at_tokens(ptr: int, n: int) -> list[int]:
    for buf in MEM:
        if buf.ptr <= ptr and ptr + 4 * n <= buf.ptr + buf.nbytes:
            return buf.mem[ptr - buf.ptr:ptr - buf.ptr + 4 * n].view(np.int32).tolist()
    raise AssertionError("no buffer")


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=11)])
def test_generate_over_a_batched_prefill(nqfile, monkeypatch, sampling):
    """The Runner with a prefill that is not the decode step: the fake device's batched prefill (K/V of
    [p0, p1), logits of the last row) and lm_head (tokens_out[P - 1], state (token, P, P)); the decode
    steps are the reference's decode. Tokens must be the reference's own generation; the decode steps
    must be fed the generated tokens only, and a reused prefix is not prefilled again."""
    ref = Reference.from_file(nqfile, max_seq=100)
    run, dev = fake_device(nqfile, monkeypatch, ref, batched_prefill=True)
    check = Reference.from_file(nqfile, max_seq=100)
    for n in (1, 2, 12):
        run.cache.clear()
        dev.fed.clear()
        got = list(run.generate(PROMPT, n, sampling))
        want = reference_generation(check, check.prefill(PROMPT)[-1], n, sampling)
        assert got == want and run.cached_tokens == 0
        assert dev.fed == PROMPT + want[:-1], "the device was fed something other than prompt + generated"
    # the next turn: prompt + reply + more; only [L, P) is prefilled. Class (a): the reused K/V came from
    # decode steps and the reference's prefill computes each row as one, so even sampling on this random
    # model's near-uniform probabilities (which moves with the last bit) gives the cold run's tokens
    q = PROMPT + want + [33, 34, 35]
    dev.fed.clear()
    got = list(run.generate(q, 6, sampling))
    L = len(PROMPT) + len(want) - 1
    assert run.cached_tokens == L and dev.fed[:len(q) - L] == q[L:]
    assert got == reference_generation(check, check.prefill(q)[-1], 6, sampling)


BUCKETS = (8, 16, 32, 64)


def graph_roles(layers: int) -> list[str]:
    """A chunk graph's roles: the small-M GEMMs, the device_chunk rope and split-KV attention + combine."""
    per_layer = ["rmsnorm", "small.qkv", "graph.rope_append", "graph.attention", "graph.attention_combine",
                 "small.o_proj", "rmsnorm", "small.gate_up", "small.down"]
    return ["embed"] + per_layer * layers


def test_chunk_graph_sequences(nqfile, monkeypatch):
    """Each bucket's captured sequence: every row of the bucket through embed, norms and GEMMs, and the
    kernels that place rows at positions (rope, attention, combine) reading p0 and n from graph_in."""
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=512, graph_buckets=BUCKETS)
    pre, kernels = run.prefiller, run.decoder.kernels
    gin = pre.bufs.graph_in.ptr
    assert pre.graphs.buckets == list(BUCKETS) and pre.bufs.graph_in.nbytes == 4 * (2 + 64)
    for b in BUCKETS:
        seq = pre.graphs.sequences[b]
        assert [role for role, _, _ in seq] == graph_roles(nqfile.dims.layers)
        for role, shape, args in seq:
            spec = kernels["prefill." + role][0]
            assert set(args) == {name for name, _ in spec.signature}, role
            assert shape == ((b, spec.max_splits) if role == "graph.attention" else (b,)), role
            if "chunk" in args:
                assert args["chunk"] == gin and spec.device_chunk
            for name in ("m", "n"):
                if name in args:
                    assert args[name] == b, f"{role}.{name}"
        assert seq[0][2]["tokens"] == gin + 8


def test_short_chunks_run_row_gemvs_in_gemv_order(nqfile, monkeypatch):
    """With prefill.gemv_order, a chunk of at most 16 rows runs each norm + GEMM of a layer as one row GEMV
    of the smallest bucket of 8 or 16 rows that holds it (the norm fused, K split as the GEMM splits it),
    kernel by kernel and in its graph; a longer chunk runs rmsnorm_prefill and the GEMV-order GEMMs. Every
    launch matches its kernel's signature, and the GEMVs read and write the buffers the GEMMs would."""
    base = config.default()
    cfg = replace(base, prefill=replace(base.prefill, gemv_order=True))
    log = []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=32, fn=lambda role, spec: RecFn(role, log), cfg=cfg,
                      graph_buckets=BUCKETS)
    pre, kernels, w, b = run.prefiller, run.decoder.kernels, run.shared.weights, run.prefiller.bufs
    assert pre.row_buckets == [8, 16]
    for r in ("qkv", "o_proj", "gate_up", "down"):
        one, gm = kernels[f"prefill.rows16.{r}"][0], kernels[f"prefill.{r}"][0]
        assert one.mma and one.m == 16 and one.splitk == gm.splits and gm.gemv_order
        assert kernels[f"prefill.small.{r}"][0].gemv_order
    run.prefill(list(range(1, 45)), 0, read_token=True)   # chunks of 32 and 12 rows, kernel by kernel
    layers = nqfile.dims.layers
    gemv_layer = ["rows16.qkv", "rope_append", "attention", "rows16.o_proj", "rows16.gate_up", "rows16.down"]
    roles = [r for r, *_ in log]
    first = roles.index("prefill.embed", 1)
    assert roles[:first] == chunk_roles(0, 32, layers)
    assert [r.removeprefix("prefill.") for r in roles[first + 1:-1]] == gemv_layer * layers
    for i in range(layers):
        L = f"L{i}."
        layer = dict(zip(gemv_layer, log[first + 1 + len(gemv_layer) * i:]))
        for role, launch, pdl, args in layer.values():
            spec = kernels[role][0]
            assert pdl and set(args) == {name for name, _ in spec.signature}, role
        qkv, o, gu, down = (layer[r][3] for r in gemv_layer if r.startswith("rows"))
        assert (qkv["h"], qkv["norm_w"], qkv["w0"], qkv["bias"], qkv["y"]) == \
            (b.h, w.ptr(L + "input_norm"), w.ptr(L + "qkv.packed"), w.ptr(L + "qkv.bias"), b.qkv)
        assert (o["x"], o["w0"], o["y"]) == (b.o16, w.ptr(L + "o.packed"), b.h)
        assert (gu["h"], gu["norm_w"], gu["w0"], gu["w1"], gu["s1"], gu["y"]) == \
            (b.h, w.ptr(L + "post_norm"), w.ptr(L + "gate.packed"), w.ptr(L + "up.packed"), w.ptr(L + "up.scales"), b.a16)
        assert (down["x"], down["w0"], down["y"]) == (b.a16, w.ptr(L + "down.packed"), b.h)
    assert pre.graphs.buckets == [8, 16, 32]
    for bucket in pre.graphs.buckets:   # the graphs: 8 and 16 rows as row GEMVs, 32 as GEMMs
        seq = [role for role, _, _ in pre.graphs.sequences[bucket]]
        assert ("rows%d.qkv" % bucket in seq) == (bucket <= 16) and ("small.qkv" in seq) == (bucket > 16)


def test_a_short_tail_is_cut_into_row_gemv_chunks(nqfile, monkeypatch):
    """prefill.row_tail_tokens: a last chunk above the largest row-GEMV bucket (16) and at most that many
    rows becomes chunks of 16 (the last shorter); other chunks, and every chunk without row GEMVs, stay."""
    base = config.default()
    cfg = replace(base, prefill=replace(base.prefill, gemv_order=True))
    pre = fake_runner(nqfile, monkeypatch, capacity=700, chunk=512, cfg=cfg, graph_buckets=BUCKETS).prefiller
    pre.row_tail_tokens = 32
    assert pre._cut_tail([(0, 512), (512, 30)]) == [(0, 512), (512, 16), (528, 14)]
    assert pre._cut_tail([(7, 32)]) == [(7, 16), (23, 16)]
    for parts in ([(0, 33)], [(0, 16)], [(0, 512), (512, 9)]):
        assert pre._cut_tail(parts) == parts
    pre.row_tail_tokens = 0
    assert pre._cut_tail([(0, 30)]) == [(0, 30)]
    fold = fake_runner(nqfile, monkeypatch, capacity=700, chunk=512, graph_buckets=BUCKETS).prefiller
    assert fold.row_buckets == [] and fold._cut_tail([(0, 30)]) == [(0, 30)]


class FakeGraph:
    """A captured chunk graph on the fake device: its replay records the bucket and what graph_in holds."""

    def __init__(self, b, log, gin):
        self.b, self.log, self.gin = b, log, gin

    def launch(self, stream=None):
        self.log.append((self.b, self.gin.mem.view(np.int32)[:2 + self.b].tolist()))


@pytest.mark.parametrize("p0,P,C", [(0, 5, 512), (0, 64, 512), (0, 65, 512), (100, 132, 512), (0, 600, 512),
                                    (37, 600, 512), (0, 100, 32), (3, 50, 16), (0, 70, 64)])
def test_short_chunks_replay_graphs(nqfile, monkeypatch, p0, P, C):
    """Once captured, a chunk of n <= the largest usable bucket replays the smallest bucket holding it,
    with graph_in = (p0, n, its ids, the last id repeated); longer chunks launch kernel by kernel; with
    ``replay`` off every chunk does."""
    log, replays = [], []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=C, fn=lambda role, spec: RecFn(role, log),
                      graph_buckets=BUCKETS)
    pre = run.prefiller
    assert pre.graph_rows() == 0, "not captured: kernel by kernel"
    pre.graphs.graphs = {b: FakeGraph(b, replays, pre.bufs.graph_in) for b in pre.graphs.buckets}
    usable = [b for b in BUCKETS if b <= min(C, SMALL_M)]
    assert pre.graph_rows() == usable[-1]
    prompt = ((np.arange(P) * 37 + 5) % nqfile.dims.vocab).tolist()
    run.prefill(prompt[p0:], p0, read_token=True)
    plan = prefill_mod.chunks(p0, P, C)
    short = [(c0, n) for c0, n in plan if n <= usable[-1]]
    want = []
    for c0, n in short:
        b = next(b for b in usable if b >= n)
        ids = prompt[c0:c0 + n]
        want.append((b, [c0, n] + ids + [ids[-1]] * (b - n)))
    assert replays == want
    assert [r for r, *_ in log] == [role for c0, n in plan if n > usable[-1]
                                    for role in chunk_roles(c0, n, nqfile.dims.layers)] + ["lm_head"]
    log.clear()
    replays.clear()
    pre.replay = False
    run.prefill(prompt[p0:], p0, read_token=True)
    assert not replays and [r for r, *_ in log] == [role for c0, n in plan
                                                    for role in chunk_roles(c0, n, nqfile.dims.layers)] + ["lm_head"]


def test_warm_runs_each_bucket_once(nqfile, monkeypatch):
    """Before the capture each bucket's kernels run once, as one token at position 0 (a valid id in every
    row: the padded rows embed it too)."""
    log = []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=512, fn=lambda role, spec: RecFn(role, log),
                      graph_buckets=BUCKETS)
    pre = run.prefiller
    pre.warm()
    roles = ["prefill." + r for r in graph_roles(nqfile.dims.layers)]
    assert [r for r, *_ in log] == roles * len(BUCKETS)
    assert pre.bufs.graph_in.mem.view(np.int32)[:2 + 64].tolist() == [0, 1] + [0] * 64
    with pytest.raises(ValueError, match="a chunk graph takes 1..64 rows, got 65"):
        pre.graphs.bucket(65)
