"""DGC's momentum and masking kernels' cases for tests/test_triton_kernels.py (the kernels:
hvd_compress/accel/triton_dgc_momentum.py): more DGC specs for its three-step comparison,
a longer run through the warm-up's densities, and the masking pass alone on sent values
the chain's dense subtraction treats apart (-0.0, Inf, NaN).  Kept here so that the shared
test module stays within its size."""

from __future__ import annotations

import numpy as np
import torch

#: exact selection with Nesterov and clipping; a warm-up at density 1 (momentum alone, with
#: Nesterov: ``u + g`` sent) then sparse; a quantizer (``v`` keeps its error: the chain's
#: subtraction, the kernels' momentum); every tensor sent whole, with clipping
SPECS = ["dgc:ratio=0.001,nesterov=true,clip_norm=0.02,warmup_epochs=0",
         "dgc:ratio=0.05,warmup_coeff=1,warmup_epochs=1,steps_per_epoch=2,nesterov=true",
         "dgc:ratio=0.05,warmup_epochs=0,compress_1d=true+eightbit",
         "dgc:dense=true,nesterov=true,clip_norm=0.1"]
KERNELS = {"dgc_clip_sums", "dgc_momentum_step", "dgc_mask_sent", "dgc_keep_old", "dgc_count_passing",
           "dgc_candidate_keys"}
#: each kernel with the argument types and constants its wrapper gives it
COMPILED = [
    ("dgc_clip_sums", {"sums_ptr": "*fp64"}, dict(CHUNK=8192, BLOCK=1024)),
    ("dgc_momentum_step", {"m": "fp32", "bad_ptr": "*i32"},
     dict(CLIP=True, NESTEROV=True, ACCUMULATE=True, CHUNK=8192, BLOCK=1024)),
    ("dgc_momentum_step", {"m": "fp32", "bad_ptr": "*i32"},
     dict(CLIP=False, NESTEROV=False, ACCUMULATE=True, CHUNK=8192, BLOCK=1024)),
    ("dgc_momentum_step", {"m": "fp32", "bad_ptr": "*i32"},
     dict(CLIP=False, NESTEROV=True, ACCUMULATE=False, CHUNK=8192, BLOCK=1024)),
    ("dgc_mask_sent", {"idx_ptr": "*i64", "valid_ptr": "*u8"}, dict(MASK=True, BLOCK=1024)),
    ("dgc_keep_old", {"bad_ptr": "*i32"}, dict(HAS_V=True, BLOCK=1024)),
    ("dgc_count_passing", {"cnt_ptr": "*i32"}, dict(CHUNK=8192, BLOCK=1024)),
    ("dgc_candidate_keys", {"cnt_ptr": "*i32"}, dict(BLOCK=1024)),
]
#: encoded and decoded with nothing read on the host (the sync check's tensor is 1-d: sampled
#: with compress_1d, with Nesterov and clipping too; sent whole, as DGC sends vectors)
SYNC_FREE = ("dgc:ratio=0.01,warmup_epochs=0,compress_1d=true",
             "dgc:ratio=0.01,nesterov=true,clip_norm=0.1,warmup_epochs=0,compress_1d=true",
             "dgc:ratio=0.01,warmup_epochs=0")
#: the longer runs (2 shapes), the masking pass alone (3 lengths), the choice among the
#: passing magnitudes alone (2 lengths x 5 thresholds)
CASES = 2 + 3 + 2 * 5
LONG = "dgc:ratio=0.01,warmup_epochs=2,steps_per_epoch=2,compress_1d=true,nesterov=true"


def kernels():
    """The kernels' module (imports triton: only where it imports)."""
    from hvd_compress.accel import triton_dgc_momentum
    return triton_dgc_momentum


def objects() -> list:
    """What DGC's device step asks the encoder hook about: its marker."""
    from hvd_compress.core.dgc import MOMENTUM_PASSES
    return [MOMENTUM_PASSES]


def _same(a, b) -> bool:
    """The same bits (-0.0 is not +0.0), NaN equal to NaN."""
    a, b = (x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind != "f":
        return np.array_equal(a, b)
    bits = f"u{a.dtype.itemsize}"
    na, nb = np.isnan(a), np.isnan(b)
    return np.array_equal(na, nb) and np.array_equal(np.where(na, 0, a).view(bits),
                                                     np.where(nb, 0, b).view(bits))


def _long_run(shape, backend) -> list[str]:
    """Seven steps of :data:`LONG` -- densities 21.5%, 4.6%, then 1%, as the warm-up lowers
    them every two steps; NaN/Inf at step 3 -- through the kernels, the chain with them off
    and numpy: payload (finite steps), decode, ``u`` and ``v`` step by step."""
    import os

    from hvd_compress.core import NUMPY, build
    new, old, ref = build(LONG, backend), build(LONG, backend), build(LONG, NUMPY)
    rng, n, bad = np.random.default_rng(7), int(np.prod(shape)), []
    for step in range(7):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        if step == 3:
            x.reshape(-1)[[1, n - 1]] = [np.inf, np.nan]
        got = {}
        for comp, off in ((new, "1"), (old, "0"), (ref, None)):
            was = os.environ.get("HVD_COMPRESS_TRITON")
            os.environ["HVD_COMPRESS_TRITON"] = off or "1"
            try:
                enc = comp.encode(x if off is None else torch.from_numpy(x), "t")
                got[off] = (enc.payload, comp.aggregate([enc.payload], enc), comp.states["t"].u,
                            comp.states["t"].v)
            finally:
                os.environ.pop("HVD_COMPRESS_TRITON") if was is None else \
                    os.environ.__setitem__("HVD_COMPRESS_TRITON", was)
        for other in ("0", None):
            for what, a, b in zip(("payload", "decoded", "u", "v"), got["1"], got[other]):
                if what == "payload" and step == 3:
                    continue  # NaN payload floats may differ in NaN bits: compared decoded
                if not _same(a, b):
                    bad.append(f"{LONG} {shape} step {step}: {what} vs {other or 'numpy'}")
    return bad


def _masking_alone(tm) -> list[str]:
    """:func:`settle` on sent values of every kind (-0.0, Inf, NaN, unused slots at index 0
    with value 0) against the chain's dense scatter, subtraction and mask, after a finite
    step and after a non-finite one (the old state back)."""
    rng, bad = np.random.default_rng(8), []
    for n, k in ((1, 1), (50, 7), (3001, 1500)):  # 1,500 slots: two programs
        v = rng.standard_normal(n).astype(np.float32)
        v[rng.random(n) < 0.2] = -0.0
        v[: min(n, 3)] = [np.inf, np.nan, -0.0][: min(n, 3)]
        u = rng.standard_normal(n).astype(np.float32)
        idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        valid = rng.random(k) < 0.8
        safe = np.where(valid, idx, 0)
        sent = np.where(valid, v[safe], np.float32(0.0)).astype(np.float32)
        T = torch.from_numpy
        dense = torch.zeros(n).index_add_(0, T(safe), T(sent))
        hit = torch.zeros(n).index_add_(0, T(safe), T(valid.astype(np.float32))) > 0
        want_v, want_u = T(v) - dense, torch.where(hit, 0.0, T(u))
        for nonfinite in (0, 2):
            old_u, old_v = T(rng.standard_normal(n).astype(np.float32)), T(v * 2)
            got_u, got_v = tm.settle(T(u.copy()), T(v.copy()), old_u, old_v,
                                     torch.tensor([nonfinite], dtype=torch.int32),
                                     (T(safe), T(valid), T(sent)), True)
            wu, wv = (old_u, old_v) if nonfinite else (want_u, want_v)
            if not (_same(got_u, wu) and _same(got_v, wv)):
                bad.append(f"dgc masking alone n={n} k={k} bad={nonfinite}")
    return bad


def _choice_alone(tm, backend) -> list[str]:
    """The selection among the magnitudes that pass, one top-k over :func:`candidate_keys`,
    against the chain's ``cond`` of both branches and numpy's, with more than 1.3 k passing,
    between k and 1.3 k, fewer than k, none (a NaN threshold); magnitudes with ties, zeros
    and NaN (ranked first by the full top-k, never candidates)."""
    from hvd_compress.core import build
    from hvd_compress.core.sparsifiers import topk_indices
    B, bad = backend(), []
    dgc = build("dgc", B)
    rng = np.random.default_rng(9)
    for n, k in ((40, 10), (3001, 100)):
        mag = (np.round(rng.random(n) * n / 4) / 4).astype(np.float32)  # about 4 of each
        mag[[1, n // 2]] = np.nan
        cap = int(1.3 * k)
        order = np.sort(mag[np.isfinite(mag)])[::-1]
        for thr in (0.0, float(order[k - 1]), float(order[(k + cap) // 2]), float(order[k // 2]), np.nan):
            t, m = torch.tensor(thr, dtype=torch.float32), torch.from_numpy(mag)
            passed = m >= t
            cnt = torch.count_nonzero(passed)
            cand = B.compact(passed, cap)  # the chain's among_candidates and cond
            ok = cand < n
            cmag = torch.where(ok, m[torch.where(ok, cand, 0)], -1.0)
            chain = torch.where(cnt > cap, topk_indices(B, m, k), cand[topk_indices(B, cmag, k)])
            if int(cnt) > cap:  # the device's top-k ranks NaN first (numpy's core does not)
                first = np.where(np.isnan(mag), np.float32(np.inf), mag)
                want = np.sort(np.argsort(-first, kind="stable")[:k]).astype(np.int64)
            else:
                good = np.flatnonzero(mag >= np.float32(thr))
                best = np.sort(good[np.argsort(-mag[good], kind="stable")[:k]])
                want = np.concatenate([best, np.full(k - best.size, n)]).astype(np.int64)
            got = dgc._among_keyed(*tm.candidate_keys(m, t, cap), k, n)
            if not (_same(got, chain) and _same(got, want)):
                bad.append(f"dgc choice alone n={n} k={k} thr={thr} passing={int(cnt)}")
    return bad


def checks(counting, backend, bad=(), cases=0) -> tuple[list[str], int]:
    """In the interpreter: the kernels' launches counted (``counting`` wraps a launch), the
    longer runs on ``backend()`` and the masking pass alone; ``bad`` and ``cases`` (found
    before) with the differences and the cases added."""
    tm = kernels()
    tm.launch = counting(tm.launch)
    found = _long_run((40, 30), backend()) + _long_run((3001,), backend()) + _masking_alone(tm) \
        + _choice_alone(tm, backend)
    return list(bad) + found, cases + CASES
