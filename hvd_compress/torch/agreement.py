"""The PyTorch optimizer's exchange plan, which the ranks check at its first exchange
(see :mod:`hvd_compress.core.agreement`)."""

from __future__ import annotations

import horovod.torch as hvd

from ..core import agreement
from .elastic import sync_compressor_state


def ready_engine(opt):
    """``opt``'s exchange engine, driving the compressor's current core (rebuilt by
    ``bind()``/``with_param()``), once the ranks agreed on the optimizer's plan: one
    small allgather at its first exchange (its tensors never change).

    Right after that agreement every rank also takes the set's first rank's *shared*
    compressor state (step counters, PowerSGD's ``Q``, the step count; see
    :mod:`.elastic`): Horovod's resume pattern loads a checkpoint on rank 0 only and
    ``broadcast_optimizer_state`` carries only the wrapped optimizer's state, so
    without this the ranks would draw Random-k's indices or PowerSGD's ``Q`` for
    different steps.  Each rank keeps its own residuals (zero where it loaded none)."""
    engine = opt._engine
    engine.comp = opt._compression.core
    first = "optimizer" not in engine.agreed
    engine.agree(lambda: optimizer_plan(opt), key="optimizer")
    if first and engine.size > 1:
        sync_compressor_state(opt, root_rank=min(opt.process_set.ranks or [0]))
    return engine


def optimizer_plan(opt) -> dict:
    """Compressor, op, settings, groups, and the parameters in the order they travel."""
    names, local = opt._parameter_names, opt._local
    comp = opt._compression
    per_tensor = {}
    if hasattr(comp, "policy"):  # each tensor's own compressor
        per_tensor["plan"] = [r["compression"] for r in opt.plan()]
    return agreement.plan(
        "torch.DistributedOptimizer", comp.describe(), agreement.op_name(opt.op, hvd),
        opt.gradient_predivide_factor, opt.backward_passes_per_step,
        [(names[p], p.shape, _dtype(p)) for group in opt._groups for p in group],
        groups=[len(group) for group in opt._groups],
        local_sgd=agreement.local_sgd(local is not None, local and local.schedule.period,
                                      local and local.schedule.warmup),
        delay=opt._dga.delay if opt._dga is not None else 0,
        buffers=[[k, list(b.shape), _dtype(b)] for k, b in local.buffers] if local else [],
        sparse_as_dense=bool(opt.sparse_as_dense),
        hierarchy=f"nodes of {opt._engine.local_size}" if opt.hierarchical else "off",
        **per_tensor)


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")
