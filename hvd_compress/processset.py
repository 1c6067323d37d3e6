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

__all__ = ["check_process_set", "exchanges"]


def check_process_set(hvd, process_set) -> None:
    """Raise where ``process_set`` is Horovod's global set left empty by ``hvd.init()``
    (the module docstring) among two or more workers; ``hvd`` is ``horovod.torch`` or
    ``horovod.tensorflow``."""
    if getattr(process_set, "process_set_id", None) != 0 or process_set.ranks != []:
        return
    if not hvd.is_initialized() or hvd.size() < 2:  # (one worker: nothing to exchange)
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
    return process_set.included()
