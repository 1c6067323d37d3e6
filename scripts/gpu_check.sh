#!/usr/bin/env bash
# GPU check: the CUDA-parameterised PyTorch tests, the kernel benchmark, the examples and the
# comparison on an NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [HOROVOD_SDIST]
#
# For a machine whose python3 already has PyTorch with CUDA and may have no network
# (the GPU machines this project borrows have PyTorch, nvcc and CMake, no Horovod):
#
# 1. Horovod, when `python3 -c "import horovod.torch"` fails: built from the 0.28.1 sdist
#    (HOROVOD_SDIST, else ./.devcarry/horovod-0.28.1.tar.gz, else downloaded) with the
#    fixes of scripts/horovod_fixes.sh and those newer toolchains need (below), twice and
#    at the same time:
#    - PyTorch, Gloo and its CUDA kernels for this GPU into $HVD_GPU_SITE (default
#      /tmp/hvd-gpu-site): ranks sharing one GPU stage CUDA tensors through host memory
#      (NCCL refuses two ranks on one GPU);
#    - the same with NCCL for CUDA tensors (HOROVOD_GPU_OPERATIONS=NCCL) into
#      $HVD_GPU_SITE-nccl, where the machine has NCCL: the `nvidia-nccl` wheel that CUDA
#      PyTorch brings (its folder becomes HOROVOD_NCCL_HOME, linked shared), or
#      HOROVOD_NCCL_HOME if set. GPU_CHECK_NCCL=0 skips it.
#    About 2-3 minutes on 16 cores. `--check-build` of each is printed.
# 2. tests: the tests whose id says cuda or gpu (the CPU ones run in CI) in the modules
#    with CUDA cases: same bits, multiprocess, kernel benchmark, Triton kernels, the DDP
#    hook, the device option, the torch examples.
# 3. bench: scripts/bench_kernels.py --framework torch --device cuda, twice.
# 4. examples: the torch examples with --device cuda at np 1 through the NCCL build (the
#    Gloo build without NCCL), and at np 2 on the one GPU through the Gloo build.
# 5. compare: hvd-compress-compare --device cuda --np 1 2, uncapped (top-k 1%, 1-bit, none; the
#    Gloo build: its np 2 shares the GPU), results under $OUT/compare.
#
# GPU_CHECK_STEPS picks steps (default "tests bench"; "all" = tests bench examples
# compare); Horovod is built whatever it says. GPU_CHECK_BUILD_ONLY=1 is
# GPU_CHECK_STEPS="" (Horovod built and importable, nothing else), for a device call that
# needs Horovod for something else (e.g. hvd-compress-compare --nodes).
#
# Logs and JSON go to $OUT (default ./gpu-check-out).  Exit status: the first failed
# step's (pytest's, an example's or compare's), else 0.
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

command -v nvidia-smi >/dev/null || { echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi not found)" >&2; exit 1; }
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

# shellcheck source=scripts/nccl_home.sh
source "$ROOT/scripts/nccl_home.sh"
have_nccl() {  # NCCL given (HOROVOD_NCCL_INCLUDE and _LIB, or _HOME) or in the nvidia-nccl wheel
    { [ -n "${HOROVOD_NCCL_INCLUDE:-}" ] && [ -n "${HOROVOD_NCCL_LIB:-}" ]; } && return 0
    local probe; probe=$(mktemp -d) && stage_nccl "$PY" "$probe" >/dev/null
}

build_horovod() {  # $1 = target site folder, $2 = "nccl" or "gloo", $3 = make jobs; log $OUT/horovod-build-$2.log
    local site=$1 kind=$2 jobs=$3 log=$OUT/horovod-build-$2.log work src cc stage
    work=$(mktemp -d)
    local sdist=$SDIST
    if [ ! -f "$sdist" ]; then
        "$PY" -m pip download --no-deps --no-binary :all: horovod==0.28.1 -d "$work" >"$log" 2>&1 \
            || { echo "no Horovod sdist at $SDIST and none could be downloaded" >&2; return 1; }
        sdist=$work/horovod-0.28.1.tar.gz
    fi
    tar xzf "$sdist" -C "$work"
    src=$work/horovod-0.28.1
    # shellcheck source=scripts/horovod_fixes.sh
    source "$ROOT/scripts/horovod_fixes.sh"
    apply_horovod_fixes "$src" >>"$log" 2>&1 || return 1
    apply_toolchain_fixes "$src"
    cc=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
    (
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
               HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_BUILD_CUDA_CC_LIST=$cc \
               CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j$jobs \
               CXXFLAGS="-include cstdint -include string -include stdexcept -include memory -include functional -include algorithm -include limits -include vector -include mutex -include atomic"
        # the Gloo build takes no GPU operations the caller may have exported
        unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST \
              HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER
        if [ "$kind" = nccl ]; then
            export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
            if [ -n "${HOROVOD_NCCL_INCLUDE:-}" ] && [ -n "${HOROVOD_NCCL_LIB:-}" ]; then
                echo "NCCL from HOROVOD_NCCL_INCLUDE=$HOROVOD_NCCL_INCLUDE HOROVOD_NCCL_LIB=$HOROVOD_NCCL_LIB"
            else
                stage=$(stage_nccl "$PY" "$work/nccl") || { echo "no NCCL on this machine"; exit 1; }
                export HOROVOD_NCCL_HOME=$stage HOROVOD_NCCL_INCLUDE=$stage/include \
                       HOROVOD_NCCL_LIB=$stage/lib
                echo "NCCL from $stage ($(readlink -f "$stage/lib/libnccl.so"))"
            fi
        fi
        cd "$src" && "$PY" -m pip wheel --no-deps --no-build-isolation -v -w "$work/whl" . \
            && "$PY" -m pip install -q --no-deps --no-compile --target "$site" "$work"/whl/horovod-*.whl
    ) >>"$log" 2>&1 || { tail -30 "$log"; echo "Horovod build ($kind) failed, log $log" >&2; return 1; }
}

NCCL_SITE=$SITE-nccl
WANT_NCCL=${GPU_CHECK_NCCL:-1}
[ "$WANT_NCCL" = 1 ] && ! have_nccl && { say "no NCCL on this machine: Gloo build only"; WANT_NCCL=0; }
pids=()
if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
    say "building Horovod 0.28.1 (PyTorch, Gloo, CUDA kernels) into $SITE"
    jobs=$(nproc); [ "$WANT_NCCL" = 1 ] && jobs=$(( (jobs + 1) / 2 ))
    build_horovod "$SITE" gloo "$jobs" & pids+=($!)
fi
if [ "$WANT_NCCL" = 1 ] && ! PYTHONPATH=$NCCL_SITE "$PY" -c "import horovod.torch as h, sys; sys.exit(0 if h.nccl_built() else 1)" 2>/dev/null; then
    say "building Horovod 0.28.1 (PyTorch, Gloo, CUDA, NCCL) into $NCCL_SITE"
    build_horovod "$NCCL_SITE" nccl "$(( ($(nproc) + 1) / 2 ))" & pids+=($!)
fi
built=0
for pid in ${pids[@]+"${pids[@]}"}; do wait "$pid" || built=1; done  # every build ends first
[ "$built" -eq 0 ] || { echo "a Horovod build failed (logs $OUT/horovod-build-*.log)" >&2; exit 1; }
[ ${#pids[@]} -gt 0 ] && say "Horovod built"
check_build() {  # $1 = site
    PYTHONPATH=$1:$ROOT "$PY" -c "import horovod.torch as hvd; print('horovod', hvd.__file__, 'gloo', hvd.gloo_built(), 'nccl', hvd.nccl_built(), 'cuda', hvd.cuda_built())" || return 1
    PYTHONPATH=$1:$ROOT "$PY" -m horovod.runner.launch --check-build
}
check_build "$SITE" | tee "$OUT/check-build-gloo.txt" || exit 1
"$PY" -c "import horovod.torch as hvd, sys; sys.exit(0 if hvd.cuda_built() else 1)" \
    || echo "note: this Horovod was built without CUDA; CUDA tensors go through host memory" >&2
if [ "$WANT_NCCL" = 1 ]; then
    check_build "$NCCL_SITE" | tee "$OUT/check-build-nccl.txt" || exit 1
else
    NCCL_SITE=$SITE
fi

STEPS=${GPU_CHECK_STEPS-tests bench}
[ -n "${GPU_CHECK_BUILD_ONLY:-}" ] && STEPS=""
[ "$STEPS" = all ] && STEPS="tests bench examples compare"
[ -z "$STEPS" ] && { say "built; no steps asked for"; exit 0; }
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
rc=0
fail() { [ "$rc" -eq 0 ] && rc=$1; }

if has tests; then
    say "CUDA tests"
    PYTHONPATH=$SITE:$ROOT "$PY" -m pytest -p no:cacheprovider -q -rs -k "cuda or gpu" \
        tests/test_torch_same_bits.py tests/test_torch_multiprocess.py tests/test_bench_kernels.py \
        tests/test_triton_kernels.py tests/test_ddp_hook.py tests/test_device_option.py \
        tests/test_torch_examples.py 2>&1 | tee "$OUT/pytest-cuda.log" | tail -15
    fail "${PIPESTATUS[0]}"
fi
if has bench; then
    for i in 1 2; do
        say "bench_kernels --framework torch --device cuda, run $i"
        "$PY" scripts/bench_kernels.py --framework torch --device cuda | tee "$OUT/bench-cuda-$i.txt"
        fail "${PIPESTATUS[0]}"
    done
fi
hvdrun() {  # $1 = site, $2 = np, then the command
    local site=$1 np=$2; shift 2
    PYTHONPATH=$site:$ROOT timeout -s INT 300 "$PY" -m horovod.runner.launch -np "$np" -H "localhost:$np" --gloo "$@"
}
if has examples; then
    SYN=(--device cuda --num-warmup-batches 2 --num-iters 3 --num-batches-per-iter 5)
    for spec in none topk:ratio=0.01 onebit; do
        say "synthetic benchmark on CUDA, $spec, np 1 (NCCL build where there is one)"
        hvdrun "$NCCL_SITE" 1 "$PY" torch_examples/synthetic_benchmark.py "${SYN[@]}" --compression "$spec" \
            2>&1 | tee "$OUT/example-synthetic-$spec-np1.log" | tail -3
        fail "${PIPESTATUS[0]}"
        say "synthetic benchmark on CUDA, $spec, np 2 sharing the GPU (Gloo build)"
        hvdrun "$SITE" 2 "$PY" torch_examples/synthetic_benchmark.py "${SYN[@]}" --compression "$spec" \
            2>&1 | tee "$OUT/example-synthetic-$spec-np2.log" | tail -3
        fail "${PIPESTATUS[0]}"
    done
    say "digits on CUDA, top-k 1%, np 1 (NCCL build where there is one)"
    hvdrun "$NCCL_SITE" 1 "$PY" torch_examples/train_digits.py --device cuda --compression topk:ratio=0.01 \
        --epochs 3 2>&1 | tee "$OUT/example-digits-np1.log" | tail -3
    fail "${PIPESTATUS[0]}"
fi
if has compare; then
    say "hvd-compress-compare --device cuda --np 1 2 (Gloo build)"
    PYTHONPATH=$SITE:$ROOT timeout -s INT 400 "$PY" -m hvd_compress.tools.compare --device cuda --np 1 2 \
        --bandwidth uncapped --compression none topk:ratio=0.01 onebit --out "$OUT/compare" 2>&1 | tee "$OUT/compare.log" | tail -25
    fail "${PIPESTATUS[0]}"
fi
say "done (exit status $rc)"
exit "$rc"
