"""The ranks' agreement on an exchange plan, checked once at the first exchange.

Ranks launched with different settings -- another compressor or ratio on one
host, another ``op``, ``backward_passes_per_step`` or model -- would send
collectives that do not match: Horovod then hangs, or fails later with a shape
error naming none of the settings.  Each wrapper describes its *plan* (a dict
of plain values: :func:`plan`) and, before its first exchange, the ranks compare
a fingerprint of it in one small allgather (a 32-byte digest and a length).
Where the digests differ, a second allgather carries every rank's whole plan,
and every rank raises the same :class:`PlanMismatchError` naming the fields
that differ and each side's value.  Framework-neutral: the engine
(:meth:`~.exchange.Exchange.agree`) lends its collectives and array backend.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

__all__ = ["PlanMismatchError", "plan", "fingerprint", "differences", "mismatch_message",
           "check", "gather_bytes", "op_name", "local_sgd"]

_HEADER = 40  # digest (32 bytes) and the plan's length in bytes (8)
_SHOWN = 3    # tensors named per kind of difference


class PlanMismatchError(ValueError):
    """The ranks were set up differently (compressor, op, tensors, ...).  ``fields``: the
    plan fields that differ; ``plans``: every rank's plan, by rank."""

    def __init__(self, message: str, fields=(), plans=()):
        super().__init__(message)
        self.fields = tuple(fields)
        self.plans = list(plans)

    #: raised in a ``tf.function`` being traced, TensorFlow's AutoGraph passes it on as
    #: it is (not as a ``StagingError`` without ``fields``)
    ag_pass_through = True


def op_name(op, module) -> str:
    """The name of Horovod's reduction ``op`` in ``module`` (``horovod.torch``, ...)."""
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(module, name, object()) == op:
            return name
    return str(op)


def plan(wrapper: str, spec, op: str, gradient_predivide_factor: float,
         backward_passes_per_step: int, tensors, **more) -> dict:
    """What every rank of one exchange set-up must share.  ``spec``: the parsed spec
    (its text holds every parameter's resolved value); ``tensors``: ``(name, shape,
    dtype)`` in the order they are exchanged; ``more``: the wrapper's other settings
    (local SGD, DGA, buffers, groups, ...)."""
    out = {"wrapper": wrapper, "compression": str(spec), "op": op,
           "gradient_predivide_factor": float(gradient_predivide_factor),
           "backward_passes_per_step": int(backward_passes_per_step)}
    out.update(more)
    out["tensors"] = [[str(n), _shape(s), str(d)] for n, s, d in tensors]
    return out


def local_sgd(on: bool, period, warmup) -> str:
    """Local SGD's settings as a plan shows them."""
    return f"period={int(period)},warmup={int(warmup)}" if on else "off"


def _shape(shape) -> list:
    return [None if d is None else int(d) for d in shape]


def _encode(p: dict) -> bytes:
    return json.dumps(p, sort_keys=True, separators=(",", ":")).encode()


def fingerprint(p: dict) -> bytes:
    """The plan's 32-byte digest (sha256 of its canonical JSON)."""
    return hashlib.sha256(_encode(p)).digest()


def differences(a: dict, b: dict) -> list:
    """The fields whose values differ (in ``a``'s order, then ``b``'s extra fields)."""
    keys = list(a) + [k for k in b if k not in a]
    return [k for k in keys if a.get(k) != b.get(k)]


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _uses(ranks) -> str:
    return _ranks(ranks) + (" uses" if len(ranks) == 1 else " use")


def _tensor(t) -> str:
    return f"{t[0]!r} {tuple(t[1])} {t[2]}"


def _list(items) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _tensors_diff(a: list, b: list, who_a: str, who_b: str) -> str:
    """How two tensor lists differ, briefly: counts, names on one side only, shapes or
    dtypes that differ, or the order."""
    by_a, by_b = {t[0]: t for t in a}, {t[0]: t for t in b}
    parts = [f"{who_a} exchanges {len(a)} tensors, {who_b} {len(b)}"]
    only_a = [_tensor(t) for t in a if t[0] not in by_b]
    only_b = [_tensor(t) for t in b if t[0] not in by_a]
    changed = [f"{_tensor(by_a[n])} vs {tuple(by_b[n][1])} {by_b[n][2]}"
               for n in by_a if n in by_b and by_a[n] != by_b[n]]
    if only_a:
        parts.append(f"only {who_a} has {_list(only_a)}")
    if only_b:
        parts.append(f"only {who_b} has {_list(only_b)}")
    if changed:
        parts.append(f"shape or dtype differ: {_list(changed)}")
    if not (only_a or only_b or changed):
        parts.append("in another order")
    return "; ".join(parts)


def _value(value) -> str:
    return "(not set)" if value is None else repr(value)


def mismatch_message(plans: list) -> tuple:
    """``(message, fields)`` for the ranks' ``plans`` (by rank) that do not all agree:
    each distinct plan is compared with rank 0's, field by field, naming both sides."""
    groups: dict = {}
    for rank, p in enumerate(plans):
        groups.setdefault(_encode(p), []).append(rank)
    (ref_ranks, *others) = list(groups.values())
    ref = plans[ref_ranks[0]]
    fields = []
    for ranks in others:
        fields += [f for f in differences(ref, plans[ranks[0]]) if f not in fields]
    lines = [f"hvd_compress: the ranks' exchange plans differ in {', '.join(fields)}; launch "
             "every rank with the same compressor, settings and model:"]
    for field in fields:
        if field == "tensors":
            for ranks in others:
                if plans[ranks[0]].get(field) != ref.get(field):
                    lines.append("  tensors: " + _tensors_diff(
                        ref.get(field) or [], plans[ranks[0]].get(field) or [],
                        _ranks(ref_ranks), _ranks(ranks)))
            continue
        sides = [f"{_uses(ref_ranks)} {field}={_value(ref.get(field))}"]
        sides += [f"{_uses(ranks)} {field}={_value(plans[ranks[0]].get(field))}"
                  for ranks in others if plans[ranks[0]].get(field) != ref.get(field)]
        lines.append("  " + ", ".join(sides))
    return "\n".join(lines), fields


def check(p: dict, gather) -> None:
    """Raise :class:`PlanMismatchError` on every rank unless all ranks hold plan ``p``.
    ``gather(data, lengths)`` allgathers this rank's bytes (``lengths``: every rank's
    byte count) and returns each rank's bytes; called once when the ranks agree, twice
    when they do not (the whole plans, to name the differences)."""
    data = _encode(p)
    header = hashlib.sha256(data).digest() + struct.pack("<Q", len(data))
    headers = gather(header, None)
    if all(h[:32] == header[:32] for h in headers):
        return
    lengths = [struct.unpack("<Q", h[32:])[0] for h in headers]
    plans = [json.loads(b.decode()) for b in gather(data, lengths)]
    message, fields = mismatch_message(plans)
    raise PlanMismatchError(message, fields, plans)


def gather_bytes(coll, B, data: bytes, lengths, name: str = "hvd_compress.plan") -> list:
    """One allgather of ``data`` over the engine's collectives ``coll`` as a uint8 array
    of backend ``B``; each rank's bytes, in rank order (``lengths`` None: every rank
    sent a header)."""
    flat = B.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    out = coll.wait(coll.allgather(flat, name if lengths is None else name + ".full"))
    if isinstance(out, (list, tuple)):
        return [B.to_numpy(row).tobytes() for row in out]
    raw = B.to_numpy(out).tobytes()
    lengths = lengths or [_HEADER] * (len(raw) // _HEADER)
    offsets = np.cumsum([0] + list(lengths))
    return [raw[a:b] for a, b in zip(offsets, offsets[1:])]
