"""The Triton kernels of the device path (hvd_compress/accel/triton_*.py): the same bits as the torch chain
on the device and as the numpy reference.

Without a GPU they run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` must be set before
triton is imported, so those checks run in one subprocess: this module run as a script), through the
torch backend's hooks on a backend that treats CPU tensors as device memory; the CUDA variants run where
a GPU is. Where triton is missing or turned off, the hooks answer None and today's chain runs.

triton is not importable in the test process here: scripts/setup.sh installs it in
``.venv/triton-site``, off the venv's path, because ``import tensorflow`` then ``import triton`` in one
process aborts (both bundle LLVM) and torch imports triton wherever it can. Every check that imports
triton runs in a subprocess with that folder on its path (and no TensorFlow); on a GPU machine whose
torch brought triton, the CUDA variants run in process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_compress.accel import device
from hvd_compress.core import NUMPY, build
from hvd_compress.core.bitpack import unpack_values
from hvd_compress.core.dgc import ADAPT_ROUNDS, LOWER, LOWERING
from hvd_compress.core.levels import SketchMLCodec
from hvd_compress.core.qsgd import QSGDCodec
from hvd_compress.core.sparsifiers import topk_indices
from hvd_compress.core.variable import SIGN_COUNTS
from hvd_compress.torch import TorchBackend
from tests import test_triton_powersgd as psgd
from tests import triton_dgc_cases as DGCM
from tests import triton_signs_cases as SIGNS
from tests import triton_sketchml_cases as SKETCH
from tests import triton_sync_cases as SYNC

ROOT = Path(__file__).resolve().parent.parent
#: triton importable in this process (a GPU machine's torch brings it)
TRITON_HERE = importlib.util.find_spec("triton") is not None
#: where scripts/setup.sh puts the tests' triton (off the venv's path: the module's doc)
TRITON_SITE = Path(sys.prefix) / "triton-site"
HAVE_TRITON = TRITON_HERE or (TRITON_SITE / "triton" / "__init__.py").exists()
CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_HERE),
                          reason="no CUDA device (or no triton) on this machine")

#: the kernels' codecs at several widths, buckets (not a multiple of the block) and with
#: error feedback; a width the kernels decline (5 bits: codes across bytes), whose chain
#: must still run; INCEPTIONN with all four widths; the selections (top-k, DGC, adaq)
#: through the radix select
SPECS = ["qsgd", "qsgd:levels=1,bucket=100", "qsgd:levels=127,bucket=1000,seed=3",
         "qsgd:levels=16,bucket=64", "qsgd:ef=true,seed=5", "terngrad", "terngrad:clip=0,seed=2",
         "terngrad:ef=true", "uniform:bits=2,bucket=100,seed=9", "uniform:bits=8,ef=true",
         "uniform:stochastic=false,ef=true", "threshold:tau=0.001", "threshold:tau=0.01,ef=false",
         "signsgd", "efsignsgd", "eightbit", "eightbit:ef=true", "natural:ef=true,seed=4",
         "inceptionn", "inceptionn:bound=1e-7", "randomk:ratio=0.1",
         "inceptionn:bound=1e-5,ef=true", "topk:ratio=0.1", "topk:ratio=0.5", "dgc:ratio=0.05",
         "adaq:ratio=0.3", "adaq:ratio=0.01,ef=false",
         # DGC sampled (compress_1d: the 1-d shape too) through the correction loop's kernels
         "dgc:ratio=0.01,warmup_epochs=0,compress_1d=true,seed=2",
         "dgc:ratio=0.02,warmup_epochs=0,nesterov=true,masking=false,sample_ratio=0.05,compress_1d=true",
         "dgc:ratio=0.05,momentum=0.5,clip_norm=0.05,warmup_epochs=1,steps_per_epoch=2,compress_1d=true"]
#: SketchML: 256 buckets (every value sampled), 16 of a strided sample with error feedback,
#: 100 (not a power of 2), and 300 (16-bit codes, which the kernels decline: the chain)
SPECS += ["sketchml", "sketchml:buckets=16,sample=500,ef=true", "sketchml:buckets=100,ef=true",
          "sketchml:buckets=300,sample=700"]
SHAPES = [(40, 30), (3001,)]  # 1200 and 3001: not a multiple of a block or bucket
CUDA_SHAPES = [(1,), (40, 30), (3001,), (257, 1031)]
WIDE_SPECS = ["qsgd:ef=true", "terngrad:ef=true", "uniform:bits=2",  # also with int64 indices
              "sketchml:ef=true"]
KERNELS = {"bucket_stats", "qsgd_codes", "terngrad_codes", "uniform_codes", "unpack_values",
           "count_widths", "pack", "count_codes", "unpack", "radix_count", "radix_step",
           "count_chosen", "write_chosen", "natural_codes", "natural_decode", "sign_codes",
           "threshold_codes", "eightbit_codes", "eightbit_decode", "stratified",
           "count_reaching", "pick_lowered", "count_signs"}
KERNELS |= {"sketch_sample", "sketch_codes", "sketch_reduce", "sketch_residual", "sketch_decode"}
SPECS, KERNELS = SPECS + SIGNS.SPECS + DGCM.SPECS, KERNELS | SIGNS.KERNELS | DGCM.KERNELS  # signs, DGC


class DevicePath(TorchBackend):
    """CPU tensors treated as device memory: the torch backend's device hooks run."""

    def is_host(self, x):
        return False


@contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def _same(a, b) -> bool:
    """Equal arrays, NaN equal to NaN (a non-finite step's payload floats)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def _received(comp, enc):
    """One rank's payload as its aggregate takes it (summed payloads: the sum itself)."""
    return enc.payload if comp.summable else [enc.payload]


def _compare(spec, shape, B, to_tensor, explicit_noise: bool) -> list[str]:
    """Three steps of ``spec`` through the kernels (``B``), the chain with them off, and the
    numpy reference; the differences found (none expected)."""
    ref, new, old = build(spec, NUMPY), build(spec, B), build(spec, B)
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape, explicit_noise)).encode()))
    n = int(np.prod(shape))
    bad = []
    for step in range(3):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        if step == 1 and n > 8:  # a non-finite step: NaN payload floats, the state kept
            x.reshape(-1)[[3, n - 2]] = [np.nan, np.inf]
        noise = rng.random(n, dtype=np.float32) if explicit_noise and ref.draws_noise else None
        tn = None if noise is None else to_tensor(noise)
        e_ref = ref.encode(x, "t", noise=noise)
        e_new = new.encode(to_tensor(x), "t", noise=tn)
        with _env("HVD_COMPRESS_TRITON", "0"):
            e_old = old.encode(to_tensor(x), "t", noise=tn)
            d_old = old.aggregate(_received(old, e_old), e_old)
        d_new = new.aggregate(_received(new, e_new), e_new)
        d_ref = ref.aggregate(_received(ref, e_ref), e_ref)
        checks = {"payload vs chain": (e_new.payload, e_old.payload),
                  "payload vs numpy": (e_new.payload, e_ref.payload),
                  "decoded vs chain": (d_new, d_old), "decoded vs numpy": (d_new, d_ref)}
        for state in ("residual", "momentum", "u", "v"):  # error feedback's, Signum's, DGC's
            if getattr(ref.states["t"], state, None) is not None:
                checks[f"{state} vs numpy"] = (getattr(new.states["t"], state),
                                               getattr(ref.states["t"], state))
        for what, (a, b) in checks.items():
            if "numpy" in what and noise is None and ref.draws_noise:
                continue  # numpy's host path hashes its noise: the chains' draws differ
            a, b = (B.to_numpy(v) if isinstance(v, torch.Tensor) else v for v in (a, b))
            if what.startswith("payload") and not np.isfinite(x).all():
                continue  # NaN payload floats may differ in NaN bits: compared decoded
            if not _same(a, b):
                bad.append(f"{spec} {shape} step {step} noise={explicit_noise}: {what}")
    return bad


def _interpreter_checks(half: int) -> dict:
    """Half ``half`` (0 or 1: the test runs both at once) of the specs and shapes through
    the kernels in the interpreter (``TRITON_INTERPRET=1`` here); which ran, what differed."""
    from hvd_compress.accel import triton_dgc as td
    from hvd_compress.accel import triton_inceptionn as ti
    from hvd_compress.accel import triton_quantizers as tq
    from hvd_compress.accel import triton_select as ts
    from hvd_compress.accel import triton_sketchml as tk
    ran: dict = {}

    def counting(launch):
        def counted(kernel, *args, **meta):
            ran[kernel.fn.__name__] = ran.get(kernel.fn.__name__, 0) + 1
            return launch(kernel, *args, **meta)
        return counted

    tq._launch, ti._launch, ts.launch, td.launch = (
        counting(f) for f in (tq._launch, ti._launch, ts.launch, td.launch))
    tk._launch = counting(tk._launch)
    bad, cases = DGCM.checks(counting, DevicePath, *SIGNS.checks(counting, _compare, DevicePath)) \
        if half else ([], 0)
    for spec in SPECS[half::2]:
        for shape in SHAPES:
            bad += _compare(spec, shape, DevicePath(), torch.from_numpy, True)
            cases += 1
        if build(spec, NUMPY).draws_noise:  # drawn as the chain draws: the same values
            bad += _compare(spec, SHAPES[-1], DevicePath(), torch.from_numpy, False)
            cases += 1
    B, rng_sel = DevicePath(), np.random.default_rng(2)
    wide, tq._wide = tq._wide, (lambda n, d=1: True)  # int64 indices (tensors past 2**31)
    wide_sketch, tk._wide = tk._wide, (lambda n: True)
    try:
        for spec in WIDE_SPECS if half else ():
            bad += _compare(spec, SHAPES[-1], DevicePath(), torch.from_numpy, True)
            cases += 1
    finally:
        tq._wide, tk._wide = wide, wide_sketch
    if half:
        bad += psgd.interpreter_checks(DevicePath())  # PowerSGD: its own steps and launches
        return {"cases": cases, "bad": bad + [f"fell back: {e!r}" for e in ts._BROKEN], "ran": ran}
    # the selection alone, with ties and zeros of both signs: the core's canonical choice
    for n in (1, 1000, 3001):
        x = np.round(rng_sel.standard_normal(n) * 3).astype(np.float32) / np.float32(3)
        mag = np.where(rng_sel.random(n) < 0.3, np.float32(-0.0), np.abs(x)).astype(np.float32)
        for k in sorted({1, max(1, n // 10), n}):
            got = device.device_top_indices(B, torch.from_numpy(mag), k)
            cases += 1
            if got is None or not _same(got.numpy(), topk_indices(NUMPY, mag, k)):
                bad.append(f"top_indices n={n} k={k}")
    # the unpack kernel alone: every width, with and without bucket factors
    rng = np.random.default_rng(1)
    for bits in (1, 2, 4, 8):
        for n, d in ((1, 1), (13, 5), (2053, 100)):
            data = torch.from_numpy(rng.integers(0, 256, -(-n * bits // 8), dtype=np.uint8))
            values = rng.standard_normal(1 << bits).astype(np.float32)
            f = torch.from_numpy(rng.standard_normal(-(-n // d)).astype(np.float32))
            for factors in (None, f):
                got = device.device_unpack(B, data, bits, n, values.tolist(), factors, d)
                want = unpack_values(NUMPY, data.numpy(), bits, n, values.tolist(),
                                     None if factors is None else factors.numpy(), d)
                cases += 1
                if got is None or not _same(got.numpy(), want):
                    bad.append(f"unpack bits={bits} n={n} d={d} factors={factors is not None}")
    bad_dgc, dgc_cases = _dgc_and_adaq_checks(B)
    bad, cases = bad + bad_dgc, cases + dgc_cases
    bad_sketch, sketch_cases = SKETCH.sums_checks(DevicePath())
    bad_sync, sync_cases = SYNC.checks(DevicePath())  # nothing copied or read in a step
    bad, cases = bad + bad_sketch + bad_sync, cases + sketch_cases + sync_cases
    if ts._BROKEN:  # the selection declines on an error (the chain): none may have happened
        bad.append(f"the selection fell back: {ts._BROKEN[0]!r}")
    return {"cases": cases, "bad": bad, "ran": ran}


DGC_CASES = 3 * 3 * 6 + 3  #: the correction loop's own checks (lengths x k x thresholds), sign counts


def _dgc_and_adaq_checks(B) -> tuple[list[str], int]:
    """DGC's correction loop through its hook (thresholds on magnitudes, so that values tie
    with them; NaN and Inf among the magnitudes and as the threshold; lengths over a
    program's stretch) against the chain's fixed rounds and numpy's loop, and adaq's sign
    counts (zeros of both signs, NaN, Inf) against numpy's; the differences and the cases."""
    from hvd_compress.core.dgc import DGC
    rng, bad, cases = np.random.default_rng(3), [], 0
    lower, signs = B.fused_encoder(LOWERING, 1, like=torch.zeros(1)), \
        B.fused_encoder(SIGN_COUNTS, 1, like=torch.zeros(1))
    for n in (5, 3001, 8200):  # 8200: two programs
        mag = np.abs(np.round(rng.standard_normal(n) * 4) / np.float32(4)).astype(np.float32)
        mag[n // 2] = np.inf
        mag[n // 3] = np.nan
        fin = np.sort(mag[np.isfinite(mag)])
        for k in (1, max(1, n // 20), n):  # thresholds: a tie with the k-th largest finite, ...
            for t0 in (float(fin[-min(k, fin.size)]), float(mag[0]), 0.0, 1e3, np.inf, np.nan):
                thr = torch.tensor(t0, dtype=torch.float32)
                got = lower(torch.from_numpy(mag), thr, math.ceil(LOWER * k), ADAPT_ROUNDS, LOWER)
                chain = thr
                for _ in range(ADAPT_ROUNDS):  # DGC.threshold's device rounds
                    cnt = torch.count_nonzero(torch.from_numpy(mag) >= chain)
                    chain = torch.where(cnt.to(torch.float64) < LOWER * k, chain * LOWER, chain)
                ref = DGC.lowered(np.float32(t0), k, lambda t: np.count_nonzero(mag >= t))
                cases += 1
                if got is None or not (_same(got.numpy(), chain.numpy())
                                       and _same(got.numpy(), np.asarray(ref, np.float32))):
                    bad.append(f"dgc lowering n={n} k={k} t={t0}: {got} {chain} {ref}")
        v = np.where(rng.random(n) < 0.2, np.float32(0.0), rng.standard_normal(n)).astype(np.float32)
        v[:4] = [-0.0, np.nan, np.inf, -np.inf]
        cases += 1
        if signs(torch.from_numpy(v)) != (int((v > 0).sum()), int((v < 0).sum())):
            bad.append(f"adaq sign counts n={n}")
    return bad, cases


def _in_subprocess(*whats: str, **env):
    """This module run as a script (``what``: the checks to run) with triton importable
    and ``env``, one process each, all at once; the JSON document each prints last."""
    if not HAVE_TRITON:
        pytest.fail(f"triton is not installed (scripts/setup.sh puts it in {TRITON_SITE})")
    path = [str(ROOT)] + ([] if TRITON_HERE else [str(TRITON_SITE)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
           **env}
    procs, docs = [subprocess.Popen([sys.executable, "-m", "tests.test_triton_kernels", what],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for what in whats], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-3000:] + err[-3000:]
            docs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return docs[0] if len(docs) == 1 else docs


def test_interpreter_same_bits_as_the_chain_and_numpy():
    """In Triton's interpreter (one subprocess): every kernel ran, and every payload,
    decode and residual equals today's device chain's and the numpy reference's."""
    halves = [_in_subprocess(f"interpret{h}", TRITON_INTERPRET="1", HVD_COMPRESS_TRITON="1")
              for h in (0, 1)]  # one after the other: one interpreter process can take ~12 GB
    doc = {"bad": halves[0]["bad"] + halves[1]["bad"], "ran": {**halves[0]["ran"], **halves[1]["ran"]},
           "cases": halves[0]["cases"] + halves[1]["cases"]}
    assert doc["bad"] == []
    noisy = sum(build(spec, NUMPY).draws_noise for spec in SPECS)
    assert doc["cases"] == len(SPECS) * len(SHAPES) + noisy + len(WIDE_SPECS) + 7 + 24 + DGC_CASES \
        + SKETCH.CASES + len(SIGNS.COLUMN_CASES) + DGCM.CASES + len(SYNC.SPECS)
    assert set(doc["ran"]) == KERNELS, doc["ran"]


#: every kernel once, with the argument types and constants the wrappers give it (an
#: argument ``_ptr`` is a float32 pointer and any other an int32 unless named here)
COMPILED = [
    ("bucket_stats", {"sum_ptr": "*fp64", "sumsq_ptr": "*fp64", "bad_ptr": "*i32"},
     dict(HAS_R=True, SUMS=True, MINMAX=True, TOP=True, ABS=True, ROWS=8, BLOCK=512, WIDE=True)),
    ("sign_codes", {"signs_ptr": "*u8"}, dict(HAS_R=True, BYTES=128, WIDE=False)),
    ("threshold_codes", {"tau": "fp32", "codes_ptr": "*u8"}, dict(HAS_R=True, BYTES=256, WIDE=False)),
    ("eightbit_codes", {"codes_ptr": "*u8"}, dict(HAS_R=True, BLOCK=1024, WIDE=False)),
    ("eightbit_decode", {"codes_ptr": "*u8"}, dict(BLOCK=1024, WIDE=True)),
    ("stratified", {"key0_ptr": "*i64", "key1_ptr": "*i64", "indices_ptr": "*i64",
                    "sizes_ptr": "*i64"}, dict(BLOCK=1024)),
    ("qsgd_codes", {"sf": "fp32", "codes_ptr": "*u8"},
     dict(HAS_R=True, BITS=4, PER=2, BYTES=512, WIDE=False)),
    ("qsgd_codes", {"sf": "fp32", "codes_ptr": "*u8"},  # s = d = 1: Triton makes them constants
     dict(s=1, d=1, HAS_R=False, BITS=2, PER=4, BYTES=256, WIDE=False)),
    ("terngrad_codes", {"codes_ptr": "*u8"}, dict(HAS_R=True, CLIP=True, BYTES=256, WIDE=False)),
    ("uniform_codes", {"levels": "fp32", "codes_ptr": "*u8"},
     dict(HAS_R=True, STOCHASTIC=True, BITS=8, PER=1, BYTES=1024, WIDE=False)),
    ("unpack_values", {"data_ptr": "*u8"},
     dict(HAS_F=True, HAS_LO=True, BITS=1, PER=8, BYTES=128, WIDE=False)),
    ("count_widths", {"inv_ptr": "*fp64", "counts_ptr": "*i32"}, dict(VALUES=1024)),
    ("pack", {"inv_ptr": "*fp64", "starts_ptr": "*i32", "mid_ptr": "*i16", "low_ptr": "*u8",
              "codes_ptr": "*u8"}, dict(VALUES=1024)),
    ("count_codes", {"codes_ptr": "*u8", "counts_ptr": "*i32"}, dict(VALUES=1024)),
    ("unpack", {"codes_ptr": "*u8", "step_ptr": "*fp64", "starts_ptr": "*i32", "mid_ptr": "*i16",
                "low_ptr": "*u8"}, dict(VALUES=1024)),
    ("natural_codes", {"bad_ptr": "*i64", "exps_ptr": "*u8", "signs_ptr": "*u8"},
     dict(HAS_R=True, BYTES=128, WIDE=False)),
    ("natural_decode", {"exps_ptr": "*u8", "signs_ptr": "*u8"}, dict(BYTES=128, WIDE=False)),
    ("radix_count", {"state_ptr": "*i64", "high": "i64", "hist_ptr": "*i32"},
     dict(CHUNK=8192, BLOCK=1024)),
    ("radix_step", {"hist_ptr": "*i32", "state_ptr": "*i64"}, dict(FIRST=True)),
    ("radix_step", {"hist_ptr": "*i32", "state_ptr": "*i64"}, dict(k=1, FIRST=True)),
    ("radix_step", {"hist_ptr": "*i32", "state_ptr": "*i64"}, dict(FIRST=False)),
    ("count_chosen", {"state_ptr": "*i64", "counts_ptr": "*i64"}, dict(BLOCK=1024)),
    ("write_chosen", {"state_ptr": "*i64", "before_ptr": "*i64", "out_ptr": "*i64"},
     dict(BLOCK=1024)),
    ("count_reaching", {"factor": "fp32", "counts_ptr": "*i32"},
     dict(ROUNDS=10, ROWS=16, CHUNK=8192, BLOCK=256)),
    ("pick_lowered", {"counts_ptr": "*i32", "factor": "fp32"}, dict(ROUNDS=10, ROWS=16, BLOCK=256)),
    ("count_signs", {"counts_ptr": "*i64"}, dict(CHUNK=8192, BLOCK=256)),
]


COMPILED += [  # SketchML's (triton_sketchml)
    ("sketch_sample", {"m": "i32"}, dict(HAS_R=True, BLOCK=1024)),
    ("sketch_codes", {"codes_ptr": "*u8", "sums_ptr": "*fp64", "counts_ptr": "*i32",
                      "bad_ptr": "*i32"},
     dict(HAS_R=True, Q=256, STEPS=8, CHUNK=16384, SUB=32, WIDE=False)),
    ("sketch_reduce", {"sums_ptr": "*fp64", "counts_ptr": "*i32", "out_sums_ptr": "*fp64",
                       "out_counts_ptr": "*fp64"}, dict(Q=256, COLS=32, ROWS=64)),
    ("sketch_residual", {"codes_ptr": "*u8"}, dict(HAS_R=True, BLOCK=1024, WIDE=False)),
    ("sketch_decode", {"codes_ptr": "*u8"}, dict(BLOCK=1024, WIDE=True)),
]
COMPILED += SIGNS.COMPILED + psgd.COMPILED + DGCM.COMPILED  # triton_signs', PowerSGD's, DGC's


def test_kernels_compile_for_a_gpu_without_one_and_a_failing_selection_falls_back():
    """Every kernel compiles for an H100 (sm_90, PTX and ptxas: no GPU needed), which the
    interpreter does not check (it ran kernels that read a global float, and a helper
    returning int32 or int64); no fused multiply-add, divisions correctly rounded.  And the
    top-k hook may decline: a selection kernel that fails (a triton without an API it uses)
    gives one warning, then None (the core's selection) from then on.  (One subprocess:
    both import triton.)"""
    doc = _in_subprocess("compile")
    assert doc["compiled"] == len(COMPILED) and doc["bad"] == [], doc
    assert doc["selection"] == {"first": [None, ["unexpected keyword"]], "then": [None, []]}, doc


def _compile_checks() -> dict:
    """The checks of the test above, in a process where triton imports."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from hvd_compress.accel import triton_dgc, triton_inceptionn, triton_kernels, triton_select, triton_signs
    from hvd_compress.accel import triton_sketchml as tk
    compiled, bad = 0, []
    for name, given, consts in COMPILED:
        fn = next(getattr(m, name) for m in (
            psgd.kernels(), DGCM.kernels(), triton_kernels, triton_inceptionn, triton_select, triton_dgc, tk,
            triton_signs) if hasattr(m, name))
        signature = {a: "constexpr" if a in consts else given.get(a, "*fp32" if a.endswith("_ptr")
                                                                  else "i32")
                     for a in fn.arg_names}
        kernel = compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32),
                         options={"enable_fp_fusion": False})
        ptx = kernel.asm["ptx"]
        compiled += 1
        if "fma.rn.f32" in ptx or "div.full" in ptx or "div.approx" in ptx:
            bad.append(f"{name}: a fused multiply-add or an approximate division")
        if name == "terngrad_codes" and "div.rn.f32" not in ptx:
            bad.append(f"{name}: no correctly rounded division")

    from hvd_compress.accel import triton_select

    def fails(mag, k):
        raise RuntimeError("histogram() got an unexpected keyword argument 'mask'")

    triton_select._BROKEN.clear()
    triton_select._select = fails
    selection = {}
    for when in ("first", "then"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = triton_select.top_indices(None, torch.ones(10), 3)
        selection[when] = [got, ["unexpected keyword" for w in seen
                                 if issubclass(w.category, RuntimeWarning)
                                 and "unexpected keyword" in str(w.message)]]
    return {"compiled": compiled, "bad": bad, "selection": selection}


def _cuda_like():
    """Something on a CUDA device as the hooks see it (no GPU needed to ask)."""
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def test_without_triton_todays_path_runs_quietly(monkeypatch):
    """triton not importable: every hook answers None (the chain), with no warning."""
    monkeypatch.setattr(device, "_KERNELS", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    codec = QSGDCodec({"levels": 7, "bucket": 512})
    B = TorchBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.available() is False
        assert all(B.fused_encoder(o, 1, like=_cuda_like()) is None for o in (codec, *SIGNS.objects()))
        assert B.fused_decoder(codec, 1, like=_cuda_like()) is None
        sketch = SketchMLCodec({"buckets": 256, "sample": 100})
        assert B.fused_encoder(sketch, 1, like=_cuda_like()) is None
        assert B.fused_decoder(sketch, 1, like=_cuda_like()) is None
        assert device.device_unpack(B, _cuda_like(), 2, 10, [0.0] * 4) is None
        for marker in (LOWERING, SIGN_COUNTS, *DGCM.objects()):  # DGC's loop and passes, adaq's: the chain
            assert B.fused_encoder(marker, 1, like=_cuda_like()) is None


def test_switches_turn_the_kernels_off(monkeypatch):
    """``HVD_COMPRESS_TRITON=0`` or ``HVD_COMPRESS_FUSED=0``: nothing is loaded or asked;
    CPU tensors without the interpreter never take the kernels."""
    sentinel = types.SimpleNamespace(ENCODERS={}, DECODERS={}, probe=lambda d: True)
    monkeypatch.setattr(device, "_KERNELS", sentinel)
    monkeypatch.setattr(device, "_WORKS", {})
    codec = QSGDCodec({"levels": 7, "bucket": 512})
    for name in ("HVD_COMPRESS_TRITON", "HVD_COMPRESS_FUSED"):
        with _env(name, "0"):
            assert device._kernels(_cuda_like()) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert device._kernels(torch.zeros(3)) is None
    assert device._kernels(_cuda_like()) is sentinel
    assert device.device_encoder(TorchBackend(), codec, 1, torch.zeros(3)) is None


def test_kernels_that_fail_on_a_device_warn_once_and_leave_the_chain(monkeypatch):
    """triton imports but its kernels fail on a device (an old GPU, a broken toolchain):
    one warning, then None (the chain) for every tensor there."""
    def probe(d):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(device, "_KERNELS", types.SimpleNamespace(ENCODERS={}, probe=probe))
    monkeypatch.setattr(device, "_WORKS", {})
    codec = QSGDCodec({"levels": 7, "bucket": 512})
    with pytest.warns(RuntimeWarning, match="no compiler for this GPU"):
        assert device.device_encoder(TorchBackend(), codec, 1, _cuda_like()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.device_encoder(TorchBackend(), codec, 1, _cuda_like()) is None


def test_device_scalars_are_the_numbers_torch_tensor_gives():
    """The backend fills device scalars with ``torch.full`` (no wait for the GPU): the same
    values as ``torch.tensor`` of the number, a float past the dtype's range included
    (``torch.full`` alone raises there)."""
    from hvd_compress.torch.backend import _filled
    for value in (0.1, -2.5, 1e40, -1e40, 7e4, float("nan"), float("inf"), 3, np.float32(1.5)):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            got, want = _filled(value, dtype, "cpu"), torch.tensor(value, dtype=dtype)
            assert got.dtype == want.dtype and (torch.equal(got, want) or
                                                (got.isnan().item() and want.isnan().item())), \
                (value, dtype, got, want)
    assert torch.equal(_filled(3, torch.int64, "cpu"), torch.tensor(3))


def test_importing_the_package_imports_no_triton():
    code = "import sys, hvd_compress, hvd_compress.torch; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    assert out == "False"


@CUDA
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_same_bits(spec, monkeypatch):
    """On a GPU: the kernels' payloads, decodes and residuals equal the chain's on the
    device (the same torch.rand draws when no noise is given) and numpy's (noise given);
    every kernel, also those off by default there (``HVD_COMPRESS_TRITON=all``)."""
    monkeypatch.setenv("HVD_COMPRESS_TRITON", "all")
    to_cuda = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    bad = []
    for shape in CUDA_SHAPES:
        for explicit in (True, False):
            bad += _compare(spec, shape, TorchBackend(), to_cuda, explicit)
    assert bad == []


@CUDA
def test_cuda_kernels_do_not_synchronise():
    """An encode and aggregate through the kernels waits for the GPU nowhere (a first step
    compiles the kernels and caches the decode tables; tests/triton_sync_cases.py)."""
    B = TorchBackend()
    x = torch.randn(100_003, device="cuda")
    for spec in SYNC.SPECS:
        comp = build(spec, B)
        SYNC.step(comp, x)  # first step: kernels compiled, state made, tables cached
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            SYNC.step(comp, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@CUDA
def test_cuda_dgc_lowering_waits_for_nothing():
    """DGC's correction loop through its kernels (a threshold far above the 0.8 k-th
    magnitude: lowered four times) waits for the GPU nowhere and gives the chain's
    threshold.  Expected |z| >= t of 1,000,003: 6.0 -> 0, 4.8 -> 2, 3.84 -> 123,
    3.072 -> 2126, all < 8000 = LOWER * k; 2.4576 -> 13987: there it stops."""
    mag = torch.randn(1_000_003, device="cuda").abs()
    thr, k = torch.full((), 6.0, device="cuda"), 10_000
    lower = TorchBackend().fused_encoder(LOWERING, 1, like=mag)
    lower(mag, thr, math.ceil(LOWER * k), ADAPT_ROUNDS, LOWER)  # compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = lower(mag, thr, math.ceil(LOWER * k), ADAPT_ROUNDS, LOWER)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    chain = thr
    for _ in range(ADAPT_ROUNDS):
        cnt = torch.count_nonzero(mag >= chain)
        chain = torch.where(cnt.to(torch.float64) < LOWER * k, chain * LOWER, chain)
    assert got.item() == chain.item() < thr.item() * LOWER ** 3  # lowered at least 4 times


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_table_shows_the_chain_beside_the_kernels(capsys):
    """The kernel benchmark's table on a device: the Triton path's figures, then the
    chain's (a document as ``--device cuda`` makes it)."""
    doc = {"framework": "torch", "device": "cuda", "numel": 1000, "copy_ms": 0.5, "repeats": 5,
           "serial_below": None, "triton": True,
           "results": [{"compression": "qsgd", "encode_ms": 0.2, "decode_ms": 0.1,
                        "payload_bytes": 500, "ratio": 8.0, "floor_copies": 1.5,
                        "chain_encode_ms": 1.9, "chain_decode_ms": 0.5}]}
    _bench().print_table(doc)
    out = capsys.readouterr().out
    assert "Triton kernels on" in out and "chain enc" in out
    # /floor: (0.2 + 0.1) / 0.5 / 1.5 = 0.4 with the kernels, (1.9 + 0.5) / 0.5 / 1.5 = 3.2 without
    assert out.splitlines()[2].split()[5] == "0.4" and out.splitlines()[2].split()[-1] == "3.2"


@CUDA
def test_cuda_bench_reports_both_paths():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"),
                           "--framework", "torch", "--device", "cuda", "--numel", "100003",
                           "--repeats", "1", "--json", "--compression", "qsgd",
                           "--compression", "terngrad"], capture_output=True, text=True,
                          timeout=600, check=True)
    doc = json.loads(proc.stdout)
    assert doc["triton"] is True
    for r in doc["results"]:
        assert r["chain_encode_ms"] > 0 and r["encode_ms"] > 0


if __name__ == "__main__":  # the checks that import triton (_in_subprocess)
    what = sys.argv[1]
    print(json.dumps(_compile_checks() if what == "compile" else _interpreter_checks(int(what[-1]))))
