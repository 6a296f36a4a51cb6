#!/usr/bin/env bash
# The server stack as wheels in .whl/ (git-ignored) for the GPU machine, which has no package registry:
# name .whl in the device call's carry; tools/gpu_check.sh installs them first. Versions are those of this
# checkout's .venv (pip install -e '.[test,tools]'), for CPython 3.12 on x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# fastapi, uvicorn, openai, llguidance, gguf and what they need beyond the GPU machine's own packages
names="fastapi starlette uvicorn pydantic pydantic_core annotated-doc annotated-types typing-inspection
       typing_extensions openai jiter click anyio sniffio h11 httpx2 httpcore2 truststore opentelemetry-api
       llguidance gguf"
mkdir -p .whl
for n in $names; do
    v=$($PY -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "fetch_wheels: $n is not installed in $PY's environment" >&2; exit 1; }
    ok=
    for plat in manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
        if $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
               --abi cp312 --abi abi3 --abi none --platform "$plat" --platform any -d .whl "$n==$v" 2>/dev/null; then
            ok=1; break
        fi
    done
    [ -n "$ok" ] || { echo "fetch_wheels: no wheel of $n==$v for CPython 3.12 x86-64" >&2; exit 1; }
done
ls .whl
