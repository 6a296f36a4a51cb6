#!/usr/bin/env bash
# The whole GPU check in ONE device call: the gpu-marked tests, then the GEMV kernel benchmark.
# Logs and JSON land under $OUT (the device tool's output folder; /tmp/nanoqwen-gpu-check otherwise).
# Runs from the source tree with the machine's python3 (no installs): PYTHONPATH=. and cuda-bindings
# finding NVRTC itself; the nvidia-cuda-nvrtc lib folder is added to LD_LIBRARY_PATH as a fallback.
#   GPU_CHECK_TESTS   pytest targets (default: the whole suite, -m gpu)
#   GPU_CHECK_BENCH   0 skips the benchmark; GPU_CHECK_BENCH_ARGS adds arguments (e.g. --sweep)
#   NANOQWEN_COMMIT   commit id recorded in the JSON (the device tree has no .git)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nanoqwen-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export NANOQWEN_CACHE_DIR=${NANOQWEN_CACHE_DIR:-/tmp/nanoqwen-kernel-cache}
nvrtc_dir=$($PY - <<'PYEOF' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages(), "/usr/local/cuda/lib64"]
hits = sorted(p for r in roots for p in glob.glob(os.path.join(r, "**", "libnvrtc.so*"), recursive=True)
              if "stubs" not in p)
print(os.path.dirname(hits[-1]) if hits else "")
PYEOF
)
[ -n "$nvrtc_dir" ] && export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,pstate \
        --format=csv 2>&1 || echo "nvidia-smi not available"
    echo "nvrtc dir: ${nvrtc_dir:-<not found>}"
    $PY -c "import sys, numpy, cuda.bindings; from cuda.bindings import nvrtc; print(sys.version.split()[0], \
'numpy', numpy.__version__, 'cuda-bindings', cuda.bindings.__version__, 'nvrtc', nvrtc.nvrtcVersion()[1:])"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

t0=$(date +%s)
# shellcheck disable=SC2086
$PY -m pytest -m gpu -q -rfE -p no:cacheprovider ${GPU_CHECK_TESTS:-} 2>&1 | tee "$OUT/pytest-gpu.log"
rc_tests=${PIPESTATUS[0]}
echo "gpu tests: rc=$rc_tests in $(( $(date +%s) - t0 )) s"

rc_bench=0
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    t0=$(date +%s)
    $PY -m nanoqwen.cli.main bench --kernels ${GPU_CHECK_BENCH_ARGS:-} --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
    rc_bench=${PIPESTATUS[0]}
    echo "kernel bench: rc=$rc_bench in $(( $(date +%s) - t0 )) s"
fi
grep -E "passed|failed|error" "$OUT/pytest-gpu.log" | tail -3
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
