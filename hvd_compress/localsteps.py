"""Fewer, later messages: when local SGD averages, and Delayed Gradient Averaging's update.

Framework-neutral rules the PyTorch optimizer and the TensorFlow tape/Keras
optimizer share.

**Local SGD** (Stich, "Local SGD Converges Fast and Communicates Little", ICLR
2019; post-local SGD: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
ICLR 2020).  Every worker applies its own optimizer step after each backward
pass; every ``period`` steps the workers average their parameters (or, with a
compressor, the change since the last average, so error feedback applies to
it).  Optimizer state stays local.  ``warmup`` synchronous steps (ordinary
gradient averaging) may come first.  Horovod's ``backward_passes_per_step`` is
only gradient accumulation: no worker ever steps on its own.

**Delayed Gradient Averaging** (Zhu, Lin, Lu, Han, "Delayed Gradient Averaging:
Tolerate the Communication Latency for Federated Learning", NeurIPS 2021).  The
average of step ``i``'s gradients is applied at step ``i + D``; meanwhile each
worker steps on its own gradient, corrected once the stale average arrives::

    w <- w - lr * (g_i - g_{i-D} + avg(g_{i-D}))        (i >= D)
    w <- w - lr * g_i                                    (i <  D)

so the collective of step ``i`` overlaps the compute of the next ``D`` steps.
``D = 0`` is ordinary synchronous training.

**DiLoCo and Streaming DiLoCo** (:mod:`.core.outer`): local SGD whose averaging is an
outer Nesterov step on the pseudo-gradient, optionally one fragment of the parameters
at a time; :func:`check_outer_args` says which settings make sense.
"""

from __future__ import annotations

from .core.outer import OUTER_MOMENTUM
from .core.registry import chains_rounds, passes_through
from .core.spec import parse

__all__ = ["LocalSGDSchedule", "check_local_args", "check_wrapper_args", "check_horovod_args",
           "check_outer_args"]


class LocalSGDSchedule:
    """Which optimizer steps are synchronous (warm-up) and after which ones workers average.

    Steps count from 0.  Works on Python ints and on integer tensors (TF graphs):
    the expressions use only ``<``, ``>=``, ``%``, ``==`` and ``&``.
    """

    def __init__(self, period: int, warmup: int = 0):
        self.period = int(period)
        self.warmup = int(warmup)

    def synchronous(self, step):
        """Whether step ``step`` averages gradients as ordinary data-parallel SGD does."""
        return step < self.warmup

    def averages_after(self, step):
        """Whether the workers average their parameters after local step ``step``."""
        return (step >= self.warmup) & ((step - self.warmup + 1) % self.period == 0)

    def __repr__(self) -> str:
        return f"LocalSGDSchedule(period={self.period}, warmup={self.warmup})"


def check_wrapper_args(wrapper: str, horovods: str, op_is_average: bool, op_is_adasum: bool,
                       gradient_predivide_factor: float, backward_passes_per_step: int,
                       local_sgd: bool, warmup: int, delay: int, spec,
                       op_sums: bool = True, start_step: int = 0) -> None:
    """The argument checks every wrapper makes (torch optimizer, TF tape, Keras optimizer);
    ``spec``: the compression's spec, or the list of those a per-tensor plan uses:
    Horovod's own, ours, and :func:`check_local_args`.  ``op_sums``: the op is Average
    or Sum, the only ones a compressed exchange computes (Min, Max, Product need the
    values themselves: they go with ``none`` only)."""
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    if gradient_predivide_factor != 1.0 and not op_is_average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op_is_adasum:
        raise ValueError(f"{wrapper} does not support op=Adasum; use {horovods} for Adasum")
    if start_step and (local_sgd or delay):
        raise ValueError("start_step delays compressed gradient averaging; it cannot be combined "
                         "with local_sgd (use local_sgd_warmup_steps: synchronous steps first) "
                         "or delay")
    specs = [s for s in (spec if isinstance(spec, (list, tuple)) else [spec]) if s is not None]
    for s in specs:
        if not op_sums and not passes_through(s):
            raise ValueError(f"compression {str(s)!r} averages or sums; op must be Average or "
                             "Sum (other ops only with compression='none')")
    for s in specs or [None]:
        check_local_args(local_sgd, backward_passes_per_step, warmup, delay, op_is_average, s)


def check_horovod_args(hvd, wrapper: str, horovods: str, op, gradient_predivide_factor: float,
                       backward_passes_per_step: int, local_sgd: bool, warmup: int, delay: int,
                       spec, start_step: int = 0) -> None:
    """:func:`check_wrapper_args` for Horovod's reduction ``op`` of module ``hvd``
    (``horovod.torch`` or ``horovod.tensorflow``)."""
    check_wrapper_args(wrapper, horovods, op == hvd.Average, op == hvd.Adasum,
                       gradient_predivide_factor, backward_passes_per_step, local_sgd, warmup,
                       delay, spec, op_sums=op in (hvd.Average, hvd.Sum), start_step=start_step)


def check_local_args(local_sgd: bool, backward_passes_per_step: int, warmup: int, delay: int,
                     op_is_average: bool, spec=None) -> None:
    """Clear errors for combinations that cannot work (both frameworks raise the same)."""
    if warmup < 0:
        raise ValueError(f"local_sgd_warmup_steps must be >= 0, got {warmup}")
    if warmup and not local_sgd:
        raise ValueError("local_sgd_warmup_steps needs local_sgd=True")
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"delay must be an integer >= 0, got {delay!r}")
    if local_sgd and delay:
        raise ValueError("local_sgd and delay (Delayed Gradient Averaging) cannot be combined: "
                         "local SGD averages parameters, DGA averages gradients")
    if (local_sgd or delay) and not op_is_average:
        raise ValueError("local_sgd and delay need op=Average")
    if delay and backward_passes_per_step != 1:
        raise ValueError("delay (Delayed Gradient Averaging) needs backward_passes_per_step=1")
    if delay and spec is not None and chains_rounds(spec):
        raise ValueError("delay (Delayed Gradient Averaging) needs a one-round compressor; "
                         f"{parse(spec).name}'s second round depends on its first, so its exchange "
                         "cannot be left in flight across steps")


def check_outer_args(local_sgd: bool, outer_lr, outer_momentum: float, fragments,
                     period: int, tensors: int | None = None) -> None:
    """DiLoCo's settings (:mod:`.core.outer`): ``outer_lr`` (None: plain local SGD's
    average), ``outer_momentum`` and ``fragments`` only with ``local_sgd``; the period
    (``backward_passes_per_step``) a multiple of ``fragments``, at most ``tensors``
    fragments (the number of parameters exchanged, where known)."""
    if outer_lr is not None and not local_sgd:
        raise ValueError("outer_lr (DiLoCo's outer step) needs local_sgd=True")
    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
    if fragments != 1 and not local_sgd:
        raise ValueError("fragments (Streaming DiLoCo) needs local_sgd=True")
    if outer_lr is None:
        if outer_momentum != OUTER_MOMENTUM:
            raise ValueError("outer_momentum needs outer_lr (DiLoCo's outer step)")
    else:
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or \
                not outer_lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
                or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if local_sgd and period % fragments:
        raise ValueError(f"backward_passes_per_step ({period}, the period H) must be a "
                         f"multiple of fragments ({fragments}): one fragment syncs every "
                         "H / fragments steps")
    if tensors is not None and fragments > max(tensors, 1):
        raise ValueError(f"fragments ({fragments}) cannot exceed the number of parameters "
                         f"exchanged ({tensors})")
