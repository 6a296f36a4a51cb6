#!/usr/bin/env bash
# The whole GPU check in ONE device call: the gpu-marked tests (one pytest process per file, so a sticky
# CUDA error in one kernel cannot take the rest down with it), the GEMV kernel benchmark, optionally the
# tuner, the pp512/tg128 model benchmark and the prefill GEMM benchmark. Everything lands under $OUT
# (the device tool's output folder; /tmp/nanoqwen-gpu-check otherwise), at most 8 files.
# Runs from the source tree with the machine's python3 (no installs): PYTHONPATH=.
#   GPU_CHECK_TESTS    test files, space-separated (default: every tests/gpu/test_*.py; "none" skips)
#   GPU_CHECK_PARALLEL_TESTS test files run in lanes beside the others, lanes separated by ";" (e.g.
#                      "tests/gpu/test_gemv.py; tests/gpu/test_gemm.py tests/gpu/test_decode.py": test_gemv's ~260 s
#                      are mostly numpy on the host, so the whole suite and the gate's A/B fit one call); the files
#                      whose tests measure the whole device (ALONE_TESTS: times, free memory) wait until every
#                      lane is done
#   GPU_CHECK_LANES    N: instead, every file but ALONE_TESTS in N lanes of about equal time, from the times
#                      of the newest results/gpu-tests-*.log (tools/test_lanes.py)
#   GPU_CHECK_KERNELS  0 skips the GEMV kernel benchmark
#   GPU_CHECK_TUNE     seconds of nanoqwen-tune budget (default 0: no tuning); tuned.json and tune-progress.json
#                      (every candidate judged: us, % of copy, or why it was discarded). It runs before the tests
#                      and writes this tree's tune/tuned.json, so a gate in the same call tests and A/Bs the tree
#                      with the new entries: commit the returned tuned.json as it is
#   GPU_CHECK_TUNE_COMPILE seconds a sweep may spend compiling its roles' candidates (default 100)
#   GPU_CHECK_TUNE_ROWS multirow buckets to tune (default 1: the decode GEMVs; e.g. 8 or 2,4,8: the m-row kernels
#                      beside this GPU's m = 1 kernels, `nanoqwen-tune --rows`)
#   GPU_CHECK_TUNE_ROLES GEMV roles to tune (default: all four)
#   GPU_CHECK_TUNE_KERNELS kernel families to tune (default gemv; gemv,attention or attention: the decode
#                      attention's fields too, `nanoqwen-tune --kernels`)
#   GPU_CHECK_TUNE_SPACES m = 1 search spaces to sweep (default: all; e.g. gemv_int4_mma: the tensor-core tiles
#                      against the kernels this GPU runs now)
#   GPU_CHECK_MODEL    1 runs `nanoqwen bench 7b --no-baseline` (synthetic 7B, config protocol, ITL plot, profile)
#   GPU_CHECK_TIMELINE 1 runs `nanoqwen bench 7b --no-baseline --timeline --timeline-rows 8`: every kernel of the
#                      decode step and of the 8-row step timed inside the replayed graph (bench-7b-timeline.json
#                      with the per-kernel figures, timeline.png, timeline-rows8.png, and the region chart
#                      beside them, itl-timeline.png); GPU_CHECK_TIMELINE_PROMPT sets its prompt length (default the
#                      config protocol's 512; e.g. 16384 for the long-context step), GPU_CHECK_TIMELINE_ROWS the
#                      multi-row bucket it times (default 8; timeline-rowsM.png)
#   GPU_CHECK_BASELINE 1 runs it again with the PyTorch baselines (transformers fp16, torch int4 GEMV)
#   GPU_CHECK_PREFILL  1 runs the prefill GEMM benchmark (GPU_CHECK_PREFILL_M: its row counts, default 32 512 4096);
#                      "tiles": the INT4 GEMM's tile variants alone, each compared bit for bit with the default tile
#   GPU_CHECK_ATTENTION 1 runs the decode attention benchmark (attention_decode + combine alone, m = 1..16
#                      rows at 577 / 4097 / 16385 keys; GPU_CHECK_ATTENTION_ARGS adds e.g. --variant KEY=VALUE)
#   GPU_CHECK_SERVE    1 runs the server benchmark (TTFT cold / prefix-cached, streamed tokens/s vs the engine);
#                      it and tests/gpu/test_serve.py need fastapi, uvicorn, openai and their dependencies, which
#                      the GPU machine lacks: wheels in .whl/ (tools/fetch_wheels.sh; git-ignored, named in
#                      carry) are installed first
#   GPU_CHECK_CHUNKS   1 times each prefill chunk graph bucket at the end of a 4096-token prompt, against the bytes
#                      it must read (bench/chunks.py: the re-request's prefill without server, host or lm_head;
#                      chunks.json), the 32-row chunk's kernels inside its graph (timeline-chunk32.png), and a cold
#                      512-row chunk kernel by kernel: as a chain and each kernel alone (chunks.json long_chunk)
#   GPU_CHECK_CONCURRENCY 1 runs the server's concurrency table (1..16 streaming clients at once, TTFT while 7
#                      decode; concurrency.json; needs the wheels as GPU_CHECK_SERVE)
#   GPU_CHECK_LLAMA    1 runs llama.cpp on the same GPU (bench/llamacpp.py: llama-bench's pp512 and tg128 at depths
#                      512 / 4096 / 16384, llama-server's concurrency table at -np 8; llamacpp.json) on the
#                      synthetic 7B at Q4_K_M; needs .llama.tar.xz (tools/build_llama.sh; name it in carry), which
#                      is unpacked into .llama/, and the gguf wheel from .whl/
#   GPU_CHECK_LOAD     1 times loading the synthetic 7B with and without payload verification (load-7b.json)
#   GPU_CHECK_SPECULATE 1 runs the speculative-decoding benchmark (multi-row step times, oracle drafts, the
#                      draft model's cost, the small model's code-edit workload; speculate.json); "steps": the
#                      multi-row step times alone (steps.json), and with GPU_CHECK_STEPS_AB=TREE... (.ab/COMMIT,
#                      as below; several, space-separated) the same in each tree, then here again
#                      (steps-COMMIT.json, steps-again.json): an A/B of the m-row kernels in ~3 minutes
#   GPU_CHECK_CHAIN    "ROLE FIELDS..." judges GEMV tile variants inside the decode step (tuning/chain.py: each
#                      FIELD=VALUE,... over ROLE's tuned m = 1 tile, swapped into the captured step of one
#                      session, graph steps in interleaved rounds; chain.json); e.g. "gate_up prefetch=1 unroll=4";
#                      "down --rows 8 rows=2 warps=8": the 8-row kernel's tile in the 8-row step; several judges
#                      in one call separated by ";" (chain.json, chain-2.json, ...)
#   GPU_CHECK_GEMV_PROFILE "TILE..." times GEMV tiles back to back (tools/profile_gemv.py --time; TILE as it takes
#                      them, e.g. "down:lanes=32,splitk=4@4:rows=2,warps=4,ctas_per_sm=3") and profiles one launch of
#                      each with Nsight Compute where the machine has it (ncu.txt: speed of light, warp states,
#                      stall reasons, occupancy, scheduler and instruction statistics)
#   GPU_CHECK_GEMM_PROFILE "TILE..." the same for short-chunk prefill GEMM tiles (tools/profile_gemm.py, TILE as it
#                      takes them, e.g. "qkv gate_up:bn=64 down+order"; GPU_CHECK_GEMM_PROFILE_M rows, default 32):
#                      each timed alone, then Nsight Compute with the memory sections too (ncu-gemm.txt)
#   GPU_CHECK_GEMM_SWEEP "M..." times every role's short-chunk GEMM tiles of tools/profile_gemm.py's SWEEP, both
#                      orders, at each row count (e.g. "8 16 32 64"; gemm-sweep-mM.json)
#   GPU_CHECK_GRAMMAR  1 runs the structured-output benchmark (ms/token of plain greedy, greedy under a
#                      json_schema, the host loop, and the grammar's own mask / advance; grammar.json); it
#                      needs llguidance and pydantic from .whl/ like GPU_CHECK_SERVE
#   GPU_CHECK_GATE     the regression gate for a change to kernels, the runtime or the launch path: a tree
#                      of the commit to hold the line against (tools/ab_tree.sh COMMIT writes .ab/COMMIT;
#                      name .ab in the device call's carry). Runs every GPU test (GPU_CHECK_TESTS may
#                      narrow them: say so with the result), then the same-run A/B of
#                      decode and TTFT against it (ab-decode.json), and fails the check when ms/token, the
#                      graph step or TTFT is more than GPU_CHECK_GATE_PCT (default 1) percent slower.
#   GPU_CHECK_AB       a tree of another commit (as above): the same A/B without the gate;
#                      GPU_CHECK_AB_ALSO="ID=TREE ..." adds trees to every round (a bisection in one call);
#                      GPU_CHECK_AB_ROUNDS rounds (default 2, the gate 3: a 1% step in TTFT must be told from noise)
#   NANOQWEN_COMMIT    commit id recorded in the JSON (the device tree has no .git)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPU_CHECK_GATE:-}" ]; then
    GPU_CHECK_AB=$GPU_CHECK_GATE GPU_CHECK_KERNELS=${GPU_CHECK_KERNELS:-0}   # and every GPU test (the default)
    GPU_CHECK_AB_ROUNDS=${GPU_CHECK_AB_ROUNDS:-3}   # two rounds' TTFT medians spread about 1%, the gate's own size
fi
OUT=${OUT:-/tmp/nanoqwen-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then   # the server stack, carried as wheels (the machine has no registry)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -f .llama.tar.xz ] && [ ! -d .llama ]; then   # llama.cpp's build, carried packed (bench/llamacpp.py)
    tar -xJf .llama.tar.xz
fi
export NANOQWEN_CACHE_DIR=${NANOQWEN_CACHE_DIR:-/tmp/nanoqwen-kernel-cache}
export NANOQWEN_TEST_CACHE_DIR=$NANOQWEN_CACHE_DIR   # the tests reuse the kernels the compile stage built
if [ -f .kcache.tar.xz ] && [ ! -d .kcache ]; then   # the same, packed (a sweep's cubins pack ~12x under xz)
    tar -xJf .kcache.tar.xz
fi
if [ -d .kcache ]; then   # cubins compiled off the device (tools/kcache.sh: NVRTC of the same version)
    mkdir -p "$NANOQWEN_CACHE_DIR" && cp -rnp .kcache/. "$NANOQWEN_CACHE_DIR/"   # -p: not counted as compiled here
fi
LOG="$OUT/run.log"
exec > >(tee -a "$LOG") 2>&1

date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,pstate \
    --format=csv 2>&1 || echo "nvidia-smi not available"
# the CPUs too: NVRTC compiles one kernel a worker thread, a worker per CPU (config codegen.compile_workers)
$PY -c "import sys, numpy, os, cuda.bindings; from cuda.bindings import nvrtc; print(sys.version.split()[0], \
'numpy', numpy.__version__, 'cuda-bindings', cuda.bindings.__version__, 'nvrtc', nvrtc.nvrtcVersion()[1:], \
'cpus', os.cpu_count(), 'usable', len(os.sched_getaffinity(0)))"

# never beside another lane: they compare times, or read the device's free memory (another lane's allocations
# would count as a leak)
ALONE_TESTS="tests/gpu/test_bench.py tests/gpu/test_timeline.py tests/gpu/test_verify_upload.py"
status=0
stage() {  # stage NAME TIMEOUT_S CMD...: run with a time limit, record the outcome
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
    [ "$rc" = 0 ] || status=1
}

ncu_path() {  # Nsight Compute's ncu where the machine has it (nothing where it has none)
    command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1
}

check_start=$(date +%s)   # tools/compile_cost.py: what NVRTC cost this check
# compile every kernel of the 7B and the test models first, in parallel on all cores
stage compile 180 sh -c "$PY -m nanoqwen.cli.gen compile --model 7b >/dev/null"   # quiet, but the stage line shows
test_files() {  # test_files PYTEST_LOG FILE...: one pytest process a file, its log appended to PYTEST_LOG
    local into=$1 f log
    shift
    for f in "$@"; do
        log=/tmp/gpu_check_$(basename "$f" .py).log
        stage "$f" "${GPU_CHECK_TEST_TIMEOUT:-240}" $PY -m pytest -m gpu -q -rfE -p no:cacheprovider "$f" > "$log" 2>&1
        cat "$log" >> "$into"
        grep -a -E "passed|failed|error|FAILED|ERROR|^== " "$log" | tail -30
    done
    return $status
}
if [ "${GPU_CHECK_TUNE:-0}" != 0 ]; then   # before the tests: a gate in the same call tests and times the tuned tree
    # The budget is judging time; each (bucket, family) sweep also compiles its candidates first, outside the
    # budget: GPU_CHECK_TUNE_COMPILE seconds a sweep, all its roles (default 100: ~80 s on the H100 machine for
    # the four m-row GEMV roles at m <= 8; the 16-row gate_up alone needs ~270, its kernels compile at ~15 a
    # minute)
    sweeps=$(( $(tr ',' '\n' <<< "${GPU_CHECK_TUNE_ROWS:-1}" | grep -c .) \
               * $(tr ',' '\n' <<< "${GPU_CHECK_TUNE_KERNELS:-gemv}" | grep -c .) ))
    stage tune $(( GPU_CHECK_TUNE + ${GPU_CHECK_TUNE_COMPILE:-100} * sweeps + 20 )) \
        $PY -m nanoqwen.cli.tune --repo --budget "$GPU_CHECK_TUNE" --rows "${GPU_CHECK_TUNE_ROWS:-1}" \
        --roles "${GPU_CHECK_TUNE_ROLES:-qkv,o_proj,gate_up,down}" --kernels "${GPU_CHECK_TUNE_KERNELS:-gemv}" \
        ${GPU_CHECK_TUNE_SPACES:+--spaces "$GPU_CHECK_TUNE_SPACES"}
    cp tune/tuned.json "$OUT/tuned.json" 2>/dev/null
    # every candidate judged on this machine (us, % of copy, or why it was discarded), not only the winners
    cat "$($PY -c 'from nanoqwen import config; print(config.cache_root())')"/tune/progress/*.json \
        > "$OUT/tune-progress.json" 2>/dev/null
fi
if [ "${GPU_CHECK_TESTS:-}" != none ]; then
    files=(${GPU_CHECK_TESTS:-tests/gpu/test_*.py})
    if [ -n "${GPU_CHECK_LANES:-}" ] && [ -z "${GPU_CHECK_PARALLEL_TESTS:-}" ]; then   # balanced by past times
        together=()
        for f in "${files[@]}"; do [[ " $ALONE_TESTS " == *" $f "* ]] || together+=("$f"); done
        GPU_CHECK_PARALLEL_TESTS=$($PY tools/test_lanes.py "$GPU_CHECK_LANES" "${together[@]}") || status=1
        echo "lanes: $GPU_CHECK_PARALLEL_TESTS"
    fi
    parallel=${GPU_CHECK_PARALLEL_TESTS:-}
    IFS=';' read -ra lanes <<< "$parallel"
    laned=" ${parallel//;/ } " serial=() rest=()
    for f in "${files[@]}"; do
        if [[ "$laned" == *" $f "* ]]; then :
        elif [ -n "$parallel" ] && [[ " $ALONE_TESTS " == *" $f "* ]]; then serial+=("$f")
        else rest+=("$f"); fi
    done
    pids=() logs=()
    for l in "${lanes[@]}"; do   # each lane beside the others; ALONE_TESTS after all of them
        mine=()
        for f in $l; do [[ " ${files[*]} " == *" $f "* ]] && mine+=("$f"); done
        [ ${#mine[@]} -gt 0 ] || continue
        logs+=("$(mktemp)")
        test_files "${logs[-1]}" "${mine[@]}" &
        pids+=($!)
    done
    test_files "$OUT/pytest.log" "${rest[@]}"
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || status=1
        cat "${logs[$i]}" >> "$OUT/pytest.log" && rm -f "${logs[$i]}"
    done
    test_files "$OUT/pytest.log" "${serial[@]}"
fi
[ "${GPU_CHECK_KERNELS:-1}" != 0 ] && stage kernels 150 $PY -m nanoqwen.cli.main bench --kernels --out "$OUT/kernels.json"
[ "${GPU_CHECK_MODEL:-0}" = 1 ] && stage model 200 $PY -m nanoqwen.cli.main bench 7b --no-baseline \
    --out "$OUT/bench-7b.json" --plot "$OUT/itl.png" --profile "$OUT/profile-7b.json"
[ "${GPU_CHECK_TIMELINE:-0}" = 1 ] && stage timeline 300 $PY -m nanoqwen.cli.main bench 7b --no-baseline \
    ${GPU_CHECK_TIMELINE_PROMPT:+--prompt-tokens "$GPU_CHECK_TIMELINE_PROMPT"} \
    --out "$OUT/bench-7b-timeline.json" --plot "$OUT/itl-timeline.png" --timeline "$OUT/timeline.png" \
    --timeline-rows "${GPU_CHECK_TIMELINE_ROWS:-8}"
[ "${GPU_CHECK_BASELINE:-0}" = 1 ] && stage baseline "${GPU_CHECK_BASELINE_TIMEOUT:-300}" \
    $PY -m nanoqwen.cli.main bench 7b --out "$OUT/bench-7b-baseline.json"
[ "${GPU_CHECK_PREFILL:-0}" != 0 ] && stage prefill 240 $PY -m nanoqwen.bench.prefill ${GPU_CHECK_PREFILL_M:+--m $GPU_CHECK_PREFILL_M} \
    $([ "$GPU_CHECK_PREFILL" = tiles ] && echo --tiles) --json "$OUT/prefill.json"
[ "${GPU_CHECK_ATTENTION:-0}" = 1 ] && stage attention 240 $PY -m nanoqwen.bench.attention \
    ${GPU_CHECK_ATTENTION_ARGS:-} --json "$OUT/attention.json"
[ "${GPU_CHECK_SERVE:-0}" = 1 ] && stage serve 540 $PY -m nanoqwen.bench.serve --json "$OUT/serve-7b.json"
[ "${GPU_CHECK_CONCURRENCY:-0}" = 1 ] && stage concurrency 540 $PY -m nanoqwen.bench.serve --concurrency \
    --json "$OUT/concurrency.json"
[ "${GPU_CHECK_CHUNKS:-0}" = 1 ] && stage chunks 300 $PY -m nanoqwen.bench.chunks --timeline 32 --profile-rows 512 \
    --json "$OUT/chunks.json"
[ "${GPU_CHECK_SPECULATE:-0}" = 1 ] && stage speculate 400 $PY -m nanoqwen.bench.speculate --json "$OUT/speculate.json"
if [ "${GPU_CHECK_SPECULATE:-0}" = steps ]; then   # this tree, then each A/B tree's, then this tree's again
    stage steps 150 $PY -m nanoqwen.bench.speculate --steps --json "$OUT/steps.json"
    for tree in ${GPU_CHECK_STEPS_AB:-}; do
        name=$(basename "$tree")
        stage "steps-$name" 150 sh -c "cd '$tree' && NANOQWEN_COMMIT='$name' PYTHONPATH=. $PY -m \
            nanoqwen.bench.speculate --steps --json '$OUT/steps-$name.json'"
    done
    [ -n "${GPU_CHECK_STEPS_AB:-}" ] && stage steps-again 150 $PY -m nanoqwen.bench.speculate --steps \
        --json "$OUT/steps-again.json"
fi
if [ -n "${GPU_CHECK_CHAIN:-}" ]; then   # one judge a ";"-separated part: chain.json, chain-2.json, ...
    IFS=';' read -ra judges <<< "$GPU_CHECK_CHAIN"
    for i in "${!judges[@]}"; do
        suffix=$([ "$i" = 0 ] || echo "-$(( i + 1 ))")
        stage "chain$suffix" 300 $PY -m nanoqwen.tuning.chain ${judges[$i]} --json "$OUT/chain$suffix.json"
    done
fi
if [ -n "${GPU_CHECK_GEMV_PROFILE:-}" ]; then   # GEMV tiles back to back, then their Nsight Compute sections
    stage gemv-time 200 $PY tools/profile_gemv.py --time $GPU_CHECK_GEMV_PROFILE
    ncu=$(ncu_path)
    if [ -n "$ncu" ]; then
        stage ncu 300 sh -c "'$ncu' --clock-control none --section SpeedOfLight --section WarpStateStats \
            --section Occupancy --section SchedulerStats --section InstructionStats --section LaunchStats \
            --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
            -k regex:gemv_int4 $PY tools/profile_gemv.py --runs 1 $GPU_CHECK_GEMV_PROFILE > '$OUT/ncu.txt' 2>&1"
    else
        echo "== ncu: not found on this machine"
    fi
fi
if [ -n "${GPU_CHECK_GEMM_PROFILE:-}" ]; then   # short-chunk GEMM tiles alone, then their Nsight Compute sections
    gemm_m=(--m "${GPU_CHECK_GEMM_PROFILE_M:-32}")
    stage gemm-time 200 $PY tools/profile_gemm.py --time "${gemm_m[@]}" --json "$OUT/gemm-time.json" \
        $GPU_CHECK_GEMM_PROFILE
    ncu=$(ncu_path)
    if [ -n "$ncu" ]; then
        stage ncu-gemm 300 sh -c "'$ncu' --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \
            --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
            -k regex:gemm_int4 $PY tools/profile_gemm.py ${gemm_m[*]} $GPU_CHECK_GEMM_PROFILE \
            > '$OUT/ncu-gemm.txt' 2>&1"
    else
        echo "== ncu: not found on this machine"
    fi
fi
for m in ${GPU_CHECK_GEMM_SWEEP:-}; do   # the short-chunk GEMM tiles of both orders at m rows
    stage "gemm-sweep-m$m" 200 $PY tools/profile_gemm.py --time --sweep --m "$m" --json "$OUT/gemm-sweep-m$m.json" \
        qkv o_proj gate_up down qkv+order o_proj+order gate_up+order down+order
done
[ "${GPU_CHECK_GRAMMAR:-0}" = 1 ] && stage grammar 400 $PY -m nanoqwen.bench.grammar --json "$OUT/grammar.json"
[ "${GPU_CHECK_LLAMA:-0}" = 1 ] && stage llamacpp 540 $PY -m nanoqwen.bench.llamacpp --json "$OUT/llamacpp.json"
[ "${GPU_CHECK_LOAD:-0}" = 1 ] && stage load 400 $PY tools/measure_load.py --model 7b --out "$OUT/load-7b.json"
if [ -n "${GPU_CHECK_AB:-}" ]; then
    ab_args=(--old-commit "$(basename "$GPU_CHECK_AB")" --rounds "${GPU_CHECK_AB_ROUNDS:-2}" --out "$OUT/ab-decode.json")
    [ -n "${GPU_CHECK_GATE:-}" ] && ab_args+=(--gate "${GPU_CHECK_GATE_PCT:-1}")
    for t in ${GPU_CHECK_AB_ALSO:-}; do ab_args+=(--also "$t"); done
    stage ab "${GPU_CHECK_AB_TIMEOUT:-560}" $PY tools/ab_bench.py "$GPU_CHECK_AB" "${ab_args[@]}"
fi
$PY tools/compile_cost.py "$NANOQWEN_CACHE_DIR" "$check_start" || true
grep -a -E "^== " "$LOG"
exit $status
