#!/usr/bin/env bash
# hvd-compress set-up: everything a fresh Debian machine needs, in one command.
#
#   bash scripts/setup.sh
#
# 1. system packages (OpenMPI, compilers, cmake, iproute2) from Debian, as root
# 2. .venv with numpy, mpi4py, PyTorch and TensorFlow; Triton (the GPU kernels,
#    whose tests run it as an interpreter on the CPU) into .venv/triton-site, off
#    the venv's path: TensorFlow and Triton in one process abort (both bundle
#    LLVM), and PyTorch imports Triton wherever it is importable
# 3. Horovod 0.28.1 built from its PyPI sdist with PyTorch, TensorFlow, MPI
#    and Gloo, with the source fixes in scripts/horovod_fixes.sh; the built
#    wheel is cached under ~/.cache/hvd-compress/ keyed by versions and fixes
# 4. this package, editable, with its dev extras and the tests' oracles (torchft)
# 5. `horovodrun --check-build`, which must list PyTorch, TensorFlow, MPI, Gloo
#
# Idempotent: a second run with nothing changed reuses the venv and the cached
# wheel.  Stops at the first failure, naming the step and the log to read.
#
# Variables:
#   HVD_COMPRESS_TORCH=cpu|cuda   PyTorch build (default cpu).  `cuda` takes the
#                                 CUDA wheel from PyPI and builds Horovod with
#                                 NCCL (needs nvcc and NCCL on the machine).
#   HVD_COMPRESS_VENV=PATH        virtual environment (default <repo>/.venv)
#   HVD_COMPRESS_CACHE=PATH       wheel cache and logs (default ~/.cache/hvd-compress)
#   HVD_COMPRESS_REBUILD=1        ignore the cached Horovod wheel
#   PYTHON=python3.11             interpreter for the venv
set -euo pipefail

case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (it takes none; see --help)" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_COMPRESS_VENV:-$ROOT/.venv}
CACHE=${HVD_COMPRESS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-compress}
LOGDIR=$CACHE/logs
PYTHON=${PYTHON:-python3}
TORCH_FLAVOR=${HVD_COMPRESS_TORCH:-cpu}

HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
TRITON_VERSION=3.9.0  # cpu flavour; a CUDA torch brings the triton it was built with

STEP=""
T0=$(date +%s)
mkdir -p "$LOGDIR"

step() { STEP=$1; echo; echo "==> [$(($(date +%s) - T0))s] $1"; }
die() { echo "setup.sh: FAILED at step '$STEP': $*" >&2; exit 1; }
trap 'rc=$?; [ $rc -eq 0 ] || echo "setup.sh: FAILED at step \"$STEP\" (exit $rc); logs in $LOGDIR" >&2' EXIT

# ---------------------------------------------------------------------------
step "1/5 system packages (OpenMPI, compilers, cmake, iproute2)"
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
command -v cmake >/dev/null || need+=(cmake)
command -v ip >/dev/null || need+=(iproute2)
command -v tc >/dev/null || need+=(iproute2)
command -v perl >/dev/null || need+=(perl)
if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || die "need root to install: ${need[*]} (or install them yourself)"
    echo "installing: ${need[*]}"
    apt-get update -qq >"$LOGDIR/apt.log" 2>&1 || die "apt-get update failed, see $LOGDIR/apt.log"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" >>"$LOGDIR/apt.log" 2>&1 || die "apt-get install failed, see $LOGDIR/apt.log"
else
    echo "already present: mpirun $(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}'), $(cmake --version | head -1)"
fi

# ---------------------------------------------------------------------------
step "2/5 virtual environment $VENV with numpy, mpi4py, PyTorch $TORCH_VERSION ($TORCH_FLAVOR), TensorFlow $TF_VERSION, scikit-learn, matplotlib, numba, triton"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || die "could not create the venv with $PYTHON"
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip --disable-pip-version-check)
# Quick path: everything already at the wanted versions -> skip pip entirely.
have=$("$PY" - <<'PYEOF' 2>/dev/null || true
import importlib.metadata as m
out = []
for d in ("torch", "tensorflow", "numpy", "mpi4py", "scikit-learn", "matplotlib", "numba", "setuptools", "wheel"):
    try:
        out.append(f"{d}={m.version(d)}")
    except m.PackageNotFoundError:
        out.append(f"{d}=missing")
print(" ".join(out))
PYEOF
)
echo "installed: ${have:-nothing}"
if [[ "$have" != *"torch=$TORCH_VERSION"* || "$have" != *"tensorflow=$TF_VERSION"* || "$have" == *missing* ]]; then
    log=$LOGDIR/pip-frameworks.log
    echo "pip install (log: $log)"
    "${PIP[@]}" install "setuptools>=64,<81" wheel packaging >"$log" 2>&1 || die "pip failed, see $log"
    if [ "$TORCH_FLAVOR" = cuda ]; then
        # PyPI's default torch wheel for Linux is the CUDA build; ignore any
        # local CPU wheel that a find-links directory may offer.
        PIP_FIND_LINKS="" "${PIP[@]}" install "torch==$TORCH_VERSION" >>"$log" 2>&1 || die "pip failed, see $log"
    elif [ "$TORCH_FLAVOR" = cpu ]; then
        "${PIP[@]}" install "torch==$TORCH_VERSION" >>"$log" 2>&1 || die "pip failed, see $log"
    else
        die "HVD_COMPRESS_TORCH must be cpu or cuda, got '$TORCH_FLAVOR'"
    fi
    # scikit-learn ships the digits data the examples train on; matplotlib draws the plots;
    # numba compiles the fused CPU kernels (hvd_compress/kernels.py).
    "${PIP[@]}" install "torch==$TORCH_VERSION" "tensorflow==$TF_VERSION" numpy mpi4py scikit-learn matplotlib numba \
        >>"$log" 2>&1 || die "pip failed, see $log"
fi
# triton for the GPU kernels' tests (hvd_compress/accel/triton_*.py; about 1 GB), in a folder
# of its own: `import tensorflow` then `import triton` in one process aborts ("LLVM ERROR:
# inconsistency in registered CommandLine options"), and torch imports triton as soon as
# its compiler stack loads (an optimizer step is enough) wherever triton is importable.
# The tests put the folder on the path of the processes that need it (no TensorFlow there).
TRITON_SITE=$VENV/triton-site
if [ "$TORCH_FLAVOR" = cpu ] && [ ! -f "$TRITON_SITE/triton-$TRITON_VERSION.installed" ]; then
    log=$LOGDIR/pip-triton.log
    echo "triton $TRITON_VERSION into $TRITON_SITE (log: $log)"
    "${PIP[@]}" install --no-deps --target "$TRITON_SITE" --upgrade "triton==$TRITON_VERSION" >"$log" 2>&1 \
        || die "pip failed, see $log"
    touch "$TRITON_SITE/triton-$TRITON_VERSION.installed"
fi
if "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("triton") else 1)' \
        && "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("tensorflow") else 1)'; then
    echo "note: triton is importable in $VENV beside TensorFlow: a process that imports TensorFlow and then"
    echo "      triton (torch does, at its first compiled call) aborts; \`pip uninstall triton\` there"
    echo "      unless you need it (the tests use $TRITON_SITE)"
fi
TORCH_FULL=$("$PY" -c 'import torch; print(torch.__version__)') || die "torch does not import"
TF_FULL=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))') || die "tensorflow is not installed"
PYVER=$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
echo "torch $TORCH_FULL, tensorflow $TF_FULL, $PYVER"
if [ "$TORCH_FLAVOR" = cpu ] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
    echo "note: HVD_COMPRESS_TORCH=cpu but the installed torch is a CUDA build ($TORCH_FULL)"
fi

# ---------------------------------------------------------------------------
step "3/5 Horovod $HOROVOD_VERSION (PyTorch, TensorFlow, MPI, Gloo)"
FIXES_SHA=$(sha256sum "$ROOT/scripts/horovod_fixes.sh" | cut -c1-12)
MPI_VER=$(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}')
KEY="horovod-$HOROVOD_VERSION-torch-$TORCH_FULL-tf-$TF_FULL-$PYVER-ompi-$MPI_VER-$TORCH_FLAVOR-fixes-$FIXES_SHA"
WHEELDIR=$CACHE/wheels/$KEY
STAMP=$VENV/.hvd-compress-horovod-key
if [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] && "$PY" -c 'import horovod.torch, horovod.tensorflow' 2>/dev/null; then
    echo "installed Horovod matches $KEY"
else
    wheel=$(ls "$WHEELDIR"/horovod-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ] && [ "${HVD_COMPRESS_REBUILD:-0}" != 1 ]; then
        echo "using cached wheel $wheel"
    else
        log=$LOGDIR/horovod-build.log
        echo "building from source; full output in $log (about 8 minutes on 2 cores)"
        work=$(mktemp -d "${TMPDIR:-/tmp}/hvd-build.XXXXXX")
        # A source tree where a build failed can give an install without
        # Horovod's Python files: always build from a freshly extracted tree.
        "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" \
            >"$log" 2>&1 || die "could not download the horovod sdist, see $log"
        tar xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
        src=$work/horovod-$HOROVOD_VERSION
        # shellcheck source=scripts/horovod_fixes.sh
        source "$ROOT/scripts/horovod_fixes.sh"
        apply_horovod_fixes "$src" || die "a source fix did not apply"
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 \
            HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
        export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
        if [ "$TORCH_FLAVOR" = cuda ]; then
            export HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL}
            # NCCL: the caller's HOROVOD_NCCL_*, else the nvidia-nccl wheel CUDA torch brought
            # shellcheck source=scripts/nccl_home.sh
            source "$ROOT/scripts/nccl_home.sh"
            if [ -z "${HOROVOD_NCCL_INCLUDE:-}" ] && nccl=$(stage_nccl "$PY" "$work/nccl"); then
                export HOROVOD_NCCL_HOME=$nccl HOROVOD_NCCL_INCLUDE=$nccl/include \
                       HOROVOD_NCCL_LIB=$nccl/lib HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-SHARED}
                echo "NCCL from $nccl"
            fi
        fi
        rm -rf "$WHEELDIR.tmp" && mkdir -p "$WHEELDIR.tmp"
        (cd "$src" && "${PIP[@]}" wheel --no-deps --no-build-isolation -v -w "$WHEELDIR.tmp" .) \
            >>"$log" 2>&1 &
        bpid=$!
        while kill -0 $bpid 2>/dev/null; do
            sleep 30
            last=$(grep -aE '^ *\[ *[0-9]+%\]' "$log" | tail -1 | sed "s/^ *//" | cut -c1-100 || true)
            echo "  [$(($(date +%s) - T0))s] ${last:-configuring...}"
        done
        wait $bpid || die "horovod build failed; last lines of $log:
$(tail -30 "$log")"
        rm -rf "$WHEELDIR" && mv "$WHEELDIR.tmp" "$WHEELDIR" && rm -rf "$work"
        wheel=$(ls "$WHEELDIR"/horovod-*.whl | head -1)
        echo "built $wheel"
    fi
    "${PIP[@]}" install --force-reinstall --no-deps "$wheel" >"$LOGDIR/pip-horovod.log" 2>&1 \
        || die "could not install $wheel, see $LOGDIR/pip-horovod.log"
    # Horovod's own runtime requirements, without touching the frameworks.
    "${PIP[@]}" install cloudpickle psutil pyyaml packaging >>"$LOGDIR/pip-horovod.log" 2>&1 \
        || die "pip failed, see $LOGDIR/pip-horovod.log"
    echo "$KEY" >"$STAMP"
fi

# ---------------------------------------------------------------------------
step "4/5 hvd-compress (editable, with dev and oracles extras; its fused TensorFlow ops)"
"${PIP[@]}" install --no-build-isolation -e "$ROOT[dev,oracles]" >"$LOGDIR/pip-package.log" 2>&1 \
    || die "pip install -e failed, see $LOGDIR/pip-package.log"
"$PY" -c "import horovod.torch, horovod.tensorflow, mpi4py, hvd_compress; print('hvd_compress', hvd_compress.__version__)" \
    2>"$LOGDIR/import.log" || die "imports failed, see $LOGDIR/import.log"
# The quantizers' and sparsifiers' fused TensorFlow CPU ops (hvd_compress/tensorflow/fused), compiled
# once into ~/.cache/hvd-compress/tfops, keyed by source, TensorFlow, flags, compiler.
TF_CPP_MIN_LOG_LEVEL=2 "$PY" -m hvd_compress.tensorflow.fused_ops >"$LOGDIR/fused-ops.log" 2>&1 \
    || die "building the fused TensorFlow ops failed; last lines of $LOGDIR/fused-ops.log:
$(tail -20 "$LOGDIR/fused-ops.log")"
tail -1 "$LOGDIR/fused-ops.log"

# ---------------------------------------------------------------------------
step "5/5 horovodrun --check-build"
check=$(TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $check"
echo "$check"
for want in PyTorch TensorFlow MPI Gloo; do
    grep -q "\[X\] $want" <<<"$check" || die "horovodrun --check-build does not show [X] $want"
done
echo
echo "set-up done in $(($(date +%s) - T0))s; activate with: source $VENV/bin/activate"
