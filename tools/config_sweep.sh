#!/usr/bin/env bash
# Decode benchmarks of config variants, one device call: each argument NAME:SED (a sed script, or nothing for
# the config as it is) is applied to config/nanoqwen.yaml, `nanoqwen bench 7b` runs at $SWEEP_PROMPT prompt
# tokens (default 16384; 64 timed steps, one repetition), and the config is restored. One JSON comes back:
# $OUT/config-sweep.json, per variant its ms/token p50, graph step, the eager attention region and the copy
# bandwidth of the same run (what results/attention-sweep-16k-h200-2026-12-04.json was made of by hand).
#   tools/config_sweep.sh bulk: mma-s8:'s/^  pipeline: bulk/  pipeline: mma/;s/^  stages: 3 /  stages: 8 /'
# SWEEP_DRY=1 prints each variant's config change instead of running it (what the CPU can check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nanoqwen-config-sweep}
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT/variants"
cp config/nanoqwen.yaml "$OUT/variants/original.yaml"
restore() { [ -f "$OUT/variants/original.yaml" ] && cp "$OUT/variants/original.yaml" config/nanoqwen.yaml; }
trap restore EXIT
for arg in "$@"; do
    name=${arg%%:*}
    script=${arg#*:}
    cp "$OUT/variants/original.yaml" config/nanoqwen.yaml
    [ -n "$script" ] && sed -i "$script" config/nanoqwen.yaml
    if [ "${SWEEP_DRY:-0}" = 1 ]; then
        echo "== $name"; diff "$OUT/variants/original.yaml" config/nanoqwen.yaml
        continue
    fi
    NANOQWEN_COMMIT="${NANOQWEN_COMMIT:-unknown}-$name" timeout 300 $PY -m nanoqwen.cli.main bench 7b --no-baseline \
        --prompt-tokens "${SWEEP_PROMPT:-16384}" --gen-tokens 64 --repetitions 1 --warmup 1 \
        --out "$OUT/variants/$name.json" > "$OUT/variants/$name.log" 2>&1
    echo "== $name: rc=$?"; grep -E "ms/token p50|paged_attention" "$OUT/variants/$name.log"
done
restore
[ "${SWEEP_DRY:-0}" = 1 ] && exit 0
$PY - "$OUT" "$@" <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), [a.split(":", 1)[0] for a in sys.argv[2:]]
runs = []
for name in names:
    try:
        d = json.loads((out / "variants" / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        runs.append({"config": name, "error": str(e)})
        continue
    runs.append({"config": name, "commit": d["commit"], "date": d["date"],
                 "ms_per_token_p50": d["latency"]["ms_per_token"]["p50"], "graph_step_ms": d["itl"]["graph_step_ms"],
                 "attention_eager_ms": d["itl"]["regions_ms"].get("paged_attention"), "copy_GBps": d["copy"]["GBps"]})
gpu = next((json.loads((out / "variants" / f"{n}.json").read_text())["gpu"]["name"] for n in names
            if (out / "variants" / f"{n}.json").exists()), None)
(out / "config-sweep.json").write_text(json.dumps({"kind": "nanoqwen-config-sweep", "gpu": gpu, "variants": sys.argv[2:],
                                                   "runs": runs}, indent=1) + "\n")
print(json.dumps(runs, indent=1))
PY
rm -rf "$OUT/variants"   # only the summary comes back (the device returns at most 8 files)
