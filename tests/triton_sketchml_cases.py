"""SketchML's Triton cases for tests/test_triton_kernels.py (run in its interpreter
subprocess, triton importable): the bucket sums alone against the chain's."""

from __future__ import annotations

import numpy as np
import torch

#: SketchML's bucket sums alone: 2 lengths x 2 tile sizes
CASES = 2 * 2


def sums_checks(B) -> tuple[list[str], int]:
    """SketchML's codes pass and fixed-order reduction alone, with the GPU's one-hot tiles
    of 32 values (47 programs, their partial rows reduced 8 at a time) and the
    interpreter's: values of magnitudes 1e-4 to 1e4, about 94 a bucket, so that float64 sums
    in another order than the chain's could round otherwise; the float32 sums, the counts,
    the codes and the means equal the chain's (``index_add_`` of float64 values); the
    differences and the cases."""
    from hvd_compress.accel import triton_sketchml as tk
    from hvd_compress.core.levels import SketchMLCodec
    rng, bad, cases = np.random.default_rng(4), [], 0
    for q, n in ((256, 1), (16, 1500)):
        codec = SketchMLCodec({"buckets": q, "sample": 400})
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 4, n)).astype(np.float32)
        v = torch.from_numpy(x)
        edges = codec.edges(B, v)
        code = B.bucketize(v, edges)
        sums = B.scatter_add(q, code, B.cast(v, "float64"), "float64")
        counts = B.scatter_add(q, code, torch.ones(n, dtype=torch.float64), "float64")
        for sub in (32, 1024):
            got = tk.bucket_sums(v, None, edges, q, sub=sub, rows_at_once=8)
            cases += 1
            if not (torch.equal(got[0], code.to(torch.uint8)) and torch.equal(got[2], counts)
                    and torch.equal(got[1].float(), sums.float())
                    and torch.equal(codec.means(B, got[1], got[2]), codec.means(B, sums, counts))):
                bad.append(f"sketchml bucket sums n={n} sub={sub}")
    return bad, cases
