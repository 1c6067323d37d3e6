"""Checks on the process set a wrapper exchanges over (either framework).

Horovod's Python process sets live in ``horovod.common``, shared by
``horovod.torch`` and ``horovod.tensorflow``; whichever of the two was imported
last answers for both.  ``init()`` of the *other* one then leaves the global
process set without ranks, so ``included()`` is False on every worker and a
wrapper would skip every exchange: each worker would train alone, silently
(Horovod's own optimizer does: two workers, gradients 2 and 4, each kept its own).
The wrappers check when they are made and again at each exchange (an elastic job
may start with one worker, where nothing is refused, and grow).
"""

from __future__ import annotations

__all__ = ["check_process_set", "exchanges", "included", "set_size"]


def _left_empty(hvd, process_set) -> bool:
    """Whether ``process_set`` is the global set left without ranks after ``hvd.init()``."""
    return getattr(process_set, "process_set_id", None) == 0 and process_set.ranks == [] \
        and hvd.is_initialized()


def included(hvd, process_set) -> bool:
    """Whether this rank is in ``process_set``: Horovod's answer, except for the global set
    left empty (the module docstring), which holds every rank of ``hvd``'s world -- on one
    worker Horovod says False there, and DiLoCo's outer step, which runs alone too, was
    skipped (its schedule never moved) in a process that had imported TensorFlow last."""
    if _left_empty(hvd, process_set):
        return True
    return bool(process_set.included())


def set_size(hvd, process_set) -> int:
    """``process_set``'s size (``hvd``'s world for the global set left empty)."""
    return hvd.size() if _left_empty(hvd, process_set) else process_set.size()


def check_process_set(hvd, process_set) -> None:
    """Raise where ``process_set`` is Horovod's global set left empty by ``hvd.init()``
    (the module docstring) among two or more workers; ``hvd`` is ``horovod.torch`` or
    ``horovod.tensorflow``."""
    if not _left_empty(hvd, process_set):
        return
    if hvd.size() < 2:  # (one worker: nothing to exchange)
        return
    raise RuntimeError(
        f"Horovod's global process set holds no ranks after {hvd.__name__}.init(): "
        "horovod.torch and horovod.tensorflow were both imported and the other one was "
        f"imported last, so every exchange would be skipped. Import {hvd.__name__} after "
        "the other (or only one of them) in this process")


def exchanges(hvd, process_set) -> bool:
    """Whether this rank takes part in ``process_set``'s exchanges, after
    :func:`check_process_set` (run at each exchange: an elastic job that started with
    one worker, where nothing is refused, may have grown)."""
    check_process_set(hvd, process_set)
    return included(hvd, process_set)
