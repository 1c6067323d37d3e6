"""``hvd_compress.torch.DistributedOptimizer``: Horovod's optimizer, with every compressor.

A drop-in replacement for ``horovod.torch.DistributedOptimizer`` (0.28.1): the same
arguments, defaults and behaviour (gradient hooks start communication during the
backward pass, ``synchronize()``/``skip_synchronize()``, ``backward_passes_per_step``,
``op``, ``gradient_predivide_factor``, ``groups``, ``sparse_as_dense``,
``process_set``).  This module checks the arguments, turns ``compression`` into a
compressor and makes the optimizer: an instance of the wrapped optimizer's class with
the shell's methods (:mod:`.optimizer`).

**DGC and momentum.** DGC applies momentum inside the compressor (momentum
correction), so the wrapped optimizer must not apply it again: use
``torch.optim.SGD(momentum=0)`` and give the momentum to DGC (``dgc:momentum=0.9``,
the default).  A wrapped optimizer's ``momentum=m > 0`` is moved into DGC (warning).
"""

from __future__ import annotations

import warnings

import horovod.torch as hvd

from ..core.outer import OUTER_MOMENTUM
from ..core.policy import DEFAULT_MIN_NUMEL
from ..localsteps import check_outer_args
from .adam import adopt_rule, check_rule_args
from .compressors import TorchPolicy, as_compression, pair_dgc_with_momentum
from .optimizer import _DistributedOptimizer
from .params import check_args

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         local_sgd=False, local_sgd_warmup_steps=0, named_buffers=None, delay=0,
                         min_numel=DEFAULT_MIN_NUMEL, start_step=0, hierarchical=None,
                         exchange="auto", outer_lr=None, outer_momentum=OUTER_MOMENTUM,
                         fragments=1):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    Arguments are those of ``horovod.torch.DistributedOptimizer`` 0.28.1, with
    ``compression`` also taking any hvd_compress compressor or a spec string
    (``"topk:ratio=0.01"``), or a per-tensor choice (:mod:`hvd_compress.core.policy`):
    an ordered mapping from parameter-name patterns to specs (first match wins;
    ``"pattern=spec;..."`` as text) or a callable ``(name, shape, dtype) -> spec``.
    ``min_numel`` (default 1,024): smaller tensors travel uncompressed, all in one
    allreduce per step (``0``: off).  ``start_step=N``: the first N steps send every
    gradient uncompressed.  ``plan()`` / ``print_plan()`` show each tensor's compressor
    and bytes.  The result is an instance of the wrapped optimizer's class;
    ``comm_stats`` accumulates the current step's bytes and times, ``last_stats`` holds
    the last synchronized step's, ``comm_totals`` the sums since creation.

    Beyond Horovod (see :mod:`hvd_compress.localsteps`): ``local_sgd=True``: each
    backward pass is followed by this worker's own ``step()``, and every
    ``backward_passes_per_step`` steps the workers average their parameters
    (compressed: their change since the last average, with error feedback) and the
    float buffers in ``named_buffers`` (``model.named_buffers()`` for BatchNorm);
    ``local_sgd_warmup_steps=K`` synchronous steps come first.  DiLoCo (with
    ``local_sgd``; :mod:`hvd_compress.core.outer`): ``outer_lr`` (the paper: 0.7; None,
    the default: the plain average) makes each average an outer Nesterov step of
    momentum ``outer_momentum`` (0.9) on the mean pseudo-gradient ``anchor - p`` (any
    compressor carries it, with error feedback); ``fragments=F`` (Streaming DiLoCo)
    syncs one of F parameter fragments every ``backward_passes_per_step / F`` steps,
    each every ``backward_passes_per_step`` (docs/local-steps.md).  ``delay=D``: Delayed
    Gradient Averaging, step i's average applied at step i + D as ``g_i - g_{i-D} +
    avg(g_{i-D})`` (a one-round compressor, ``backward_passes_per_step=1``; call
    ``drain()`` at the end).  ``exchange``: how compressed payloads travel --
    ``"allgather"`` (every worker's payload to all), ``"two-phase"`` (chunks to their
    owners, who sum and re-compress, then gathered: bytes per worker constant in the
    workers; :mod:`hvd_compress.core.twophase`), ``"hierarchical"`` /
    ``"hierarchical+two-phase"`` (dense inside each node, compressed between nodes:
    :mod:`hvd_compress.core.hierarchy`; the node process sets must be registered,
    :func:`hvd_compress.nodes.node_process_sets`), ``"allreduce"`` (summable payloads), or
    ``"auto"`` (the default): the ranks time a few collectives at the first exchange and
    each tensor takes the cheapest (:mod:`hvd_compress.core.autoexchange`; ``plan()`` says
    which and why).  ``hierarchical=True`` is ``exchange="hierarchical"``; ``False`` keeps
    the hierarchy out of ``"auto"``.  ``optimizer`` may be :class:`~.adam.OneBitAdam` or
    :class:`~.adam.ZeroOneAdam`: their rule then decides what travels (dense gradients,
    the compressed momentum or accumulated updates), every exchange in ``step()``.
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    comp = as_compression(compression, min_numel, start_step)
    check_args(comp.specs(), op, gradient_predivide_factor, backward_passes_per_step, local_sgd,
               local_sgd_warmup_steps, delay, start_step)
    check_outer_args(local_sgd, outer_lr, outer_momentum, fragments, backward_passes_per_step)
    rule = getattr(optimizer, "hvd_compress_rule", False)  # 1-bit / 0-1 Adam (.adam)
    if rule:
        check_rule_args(optimizer, op, gradient_predivide_factor, backward_passes_per_step,
                        local_sgd, delay, hvd)
    elif not local_sgd and not isinstance(comp, TorchPolicy):  # (a policy pairs once named)
        pair_dgc_with_momentum(optimizer, comp)  # local steps keep their own momentum
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, comp, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set, local_sgd,
                  local_sgd_warmup_steps, named_buffers, delay, hierarchical, exchange,
                  outer_lr=outer_lr, outer_momentum=outer_momentum, fragments=fragments)
    if rule:
        adopt_rule(wrapped, optimizer)
    return wrapped
