#!/usr/bin/env python
"""Encode/decode speed and payload size of every compressor on one big tensor.

    python scripts/bench_kernels.py --framework numpy
    python scripts/bench_kernels.py --compression topk:ratio=0.01 --compression onebit --json
    python scripts/bench_kernels.py --framework torch --device cuda

The input is standard-normal x 1e-3 from a fixed seed, ``--numel`` elements
(default 25,557,032: ResNet-50's parameter count), as a flat float32 vector
(PowerSGD, which needs a matrix, gets the nearest square matrix).  For each
compressor: the median over repeats of the encode time (error feedback and
state updates included) and of the decode time (aggregating this one rank's
payload into a dense tensor), the exact payload bytes and the compression
ratio against float32; and, in the same run, the median time of a plain copy
of the same float32 tensor, the yardstick the targets are stated against, and
the floor: the least memory the step must move, in copies (``floor_copies``).
DGC is measured past its warm-up (at its final sparsity).

On a CUDA device each compressor is measured twice: with the Triton kernels where they
run (``hvd_compress/accel/triton_*.py``; ``triton`` says whether they load) and with
them off (``HVD_COMPRESS_TRITON=0``: the chain of torch operations), the latter as
``chain_encode_ms`` and ``chain_decode_ms``.

Several ``--numel`` sizes give a table (a JSON document) each: small sizes show the
per-call cost that the two-phase exchange's chunks pay.  ``--serial-below N`` sets the
size under which the numba kernels run their serial compilation instead of the thread
pool (``hvd_compress.accel.jit.SERIAL_BELOW``; 0: the pool for every call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvd_compress import spec as specmod  # noqa: E402
from hvd_compress.core import build  # noqa: E402

DEFAULT_NUMEL = 25_557_032
DEFAULT_SPECS = ["none", "fp16", "bf16", "topk", "randomk", "dgc", "qsgd", "terngrad", "onebit",
                 "threshold", "powersgd", "signsgd", "signum", "efsignsgd", "natural", "uniform",
                 "eightbit", "sketchml", "thresholdv", "adaq", "inceptionn"]
FRAMEWORKS = ("numpy", "torch", "tensorflow")


def get_backend(framework: str):
    if framework == "numpy":
        from hvd_compress.core import NUMPY
        return NUMPY
    if framework == "torch":
        from hvd_compress.torch import TorchBackend
        return TorchBackend()
    if framework == "tensorflow":
        import os
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        from hvd_compress.tensorflow import TensorFlowBackend
        return TensorFlowBackend()
    raise SystemExit(f"bench_kernels: --framework {framework} is not available yet "
                     f"(available: {', '.join(FRAMEWORKS)})")


def _timed(fn, B, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        sync = getattr(B, "synchronize", None)
        if sync:
            sync()
        t0 = time.perf_counter()
        out = fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def on_device(t, device: str):
    """``t`` on ``device`` (torch only: ``cuda`` or ``cuda:N``; every backend has ``cpu``)."""
    return t if device == "cpu" else t.to(device)


def bench_one(spec: str, B, host: np.ndarray, repeats: int, device: str = "cpu") -> dict:
    comp = build(spec, backend=B)
    if comp.spec.parts[0].name == "dgc":
        comp.set_epoch(int(comp.spec.parts[0].params["warmup_epochs"]))
    shape = host.shape
    if comp.spec.parts[0].name == "dgc" and len(shape) < 2:  # DGC sends vectors whole
        shape = (1, host.size)
    if comp.spec.name == "powersgd":
        m = math.isqrt(host.size)
        shape = (m, host.size // m)
    x = on_device(B.from_numpy(host[: shape[0] * (shape[1] if len(shape) > 1 else 1)]
                                  .reshape(shape)), device)

    def encode():
        enc = comp.encode(x, "bench")
        for _ in range(comp.rounds(enc.meta) - 1):
            enc = comp.next_round(enc, enc.payload)  # one rank: the sum is its own payload
        return enc

    encode()  # warm-up (allocates state; compiles kernels)
    enc_ms, enc = _timed(encode, B, repeats)
    received = enc.payload if comp.summable else [enc.payload]
    comp.aggregate(received, enc)  # warm-up
    dec_ms, out = _timed(lambda: comp.aggregate(received, enc), B, repeats)
    if tuple(B.shape(out)) != tuple(shape):
        raise AssertionError(f"{spec}: decoded shape {B.shape(out)} != {shape}")
    # every round's bytes (PowerSGD: P and Q); where sizes depend on the values, this step's
    nbytes = enc.nbytes if comp.variable_size else comp.payload_nbytes(enc.meta)
    numel = int(np.prod(shape))
    out = {"compression": spec, "encode_ms": round(enc_ms, 3), "decode_ms": round(dec_ms, 3),
           "payload_bytes": nbytes, "ratio": round(4 * numel / nbytes, 3), "shape": list(shape),
           "floor_copies": round(floor_copies(comp, numel, nbytes), 3)}
    if comp.spec.parts[0].name == "dgc":
        # DGC's sampled threshold (sample, k-th largest, correction loop) on |x| alone.
        mag = B.abs(B.reshape(x, (-1,)))
        meta = comp.meta_for(x, "bench")
        out["threshold_ms"] = round(_timed(lambda: comp.threshold(mag, meta, 0), B, repeats)[0], 3)
    if comp.spec.parts[0].name == "topk" and B.name != "numpy":
        # The framework's own top-k alone on the same tensor, for comparison.
        k = comp.k_for(comp.meta_for(x, "bench"))
        out["framework_topk_ms"] = round(_timed(lambda: _framework_topk(B, x, k), B, repeats)[0], 3)
    return out


def floor_copies(comp, numel: int, payload: int) -> float:
    """The least memory a step must move, in copies of the tensor (a copy reads and
    writes ``4 * numel`` bytes): encoding reads the gradient and writes the payload,
    and reads and writes its state -- the error-feedback residual, DGC's ``u`` and
    ``v``, Signum's momentum -- and decoding reads the payload and writes the dense
    tensor.  Selection (top-k, DGC, adaq) needs at least one more read of its input:
    counted too.  ``none`` hands the tensor itself to the collective: 0."""
    n4 = 4 * numel
    name = comp.spec.parts[0].name
    if comp.passthrough:
        return 0.0
    state = 2 if comp.ef else 0  # tensors read and written back each step
    state += 4 if name == "dgc" else 0
    state += 2 if name == "signum" else 0
    select = 1 if name in ("topk", "dgc", "adaq") else 0
    return (n4 * (1 + state + select) + 2 * payload + n4) / (2 * n4)


def _framework_topk(B, x, k):
    if B.name == "torch":
        import torch
        return torch.topk(x.abs().reshape(-1), k)
    import tensorflow as tf
    return tf.math.top_k(tf.abs(tf.reshape(x, [-1])), k)


def _real_copy(B, x):
    """A copy that really copies the bytes (tf.identity of an eager tensor may not)."""
    if B.name == "tensorflow":
        import tensorflow as tf
        return tf.raw_ops.DeepCopy(x=x)
    return B.copy(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--framework", default="numpy", help=f"one of: {', '.join(FRAMEWORKS)}")
    ap.add_argument("--numel", type=int, nargs="+", default=[DEFAULT_NUMEL], metavar="N",
                    help="elements, one size or several (default %s)" % DEFAULT_NUMEL)
    ap.add_argument("--compression", action="append", metavar="SPEC",
                    help="compressor spec, repeatable (default: every compressor at its default)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats, median taken (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    ap.add_argument("--device", default="cpu",
                    help="where the tensor lives: cpu (default), or cuda / cuda:N with --framework torch")
    ap.add_argument("--json", action="store_true",
                    help="print JSON: framework, device, numel, copy_ms, results: [{compression, encode_ms, "
                         "decode_ms, payload_bytes, ratio, floor_copies}] (stable names; on CUDA "
                         "also triton and each result's chain_encode_ms, chain_decode_ms); with "
                         "several --numel, a list of those, one a size")
    ap.add_argument("--serial-below", type=int, default=None, metavar="N",
                    help="numba kernels on arrays under N elements run serially (default: the "
                         "library's SERIAL_BELOW; 0: always on the thread pool)")
    args = ap.parse_args(argv)
    if min(args.numel) < 1:
        ap.error("--numel must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.device != "cpu":
        if args.framework != "torch" or not re.fullmatch(r"cuda(:\d+)?", args.device):
            ap.error(f"--device {args.device}: only cpu, or cuda / cuda:N with --framework torch")
        import torch
        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: PyTorch sees no CUDA device here")
    specs = args.compression or DEFAULT_SPECS
    for s in specs:
        try:
            specmod.parse(s)
        except ValueError as exc:
            ap.error(str(exc))
    if args.serial_below is not None and args.serial_below < 0:
        ap.error("--serial-below must be >= 0")
    serial_below = _serial_below(args.serial_below)
    B = get_backend(args.framework)
    docs = [bench_size(B, specs, numel, args, serial_below) for numel in args.numel]
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    else:
        for doc in docs:
            print_table(doc)
    return 0


def _serial_below(value):
    """Set the numba kernels' serial threshold to ``value`` (None: leave it); returns
    the threshold in force, or None without numba."""
    try:
        from hvd_compress.accel import jit
    except ImportError:  # no numba: no kernels
        return None
    if value is not None:
        jit.SERIAL_BELOW = value
    return jit.SERIAL_BELOW


def bench_size(B, specs, numel: int, args, serial_below) -> dict:
    """One size's document: the copy's time and every compressor's figures."""
    host = (np.random.default_rng(args.seed).standard_normal(numel, dtype=np.float32)
            * np.float32(1e-3))
    x = on_device(B.from_numpy(host), args.device)
    copy_ms, _ = _timed(lambda: _real_copy(B, x), B, max(args.repeats, 5))
    results = []
    for i, s in enumerate(specs, 1):
        print(f"[{i}/{len(specs)}] {s} ({numel:,}) ...", file=sys.stderr, flush=True)
        r = bench_one(s, B, host, args.repeats, args.device)
        if args.device != "cpu":  # the same without the Triton kernels: the torch chain
            with _triton_off():
                chain = bench_one(s, B, host, args.repeats, args.device)
            r["chain_encode_ms"], r["chain_decode_ms"] = chain["encode_ms"], chain["decode_ms"]
        results.append(r)
    doc = {"framework": args.framework, "device": args.device, "numel": numel,
           "copy_ms": round(copy_ms, 3), "serial_below": serial_below,
           "repeats": args.repeats, "results": results}
    if args.device != "cpu":
        from hvd_compress.accel import device
        doc["triton"] = bool(device.enabled() and device.available())
    return doc


class _triton_off:
    """``HVD_COMPRESS_TRITON=0`` inside the block."""

    def __enter__(self):
        self.old = os.environ.get("HVD_COMPRESS_TRITON")
        os.environ["HVD_COMPRESS_TRITON"] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("HVD_COMPRESS_TRITON", None)
        else:
            os.environ["HVD_COMPRESS_TRITON"] = self.old


def print_table(doc: dict) -> None:
    copy_ms, repeats = doc["copy_ms"], doc["repeats"]
    chain = "triton" in doc
    print(f"framework {doc['framework']} on {doc['device']}, {doc['numel']:,} float32 elements, "
          f"copy {copy_ms:.3f} ms (median of {repeats}), serial below {doc['serial_below']}"
          + (f", Triton kernels {'on' if doc['triton'] else 'not available'}" if chain else ""))
    print(f"{'compression':34s} {'encode ms':>10s} {'decode ms':>10s} {'(enc+dec)/copy':>15s} "
          f"{'floor':>6s} {'/floor':>7s} {'payload bytes':>14s} {'ratio':>8s}"
          + (f" {'chain enc':>10s} {'chain dec':>10s} {'/floor':>7s}" if chain else ""))
    for r in doc["results"]:
        rel = (r["encode_ms"] + r["decode_ms"]) / max(copy_ms, 1e-9)
        gap = f"{rel / r['floor_copies']:7.1f}" if r["floor_copies"] else f"{'-':>7s}"
        line = (f"{r['compression']:34s} {r['encode_ms']:10.3f} {r['decode_ms']:10.3f} "
                f"{rel:15.1f} {r['floor_copies']:6.2f} {gap} "
                f"{r['payload_bytes']:14,d} {r['ratio']:8.1f}")
        if chain:
            old = (r["chain_encode_ms"] + r["chain_decode_ms"]) / max(copy_ms, 1e-9)
            old_gap = f"{old / r['floor_copies']:7.1f}" if r["floor_copies"] else f"{'-':>7s}"
            line += f" {r['chain_encode_ms']:10.3f} {r['chain_decode_ms']:10.3f} {old_gap}"
        print(line)
    print("floor: the least memory a step must move, in copies of the tensor (see "
          "floor_copies); /floor: how far above it the measured time is"
          + ("; chain: the torch chain without the Triton kernels" if chain else ""))


if __name__ == "__main__":
    sys.exit(main())
