#!/usr/bin/env bash
# llama.cpp for the same-run comparison (nanoqwen/bench/llamacpp.py), built on this machine for the GPU machine
# (sm_90 machine code only, CUDA 13) into .llama/ (git-ignored): llama-server, llama-bench and their libraries.
# The device call carries .llama.tar.xz (24 MB; the folder is 59 MB, and a call carries 64 MiB in all), which
# tools/gpu_check.sh unpacks. About an hour on 2 cores; a second run reuses the build folder.
#   source   the llama.cpp that the sdist of llama-cpp-python 0.3.36 (PyPI) vendors: commit 0c1e570 (2026-10-01)
#   cuBLAS   headers and library from NVIDIA's nvidia-cublas 13.0 wheel, put into the toolkit (as its cuBLAS
#            package would be) to link against; at run time the binaries take the GPU machine's own cuBLAS
#   libcuda  a stub with the driver's soname: the driver exists only on the GPU machine. The backends link with
#            --no-as-needed so that the stub, which defines nothing, stays a dependency: the driver's symbols
#            (cuMemCreate, ...) resolve through it when the CUDA backend is loaded there
# The CUDA backend is a loadable module (GGML_BACKEND_DL): where it cannot load (no driver, as here) the same
# binaries run on the CPU backend, which is how tests/test_bench_llamacpp.py runs llama-server here.
# Needs nvcc 13 in $CUDA_HOME (default /usr/local/cuda), cmake, ninja and a C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SDIST=llama-cpp-python==0.3.36
CUBLAS=nvidia-cublas==13.0.0.19
work=${LLAMA_BUILD_DIR:-/tmp/nanoqwen-llama-build}
mkdir -p "$work"

src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$src" ]; then
    $PY -m pip download -q --no-deps --no-binary :all: "$SDIST" -d "$work"
    tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
fi

lib=$(readlink -f "$CUDA_HOME/lib64")
inc=$(readlink -f "$CUDA_HOME/include")
if [ ! -e "$lib/libcublas.so" ]; then
    $PY -m pip download -q --no-deps "$CUBLAS" -d "$work"
    rm -rf "$work/cublas" && mkdir "$work/cublas" && (cd "$work/cublas" && unzip -q "$work"/nvidia_cublas-*.whl)
    c="$work/cublas/nvidia/cu13"
    cp -a "$c"/include/*.h "$inc/"
    for l in libcublas libcublasLt; do cp -a "$c/lib/$l.so.13" "$lib/"; ln -sf "$l.so.13" "$lib/$l.so"; done
fi
if [ ! -e "$lib/stubs/libcuda.so" ]; then
    mkdir -p "$lib/stubs"
    echo 'void nanoqwen_libcuda_stub(void) {}' > "$work/stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/stubs/libcuda.so" "$work/stub.c"
fi

cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME" \
    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH='$ORIGIN' -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" \
    -DCMAKE_SHARED_LINKER_FLAGS="-static-libstdc++ -static-libgcc" \
    -DCMAKE_MODULE_LINKER_FLAGS="-static-libstdc++ -static-libgcc -Wl,--no-as-needed" >/dev/null
ninja -C "$src/build" -j "$(nproc)" llama-server llama-bench ggml-cuda ggml-cpu
readelf -d "$src/build/bin/libggml-cuda.so" | grep -q 'NEEDED.*libcuda\.so\.1' \
    || { echo "build_llama: libggml-cuda.so does not depend on libcuda.so.1: it would not load" >&2; exit 1; }

rm -rf .llama && mkdir .llama
for f in "$src"/build/bin/*; do   # each file once, under the name the loader asks for (its soname): no links
    [ -L "$f" ] && continue
    name=$(readelf -d "$f" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    cp "$f" ".llama/${name:-$(basename "$f")}"
done
cp -L "$(cc -print-file-name=libgomp.so.1)" .llama/   # the CPU backend's OpenMP, found through $ORIGIN
strip --strip-unneeded .llama/*
tar -cJf .llama.tar.xz .llama
du -sh .llama .llama.tar.xz
