#!/usr/bin/env bash
# A GEMV sweep's candidates compiled here, into .kcache/, for tools/gpu_check.sh to seed the device's kernel
# cache with (carry [".kcache"], or [".kcache.tar.xz"] past the carry's 64 MiB: `tar -cJf .kcache.tar.xz .kcache`),
# so that the tuner's call spends its time judging. The cache key holds the NVRTC version, so the compiler must
# be the device's (13.0): .venv13 has cuda-bindings 13 and NVRTC 13.0 from PyPI beside the project's venv, which
# may have 12.
#   bash tools/kcache.sh "NVIDIA H100 80GB HBM3" --rows 16 --roles down
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv13/bin/python ]; then
    python3 -m venv .venv13
    .venv13/bin/pip install -q "cuda-bindings==13.*" "nvidia-cuda-nvrtc==13.0.*" numpy jinja2 pyyaml
fi
gpu=$1
shift
NANOQWEN_CACHE_DIR=.kcache PYTHONPATH=. exec .venv13/bin/python -m nanoqwen.cli.tune --compile-only "$gpu" "$@"
