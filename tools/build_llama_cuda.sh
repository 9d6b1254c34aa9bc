#!/usr/bin/env bash
# Builds llama.cpp's CUDA tools (llama-bench, llama-speculative-simple) for Hopper (sm_90) on a
# machine WITHOUT a GPU or a system CUDA toolkit, and packs them into target/llama-cuda.tar.xz,
# which tools/device_bench.sh unpacks on the GPU machine to measure llama.cpp beside nextn on the
# same GGUF files. Nothing of llama.cpp enters the repository: everything lives under target/.
#
#   tools/build_llama_cuda.sh [LLAMA_CPP_SOURCE_DIR]
#
# Steps:
#  1. a Python venv (target/llama-cuda-build/venv) with CUDA 13.0 from PyPI: nvidia-cuda-nvcc (and
#     its nvidia-cuda-crt / nvidia-nvvm parts, pinned too, else pip takes the newest), -cccl,
#     -runtime, -cublas. 13.0 because the GPU machines run driver 580 (CUDA 13.0).
#     The wheels put everything under site-packages/nvidia/cu13/{bin,include,lib,nvvm}; they lack
#     the lib64 folder nvcc looks in, the unversioned libcudart.so / libcublas.so links and the
#     driver stub libcuda.so, which are made here (the stub is built from cuda.h's function names,
#     SONAME libcuda.so.1, only for linking; the GPU machine's driver library is used at run time).
#     So the build keeps llama.cpp's default VMM memory pool (GGML_CUDA_NO_VMM stays OFF).
#     cuobjdump (nvidia-cuda-cuobjdump; PyPI has none older than 13.2) only checks the result.
#  2. llama.cpp's source: LLAMA_CPP_SOURCE_DIR (or env LLAMA_CPP_SRC) if given, else the
#     llama-cpp-python 0.3.36 sdist from PyPI, whose vendor/llama.cpp is ggml-org/llama.cpp
#     commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f.
#  3. CMake (Release, shared libs, RPATH $ORIGIN): GGML_CUDA=ON, sm_90 machine code only
#     (CMAKE_CUDA_ARCHITECTURES=90-real: no PTX, the H100/H200 run sm_90 code as is), cudart shared,
#     no NCCL, no OpenSSL/curl, no tests. Host CPU code: GGML_NATIVE=OFF with AVX2/FMA/F16C/BMI2
#     (Haswell level, which every H100/H200 host has; no AVX-512, which an AMD Zen 3 host lacks).
#     FlashAttention kernels: llama.cpp's defaults (GGML_CUDA_FA=ON, the default K/V type pairs).
#  4. target/llama-cuda.tar.xz: one folder, llama-cuda/, with the stripped binaries, the llama/ggml
#     shared libraries and libgomp.so.1, plus BUILD-INFO (commit, versions, flags). cudart and
#     cuBLAS are NOT packed: the GPU machine has them (the torch venv's nvidia-* wheels).
#
# Environment: JOBS (parallel compile jobs, default: number of cores), NICE (default 10),
# LLAMA_CUDA_WORK (default target/llama-cuda-build), TARGETS (default "llama-bench
# llama-speculative-simple"), CUDA_ARCH (default 90-real).
set -euo pipefail
# The body is one block, which bash reads whole before running it: editing this file while a build
# runs does not change the running script.
{

root="$(cd "$(dirname "$0")/.." && pwd)"
work="${LLAMA_CUDA_WORK:-$root/target/llama-cuda-build}"
src="${1:-${LLAMA_CPP_SRC:-}}"
jobs="${JOBS:-$(nproc)}"
nice_n="${NICE:-10}"
targets="${TARGETS:-llama-bench llama-speculative-simple}"
arch="${CUDA_ARCH:-90-real}"
tarball="$root/target/llama-cuda.tar.xz"
lcp_version=0.3.36
lcp_commit=0c1e57098bba43ac29e6e3b677cdceebdd22334f
cuda_pins=(
    "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88"
    "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-runtime==13.0.96" "nvidia-cublas==13.0.2.14"
)
mkdir -p "$work"
t0=$(date +%s)

# 1. CUDA toolchain from PyPI.
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q "${cuda_pins[@]}"
"$venv/bin/python" -m pip install -q --no-deps "nvidia-cuda-cuobjdump==13.2.86" \
    || echo "no cuobjdump: the check of the GPU code is skipped"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cuda="$site/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || { echo "no nvcc at $cuda/bin/nvcc" >&2; exit 1; }
# nvcc's profile looks for libraries in lib64; the wheels have lib.
[ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"
for l in cudart cublas cublasLt; do
    ln -sfn "lib$l.so.13" "$cuda/lib/lib$l.so"
done
stubs="$work/stubs"
mkdir -p "$stubs"
if [ ! -f "$stubs/libcuda.so.1" ]; then
    echo '#include <cuda.h>' | gcc -E -P -I"$cuda/include" -x c - \
        | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (\t' | sort -u \
        | awk '{print "void " $1 "(void) {}"}' >"$stubs/libcuda-stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so.1" "$stubs/libcuda-stub.c"
    ln -sfn libcuda.so.1 "$stubs/libcuda.so"
fi
nvcc_version="$("$cuda/bin/nvcc" --version | grep -o 'V[0-9][0-9.]*' | head -1)"

# 2. Source.
if [ -z "$src" ]; then
    sdist="$work/sdist"
    mkdir -p "$sdist"
    if ! ls "$sdist"/llama_cpp_python-$lcp_version.tar.gz >/dev/null 2>&1; then
        "$venv/bin/python" -m pip download -q --no-binary :all: --no-deps \
            -d "$sdist" "llama-cpp-python==$lcp_version"
    fi
    if [ ! -d "$work/src/llama_cpp_python-$lcp_version" ]; then
        mkdir -p "$work/src"
        tar -xzf "$sdist/llama_cpp_python-$lcp_version.tar.gz" -C "$work/src"
    fi
    src="$work/src/llama_cpp_python-$lcp_version/vendor/llama.cpp"
    commit="$lcp_commit"
    origin="PyPI llama-cpp-python==$lcp_version sdist, vendor/llama.cpp"
else
    src="$(cd "$src" && pwd)"
    commit="$(git -C "$src" rev-parse HEAD 2>/dev/null \
        || echo "$lcp_commit (assumed: llama-cpp-python $lcp_version)")"
    origin="$src"
fi
if [ ! -f "$src/ggml/src/ggml-cuda/CMakeLists.txt" ]; then
    echo "not a llama.cpp source tree: $src" >&2
    exit 1
fi
echo "llama.cpp: $origin, commit $commit"

# 3. Configure and build.
build="$work/build"
cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=ON
    -DGGML_CUDA=ON
    "-DCMAKE_CUDA_ARCHITECTURES=$arch"
    -DCMAKE_CUDA_RUNTIME_LIBRARY=Shared
    "-DCMAKE_CUDA_COMPILER=$cuda/bin/nvcc"
    "-DCUDAToolkit_ROOT=$cuda"
    "-DCUDA_cuda_driver_LIBRARY=$stubs/libcuda.so"
    -DGGML_CUDA_NCCL=OFF
    -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON
    -DGGML_CCACHE=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$stubs:$cuda/lib"
    "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$stubs:$cuda/lib"
)
cmake -S "$src" -B "$build" "${cmake_flags[@]}" >"$work/cmake.log" 2>&1 \
    || { tail -40 "$work/cmake.log"; exit 1; }
grep -E 'CUDA Toolkit found|CUDA_ARCHITECTURES|CPU backend|ggml version|llama.cpp version' \
    "$work/cmake.log" || true
tb=$(date +%s)
# shellcheck disable=SC2086
nice -n "$nice_n" cmake --build "$build" --config Release -j "$jobs" --target $targets \
    >"$work/build.log" 2>&1 || { tail -60 "$work/build.log"; exit 1; }
build_s=$(( $(date +%s) - tb ))
echo "build: ${build_s}s with $jobs jobs"

# 4. Pack.
stage="$work/stage/llama-cuda"
rm -rf "$work/stage"
mkdir -p "$stage"
for t in $targets; do
    cp "$build/bin/$t" "$stage/"
done
# The llama/ggml libraries the binaries load (by SONAME, from $ORIGIN), found transitively.
added=1
while [ "$added" = 1 ]; do
    added=0
    for f in "$stage"/*; do
        for so in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            if [ -e "$build/bin/$so" ] && [ ! -e "$stage/$so" ]; then
                cp -L "$build/bin/$so" "$stage/$so"
                added=1
            fi
        done
    done
done
gomp="$(gcc -print-file-name=libgomp.so.1)"
[ -f "$gomp" ] && cp -L "$gomp" "$stage/libgomp.so.1"
strip --strip-unneeded "$stage"/*
missing="$(cd "$stage" && for f in *; do
    LD_LIBRARY_PATH="$cuda/lib:$stubs" ldd "$f" 2>/dev/null | grep 'not found' || true
done | sort -u)"
[ -z "$missing" ] || { echo "unresolved libraries in the package:"; echo "$missing"; }
{
    echo "llama.cpp for nextn's tools/device_bench.sh, built by tools/build_llama_cuda.sh"
    echo "source: $origin"
    echo "commit: $commit"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(gcc --version | head -1)"
    echo "cuda: nvcc $nvcc_version from PyPI: ${cuda_pins[*]}"
    echo "cuda arch: $arch"
    echo "targets: $targets"
    echo "cmake: ${cmake_flags[*]}" | sed "s#$work#<work>#g"
    echo "needs at run time: libcudart.so.13, libcublas.so.13 (+ libcublasLt.so.13),"\
        "libcuda.so.1 (driver >= 580)"
    echo "build step of this run: ${build_s}s, $jobs jobs (short if the build folder was built)"
} >"$stage/BUILD-INFO"
tar -C "$work/stage" -cJf "$tarball" llama-cuda
ls -la "$stage"
# Checks: the CUDA libraries the package expects from the GPU machine, and its GPU code.
echo "needed from the system (ldd, with the build's CUDA libraries on the path):"
for f in "$stage"/*; do
    [ "$(basename "$f")" = BUILD-INFO ] && continue
    LD_LIBRARY_PATH="$cuda/lib:$stubs" ldd "$f" 2>/dev/null | awk '{print $1, $3}'
done | grep -v -E "^(linux-vdso|/lib64/ld-linux)" | grep -v " $stage/" | sed "s#$work#<work>#" \
    | sort -u | sed 's/^/  /'
if [ -x "$cuda/bin/cuobjdump" ]; then
    cuda_lib="$(ls "$stage"/libggml-cuda.so* | head -1)"
    "$cuda/bin/cuobjdump" --list-elf "$cuda_lib" | sed -E 's/.*\.(sm_[0-9a-z]+)\.cubin$/\1/' \
        | sort | uniq -c | sed "s#^#  GPU code in $(basename "$cuda_lib"): #"
    echo "  PTX in it: $("$cuda/bin/cuobjdump" --list-ptx "$cuda_lib" 2>/dev/null | wc -l) entries"
fi
echo "$tarball: $(du -h "$tarball" | cut -f1) ($(( $(date +%s) - t0 ))s in all)"
exit 0
}
