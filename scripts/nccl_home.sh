#!/usr/bin/env bash
# Sourced by scripts/setup.sh and scripts/gpu_check.sh: NCCL for Horovod's CUDA build.
#
# stage_nccl PYTHON FOLDER: prints the folder Horovod's CMake should take as NCCL (for
# HOROVOD_NCCL_HOME/INCLUDE/LIB): the caller's HOROVOD_NCCL_HOME when set, else FOLDER made
# from the `nvidia-nccl` wheel that CUDA PyTorch brings (its include/ and lib/libnccl.so.2;
# CMake's find_library wants lib/libnccl.so, which the wheel lacks). Fails (status 1,
# nothing printed) where there is neither.

stage_nccl() {
    local py=$1 folder=$2 wheel lib
    if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then echo "$HOROVOD_NCCL_HOME"; return 0; fi
    wheel=$("$py" - <<'PYEOF'
import glob, os, sys
try:
    import nvidia.nccl as m  # nvidia-nccl-cu*, a dependency of CUDA PyTorch wheels
except ImportError:
    sys.exit(1)
for d in m.__path__:
    if os.path.exists(os.path.join(d, "include", "nccl.h")) and glob.glob(os.path.join(d, "lib", "libnccl.so*")):
        print(d)
        sys.exit(0)
sys.exit(1)
PYEOF
) || return 1
    lib=$(ls "$wheel"/lib/libnccl.so* | head -1)
    mkdir -p "$folder/lib" || return 1
    ln -sfn "$wheel/include" "$folder/include" && ln -sf "$lib" "$folder/lib/libnccl.so" || return 1
    echo "$folder"
}
