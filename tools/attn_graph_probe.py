"""Throwaway: attention_decode alone, graph-timed with PDL between launches, m rows at 1..3 CTAs per SM."""
import dataclasses, json, sys
import numpy as np
from nanoqwen import codegen, config
from nanoqwen.codegen.kernels import attention as A
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
CFG = config.default(); d = QWEN25_7B; PAGE = 16; NP = 1100
rng = np.random.default_rng(0)
kv = rng.standard_normal((NP, d.kv_heads, PAGE, d.head_dim)).astype(np.float16)
k_pool = driver.DeviceBuffer.from_array(kv); v_pool = driver.DeviceBuffer.from_array(kv)
table = driver.DeviceBuffer.from_array(rng.permutation(NP).astype(np.int32))
q = driver.DeviceBuffer.from_array((rng.standard_normal((16, d.q_dim))).astype(np.float32))
state = driver.DeviceBuffer(16)
specs = [dataclasses.replace(A.decode_specs(d, CFG, m=m)[1], ctas_per_sm=c, stages=st)
         for m in (1, 2, 4, 8, 16) for c, st in ((1, 8), (3, 8), (3, 4), (4, 4)) if m > 1 or c == 1]
built = {b.spec: (driver.load(b), b.resources) for b in codegen.build_many(specs)}
stream = driver.Stream(); out = []
for L in (577, 4097):
    for s in specs:
        m = s.m
        acc, ml = (driver.DeviceBuffer(n) for n in A.partial_bytes(s))
        pos = driver.DeviceBuffer.from_array(np.concatenate([np.arange(L - 1, L - 1 + m), np.zeros(m)]).astype(np.int32))
        state.upload(np.array([0, L - 1, 0, 0], np.int32))
        where = {"state": state} if m == 1 else {"positions": pos}
        args = dict(**where, q_rot=q, k_pool=k_pool, v_pool=v_pool, page_table=table, part_acc=acc, part_ml=ml)
        fn, res = built[s]
        fn.launch(s.launch(), stream, True, **args); stream.synchronize()
        with driver.capture(stream) as g:
            for _ in range(50):
                fn.launch(s.launch(), stream, True, **args)
        best = 1e9
        for _ in range(5):
            a, b = driver.Event(), driver.Event()
            a.record(stream); g.launch(stream); b.record(stream); stream.synchronize()
            best = min(best, driver.Event.elapsed_ms(a, b) * 1000 / 50)
        g.close()
        r = dict(L=L, m=m, ctas_per_sm=s.ctas_per_sm, stages=s.stages, registers=res.registers,
                 spill_stores=res.spill_stores, us=round(best, 2))
        print(r, flush=True); out.append(r)
        acc.free(); ml.free(); pos.free()
json.dump(out, open(sys.argv[1], "w"), indent=1)
