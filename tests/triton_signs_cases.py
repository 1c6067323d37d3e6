"""The sign family's cases for tests/test_triton_kernels.py (its kernels:
hvd_compress/accel/triton_signs.py): Signum, 1-bit SGD as a whole and by columns,
threshold-v.  Kept here so that the shared test module stays within its size."""

from __future__ import annotations

import torch

#: Signum at the paper's momentum and at 0.5 without the vote (the momentum compared too);
#: 1-bit SGD with and without error feedback (by 30 columns on the 40 x 30 shape);
#: threshold-v with and without error feedback
SPECS = ["signum", "signum:momentum=0.5,vote=false", "onebit", "onebit:ef=false",
         "thresholdv:tau=0.01", "thresholdv:tau=0.02,ef=false"]
#: 1-bit SGD by columns on odd shapes: 13 columns (a tile of 16), 1,100 rows (three chunks of
#: rows a column block), 257 columns (three blocks of 128), a 3 x 5 x 7 kernel (35 columns)
COLUMN_CASES = [("onebit", (37, 13)), ("onebit", (1100, 13)), ("onebit:ef=false", (7, 257)),
                ("onebit", (3, 5, 7))]
KERNELS = {"signum_step", "keep_old", "column_sums", "onebit_codes", "onebit_decode", "threshold_count",
           "threshold_pick"}
#: each kernel with the argument types and constants its wrapper gives it (see COMPILED there)
COMPILED = [
    ("signum_step", {"beta": "fp32", "gamma": "fp32", "signs_ptr": "*u8", "bad_ptr": "*i32"},
     dict(BYTES=128, WIDE=False)),
    ("keep_old", {"bad_ptr": "*i32"}, dict(BLOCK=1024, WIDE=True)),
    ("column_sums", {"npos_ptr": "*i32", "total_ptr": "*fp64", "spos_ptr": "*fp64",
                     "bad_ptr": "*i32"}, dict(HAS_R=True, BLOCK_R=32, BLOCK_C=32, WIDE=False)),
    ("column_sums", {"npos_ptr": "*i32", "total_ptr": "*fp64", "spos_ptr": "*fp64",
                     "bad_ptr": "*i32"}, dict(HAS_R=False, BLOCK_R=1024, BLOCK_C=1, WIDE=True)),
    ("onebit_codes", {"signs_ptr": "*u8"}, dict(HAS_R=True, BYTES=128, WIDE=False)),
    ("onebit_decode", {"signs_ptr": "*u8"}, dict(BYTES=128, WIDE=True)),
    ("threshold_count", {"tau": "fp32", "counts_ptr": "*i32"}, dict(HAS_R=True, VALUES=1024)),
    ("threshold_pick", {"tau": "fp32", "starts_ptr": "*i32", "idx_ptr": "*i32"},
     dict(HAS_R=True, VALUES=1024)),
]
#: encoded and decoded with nothing read on the host (threshold-v reads its payload's size)
SYNC_FREE = ("signum", "onebit")


def objects() -> list:
    """What the sign family asks the encoder hook about: Signum's and 1-bit SGD's codecs, the
    threshold-v compressor."""
    from hvd_compress.core import build
    return [build("signum").codec, build("onebit").codec, build("thresholdv")]


def checks(counting, compare, backend) -> tuple[list[str], int]:
    """In the interpreter: the sign kernels' launches counted (``counting`` wraps a launch),
    then the column cases through ``compare`` (the test module's three-step comparison with
    the chain and numpy) on ``backend()``; the differences found and the cases run."""
    from hvd_compress.accel import triton_signs
    triton_signs._launch = counting(triton_signs._launch)
    bad = []
    for spec, shape in COLUMN_CASES:
        bad += compare(spec, shape, backend(), torch.from_numpy, True)
    return bad, len(COLUMN_CASES)
