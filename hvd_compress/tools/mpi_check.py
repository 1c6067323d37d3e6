"""Reference multi-rank step over mpi4py, no Horovod involved.

    mpirun -np 3 python -m hvd_compress.tools.mpi_check --compression topk:ratio=0.01
    mpirun -np 2 python -m hvd_compress.tools.mpi_check --compression all

Each rank makes a different gradient for a few tensors, compresses it with
the numpy reference core, exchanges the payloads with the collective the
compressor needs -- ``MPI_Allreduce`` with an operator that combines payloads
the way the compressor defines (``reduce_pair``), or ``MPI_Allgatherv`` of the
packed bytes -- and aggregates.  It then checks, for several steps (so state
such as residuals and warm-started PowerSGD factors is exercised):

* the aggregate equals the sum of every rank's payload decoded on its own;
* every rank holds the same aggregate, bit for bit;
* Random-k: every rank chose the same indices;
* ``none``: the aggregate is exactly the sum of the gradients;
* the payload is exactly ``payload_nbytes`` bytes.

Prints one line per compressor on rank 0 and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..core import spec as specmod
from ..core.exchange import MAX, Collectives, Exchange, new_stats
from ..core.powersgd import Rounds
from ..core.registry import build
from ..core.sparsifiers import Sparsifier

DEFAULT_SPECS = ("none", "fp16", "bf16", "topk:ratio=0.01", "randomk:ratio=0.01",
                 "randomk:ratio=0.05,unbiased=true", "dgc:ratio=0.001", "qsgd:levels=7",
                 "qsgd:levels=16,bucket=128", "terngrad", "onebit", "threshold:tau=0.001",
                 "powersgd:rank=2", "topk:ratio=0.05+qsgd:levels=16", "randomk:ratio=0.05+fp16",
                 "dgc:ratio=0.01+onebit", "signsgd", "signum", "signsgd:vote=false", "efsignsgd",
                 "natural", "uniform", "uniform:bits=8,stochastic=false", "eightbit",
                 "topk:ratio=0.05+natural", "sketchml", "sketchml:buckets=16", "thresholdv",
                 "thresholdv:tau=0.02,ef=false", "adaq", "adaq:ratio=0.2", "inceptionn",
                 "inceptionn:bound=1e-4")
SHAPES = {"conv.weight": (32, 16, 3, 3), "fc.weight": (100, 57), "fc.bias": (57,), "odd": (1001,)}


def _mpi():
    from mpi4py import MPI
    return MPI


class MPICollectives(Collectives):
    """Allreduce and allgather of compressor payloads over an mpi4py communicator."""

    sums_bfloat16 = True  # the reduction decodes payloads itself (reduce_pair)

    def __init__(self, comm, comp):
        self.MPI = _mpi()
        self.comm = comm
        self.comp = comp
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._ops = {}

    def _op(self, dtype):
        if dtype.str not in self._ops:
            comp = self.comp

            def combine(inbuf, inoutbuf, datatype):
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                b[...] = comp.reduce_pair(a, b)

            self._ops[dtype.str] = self.MPI.Op.Create(combine, commute=True)
        return self._ops[dtype.str]

    def allreduce(self, payload, name="", op=None, prescale=1.0, postscale=1.0):
        payload = np.ascontiguousarray(payload)
        out = np.empty_like(payload)
        # A contiguous type of one element's bytes keeps MPI from splitting elements.
        elem = self.MPI.BYTE.Create_contiguous(payload.dtype.itemsize).Commit()
        try:
            if op == MAX:
                self.comm.Allreduce(payload, out, op=self.MPI.MAX)
            else:
                self.comm.Allreduce([payload, payload.size, elem], [out, out.size, elem],
                                    op=self._op(payload.dtype))
        finally:
            elem.Free()
        return out

    def allgather(self, payload, name=""):
        payload = np.ascontiguousarray(payload, dtype=np.uint8)
        counts = self.comm.allgather(payload.size)
        out = np.empty(sum(counts), dtype=np.uint8)
        self.comm.Allgatherv(payload, [out, counts])
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [out[offsets[r]:offsets[r + 1]] for r in range(len(counts))]

    def free(self):
        for op in self._ops.values():
            op.Free()


def check(specs=DEFAULT_SPECS, steps: int = 3, seed: int = 0, scale: float = 1e-2) -> dict:
    """Run the checks for every spec; returns ``{spec: {...}}`` (same on every rank)."""
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    report = {}
    for spec in specs:
        comp = build(spec, rank=rank, world_size=size)
        coll = MPICollectives(comm, comp)
        engine = Exchange(comp, coll, average=False)
        failures = []
        sent = 0
        max_err = 0.0
        try:
            for step in range(steps):
                for t, (name, shape) in enumerate(SHAPES.items()):
                    rng = np.random.default_rng([seed, rank, step, t])
                    x = (rng.standard_normal(shape) * scale).astype(np.float32)
                    stats = new_stats()
                    batch = engine.send([x], [name], stats)
                    (total,) = engine.receive(batch, stats)
                    enc = batch.encoded[0]  # its final round
                    sent += stats["bytes_sent"]
                    if enc.nbytes != _bytes(enc.payload):
                        failures.append(f"{name}: payload has {_bytes(enc.payload)} bytes, "
                                        f"nbytes says {enc.nbytes}")
                    # Every rank's final-round payload, for the reference sum.
                    everyone = coll.allgather(enc.payload.view(np.uint8).ravel())
                    theirs = [p.view(enc.payload.dtype) if comp.variable_size else
                              p.view(enc.payload.dtype).reshape(enc.payload.shape) for p in everyone]
                    ref = _reference(comp, theirs, enc)
                    tol = 1e-5 * max(1.0, float(np.max(np.abs(ref))))
                    if comp.summable and enc.payload.dtype.itemsize == 2:
                        tol = 2 ** -8 * size * max(1e-30, float(np.max(np.abs(ref))))
                    err = float(np.max(np.abs(total.astype(np.float64) - ref)))
                    max_err = max(max_err, err)
                    if not err <= tol:
                        failures.append(f"{name} step {step}: aggregate differs from the reference "
                                        f"(decoded payloads summed) by {err:.3g} (tolerance {tol:.3g})")
                    if total.shape != x.shape or total.dtype != x.dtype:
                        failures.append(f"{name}: aggregate has shape {total.shape} {total.dtype}")
                    digests = comm.allgather(total.tobytes())
                    if any(d != digests[0] for d in digests):
                        failures.append(f"{name} step {step}: ranks hold different aggregates")
                    if isinstance(comp, Sparsifier) and comp.shared_indices:  # Random-k
                        idx = comm.allgather(enc.ctx.indices.tobytes())
                        if any(i != idx[0] for i in idx):
                            failures.append(f"{name} step {step}: ranks chose different indices")
                    if comp.passthrough:  # none
                        exact = sum((np.random.default_rng([seed, r, step, t]).standard_normal(shape)
                                     * scale).astype(np.float32) for r in range(size))
                        if not np.allclose(total, exact, rtol=1e-6, atol=1e-7):
                            failures.append(f"{name}: 'none' aggregate is not the sum of gradients")
        except Exception as exc:  # report, do not hang the other ranks
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            coll.free()
        all_failures = comm.allgather(failures)
        numel = sum(int(np.prod(s)) for s in SHAPES.values()) * steps
        report[spec] = {"ok": not any(all_failures), "failures": all_failures,
                        "bytes_per_rank": sent, "ratio": 4 * numel / max(1, sent),
                        "max_abs_err": max_err, "ranks": size}
    return report


def _bytes(payload) -> int:
    return int(np.asarray(payload).nbytes)


def _reference(comp, payloads, enc) -> np.ndarray:
    """Sum over ranks of each payload decoded on its own (float64); for a majority vote
    (signSGD, Signum), the number of ranks times the sign of that sum."""
    meta = enc.meta
    if isinstance(enc.ctx, Rounds):  # PowerSGD: Q against the P-hat all ranks share, or dense
        if enc.ctx.p_hat is not None:
            p_hat = enc.ctx.p_hat.astype(np.float64)
            return sum(p_hat @ q.astype(np.float64).T for q in payloads).reshape(meta.shape)
        return sum(p.astype(np.float64) for p in payloads).reshape(meta.shape)
    total = sum(comp.decode(p, meta, enc.ctx).astype(np.float64) for p in payloads)
    return np.sign(total) * len(payloads) if getattr(comp, "vote", False) else total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hvd_compress.tools.mpi_check",
        description="Run every rank's compress -> exchange -> aggregate with the numpy "
                    "reference over mpi4py and check the result (launch with mpirun).")
    ap.add_argument("--compression", action="append", metavar="SPEC",
                    help="compressor spec (repeatable), or 'all' for the default list")
    ap.add_argument("--steps", type=int, default=3, help="steps per compressor (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON on rank 0")
    args = ap.parse_args(argv)
    specs = []
    for s in args.compression or ["all"]:
        specs += list(DEFAULT_SPECS) if s == "all" else [s]
    for s in specs:
        try:
            specmod.parse(s)
        except ValueError as exc:
            ap.error(str(exc))
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    MPI = _mpi()
    rank = MPI.COMM_WORLD.Get_rank()
    report = check(specs, steps=args.steps, seed=args.seed)
    if rank == 0:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"{'compression':36s} {'ok':4s} {'ratio':>8s} {'bytes/rank':>11s} {'max|err|':>9s}")
            for s, r in report.items():
                print(f"{s:36s} {'OK' if r['ok'] else 'FAIL':4s} {r['ratio']:8.1f} "
                      f"{r['bytes_per_rank']:11d} {r['max_abs_err']:9.2e}")
                for fails in r["failures"]:
                    for f in fails:
                        print(f"    {f}")
            print(f"{sum(r['ok'] for r in report.values())} passed, "
                  f"{sum(not r['ok'] for r in report.values())} failed "
                  f"on {MPI.COMM_WORLD.Get_size()} ranks")
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
