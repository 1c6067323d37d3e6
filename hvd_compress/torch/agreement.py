"""The PyTorch optimizer's exchange plan, which the ranks check at its first exchange
(see :mod:`hvd_compress.core.agreement`; the session runs the check)."""

from __future__ import annotations

import horovod.torch as hvd

from ..core import agreement


def entries(params, names) -> list:
    """``(name, shape, dtype)`` of each parameter in ``params`` (``names``: parameter ->
    name), as the per-tensor plan reads them."""
    return [(names[p], tuple(p.shape), _dtype(p)) for p in params]


def optimizer_plan(session, comp, names, groups, rows, backward_passes_per_step,
                   sparse_as_dense, local) -> dict:
    """Compressor, op, settings, groups, and the parameters in the order they travel.
    ``names``: parameter -> name; ``rows``: the per-tensor plan (:meth:`plan`'s rows) or
    None; ``local``: the local SGD strategy (:class:`~.localsteps.LocalSGD`: its
    buffers and DiLoCo settings) or None."""
    schedule = session.schedule
    per_tensor = {}
    if rows is not None:  # each tensor's own compressor
        per_tensor["plan"] = [r.compression for r in rows]
    if local is not None:
        per_tensor["outer"] = local.describe()
    buffers = local.buffers if local is not None else []
    return agreement.plan(
        "torch.DistributedOptimizer", comp.describe(), agreement.op_name(session.op, hvd),
        session.predivide, backward_passes_per_step,
        [(names[p], p.shape, _dtype(p)) for group in groups for p in group],
        groups=[len(group) for group in groups],
        local_sgd=agreement.local_sgd(schedule is not None, schedule and schedule.period,
                                      schedule and schedule.warmup),
        delay=session.delay,
        buffers=[[k, list(b.shape), _dtype(b)] for k, b in buffers],
        sparse_as_dense=bool(sparse_as_dense), hierarchy=session.hierarchy(), **per_tensor)


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")
