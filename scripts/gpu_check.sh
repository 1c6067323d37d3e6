#!/usr/bin/env bash
# GPU check: every CUDA-parameterised PyTorch test and the kernel benchmark on an NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [HOROVOD_SDIST]
#
# For a machine whose python3 already has PyTorch with CUDA and may have no network
# (the GPU machines this project borrows have PyTorch, nvcc and CMake, no Horovod):
#
# 1. Horovod, when `python3 -c "import horovod.torch"` fails: built from the 0.28.1 sdist
#    (HOROVOD_SDIST, else ./.devcarry/horovod-0.28.1.tar.gz, else downloaded) with
#    PyTorch, Gloo and its CUDA kernels for this GPU (no NCCL, no MPI: ranks sharing one
#    GPU stage CUDA tensors through host memory), the fixes of scripts/horovod_fixes.sh and
#    those newer toolchains need (below), into $HVD_GPU_SITE (default /tmp/hvd-gpu-site).
#    About 2 minutes on 4 cores.
# 2. pytest: tests/test_torch_same_bits.py, tests/test_torch_multiprocess.py and
#    tests/test_bench_kernels.py, the tests whose id says cuda (the CPU ones run in CI).
# 3. scripts/bench_kernels.py --framework torch --device cuda, twice.
#
# With GPU_CHECK_BUILD_ONLY=1 it stops after step 1 (Horovod built and importable), for a
# device call that needs Horovod for something else (e.g. hvd-compress-compare --nodes).
#
# Logs and JSON go to $OUT (default ./gpu-check-out).  Exit status: pytest's.
set -uo pipefail

case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }  # before the cd
OUT=$(absolute "${OUT:-$ROOT/gpu-check-out}")
SITE=$(absolute "${HVD_GPU_SITE:-/tmp/hvd-gpu-site}")
SDIST=$(absolute "${1:-$ROOT/.devcarry/horovod-0.28.1.tar.gz}")
cd "$ROOT"
PY=${PYTHON:-python3}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0))s] $*"; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 1
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda); assert torch.cuda.is_available(), 'PyTorch sees no GPU'" || exit 1

apply_toolchain_fixes() {  # $1 = extracted source tree; what scripts/horovod_fixes.sh predates
    local src=$1
    # GCC 13 no longer includes <string>, <stdexcept>, ... through other headers
    # ("'string' in namespace 'std' does not name a type" in group_table.h): CXXFLAGS below.
    # CMake 4 refuses Gloo's cmake_minimum_required(2.8): CMAKE_POLICY_VERSION_MINIMUM below.
    # nvcc 13 needs at least C++17 for its headers.
    sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' \
        "$src/horovod/common/ops/cuda/CMakeLists.txt"
    # Python 3.12 has no distutils (the build asks it for Python's include folder; the
    # launcher imports find_executable from it).
    sed -i 's/from distutils.sysconfig import get_python_inc; print(get_python_inc())/import sysconfig; print(sysconfig.get_paths()[\\"include\\"])/' \
        "$src/horovod/torch/CMakeLists.txt"
    sed -i 's/^from distutils.spawn import find_executable/from shutil import which as find_executable/' \
        "$src/horovod/runner/js_run.py"
    # setup_requires makes setuptools fetch cffi & co. from PyPI: none needed to build.
    sed -i 's/setup_requires=require_list if is_build_action() else \[\],/setup_requires=[],/' "$src/setup.py"
}

if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
    say "building Horovod 0.28.1 (PyTorch, Gloo, CUDA kernels) into $SITE; log $OUT/horovod-build.log"
    work=$(mktemp -d)
    if [ ! -f "$SDIST" ]; then
        "$PY" -m pip download --no-deps --no-binary :all: horovod==0.28.1 -d "$work" >"$OUT/horovod-build.log" 2>&1 \
            || { echo "no Horovod sdist at $SDIST and none could be downloaded" >&2; exit 1; }
        SDIST=$work/horovod-0.28.1.tar.gz
    fi
    tar xzf "$SDIST" -C "$work"
    src=$work/horovod-0.28.1
    # shellcheck source=scripts/horovod_fixes.sh
    source "$ROOT/scripts/horovod_fixes.sh"
    apply_horovod_fixes "$src" || exit 1
    apply_toolchain_fixes "$src"
    cc=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
    (
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
               HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_BUILD_CUDA_CC_LIST=$cc \
               CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j$(nproc) \
               CXXFLAGS="-include cstdint -include string -include stdexcept -include memory -include functional -include algorithm -include limits -include vector -include mutex -include atomic"
        cd "$src" && "$PY" -m pip wheel --no-deps --no-build-isolation -v -w "$work/whl" . \
            && "$PY" -m pip install -q --no-deps --no-compile --target "$SITE" "$work"/whl/horovod-*.whl
    ) >>"$OUT/horovod-build.log" 2>&1 || { tail -30 "$OUT/horovod-build.log"; echo "Horovod build failed" >&2; exit 1; }
    say "Horovod built"
fi
"$PY" -c "import horovod.torch as hvd; print('horovod', hvd.__file__, 'gloo', hvd.gloo_built(), 'nccl', hvd.nccl_built(), 'cuda', hvd.cuda_built())" || exit 1
"$PY" -c "import horovod.torch as hvd, sys; sys.exit(0 if hvd.cuda_built() else 1)" \
    || echo "note: this Horovod was built without CUDA; CUDA tensors go through host memory" >&2
[ -n "${GPU_CHECK_BUILD_ONLY:-}" ] && { say "built; GPU_CHECK_BUILD_ONLY: no tests"; exit 0; }

say "CUDA tests"
"$PY" -m pytest -p no:cacheprovider -q -rs -k cuda tests/test_torch_same_bits.py \
    tests/test_torch_multiprocess.py tests/test_bench_kernels.py 2>&1 | tee "$OUT/pytest-cuda.log" | tail -15
rc=${PIPESTATUS[0]}
for i in 1 2; do
    say "bench_kernels --framework torch --device cuda, run $i"
    "$PY" scripts/bench_kernels.py --framework torch --device cuda | tee "$OUT/bench-cuda-$i.txt"
done
say "done (pytest exit status $rc)"
exit "$rc"
