# Source fixes applied to the Horovod 0.28.1 sdist before building it against
# today's PyTorch and TensorFlow.  Sourced by scripts/setup.sh; the sha256 of
# this file is part of the wheel-cache key, so editing a fix forces a rebuild.
#
# Each fix names the error it cures and fails loudly if the text it expects
# is not there (a different Horovod release needs its fixes reviewed).

_hvd_fix_replace() {  # file, old text, new text
    local file=$1 old=$2 new=$3
    if ! grep -qF -- "$old" "$file"; then
        echo "horovod_fixes: expected text not found in $file: $old" >&2
        return 1
    fi
    OLD=$old NEW=$new perl -0pi -e 's/\Q$ENV{OLD}\E/$ENV{NEW}/g' "$file"
}

apply_horovod_fixes() {  # $1 = extracted horovod-0.28.1 source tree
    local src=$1

    # Fix 1 -- C++17 for the whole build.
    # PyTorch >= 2.1 headers use std::optional & co, so with Horovod's C++14
    # the torch extension fails with
    #   error: 'optional' in namespace 'std' does not name a template type
    # and, once that compiles, linking fails on a Gloo symbol defined twice
    # (Gloo is already built as C++17).  Raise the standard at the top level...
    _hvd_fix_replace "$src/CMakeLists.txt" \
        'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    # ...and in the torch sub-project, which resets it to 14 for torch >= 1.5.
    _hvd_fix_replace "$src/horovod/torch/CMakeLists.txt" \
        'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'

    # Fix 2 -- leave out the optional XLA ops.
    # With TensorFlow >= 2.16 the TF extension fails with
    #   fatal error: highwayhash/arch_specific.h: No such file or directory
    # because the TF wheel no longer ships the highwayhash headers that
    # xla_mpi_ops.cc pulls in.  The XLA ops are only used with
    # HOROVOD_ENABLE_XLA_OPS=1; the ordinary TF ops live in mpi_ops.cc.
    _hvd_fix_replace "$src/horovod/tensorflow/CMakeLists.txt" \
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")' \
        '# xla_mpi_ops.cc left out by hvd-compress scripts/horovod_fixes.sh (needs highwayhash headers)'
}
