"""The process sets of the hierarchical exchange (:mod:`hvd_compress.core.hierarchy`):
each node's workers, and the workers of each local index across nodes.

Horovod runs a collective over a subset of workers only through a *process set*
registered on every worker, either at ``hvd.init(process_sets=[...])`` or, with
``HOROVOD_DYNAMIC_PROCESS_SETS=1``, by ``hvd.add_process_set`` after it.  Both ways
are here, for either framework (``hvd`` is ``horovod.torch`` or ``horovod.tensorflow``)::

    hvd.init(process_sets=hvd_compress.nodes.node_process_sets())   # at init
    # or: HOROVOD_DYNAMIC_PROCESS_SETS=1, then after hvd.init():
    hvd_compress.nodes.add_node_process_sets(hvd)

:func:`node_process_sets` reads the layout from the launcher's environment before
``init`` (``HOROVOD_SIZE``/``HOROVOD_LOCAL_SIZE`` from ``horovodrun``,
``OMPI_COMM_WORLD_SIZE``/``..._LOCAL_SIZE`` from Open MPI) and assumes what
``horovodrun`` does: nodes of equal size, ranks numbered node by node.  The wrappers
check that assumption on every worker (:func:`node_sets`) and use the sets only where
it holds; :func:`add_node_process_sets` asks every worker its node instead.
"""

from __future__ import annotations

import atexit
import os
import sys

__all__ = ["layout", "node_process_sets", "add_node_process_sets", "node_sets", "finish_together"]

_MADE: list = []  # the process sets made here, in the order they were registered

#: why ``hierarchical=True`` cannot be honoured
MISSING = ("hierarchical=True needs the node process sets on every worker: "
           "hvd.init(process_sets=hvd_compress.nodes.node_process_sets()), or "
           "HOROVOD_DYNAMIC_PROCESS_SETS=1 and hvd_compress.nodes.add_node_process_sets(hvd) "
           "after hvd.init(); workers in at least two nodes of two or more, numbered node "
           "by node; and the global process set")


def layout(size: int, local_size: int) -> tuple:
    """``(nodes, crosses)``: the ranks of each node and of each local index across nodes,
    for ``size`` workers in nodes of ``local_size``, numbered node by node."""
    if local_size < 1 or size % local_size:
        raise ValueError(f"{size} workers do not fill nodes of {local_size}")
    count = size // local_size
    nodes = [list(range(c * local_size, (c + 1) * local_size)) for c in range(count)]
    crosses = [[c * local_size + lr for c in range(count)] for lr in range(local_size)]
    return nodes, crosses


def _env_int(*names):
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def node_process_sets() -> list:
    """The process sets to pass to ``hvd.init(process_sets=...)``: every node's and every
    local index's, from the launcher's environment (empty where the workers share one
    node, span nodes of one worker, or the nodes differ in size)."""
    from horovod.common.process_sets import ProcessSet
    size = _env_int("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    local = _env_int("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if not size or not local or local in (1, size) or size % local:
        return []
    nodes, crosses = layout(size, local)
    sets = [ProcessSet(r) for r in nodes + crosses]
    _MADE[:] = sets
    return list(sets)


def add_node_process_sets(hvd) -> list:
    """After ``hvd.init()`` with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``: every worker tells its
    node (``cross_rank``) and local index (``local_rank``) in one allgather, and the sets
    are added on every worker in one order.  Returns them (empty where a node set would be
    the whole world or one worker, or nodes differ in size)."""
    pairs = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank()))
    by_node: dict = {}
    for rank, (node, _) in enumerate(pairs):
        by_node.setdefault(node, []).append(rank)
    sizes = {len(r) for r in by_node.values()}
    if len(sizes) != 1 or len(by_node) < 2 or sizes == {1}:
        return []
    nodes = [sorted(by_node[n]) for n in sorted(by_node)]
    crosses = [[node[i] for node in nodes] for i in range(len(nodes[0]))]
    sets = [hvd.add_process_set(r) for r in nodes + crosses]
    _MADE[:] = sets
    return list(sets)


def node_sets(hvd, process_set=None):
    """``(node, cross, local_index)`` for this worker when the hierarchical exchange can
    run, else None: sets made here are registered, ``process_set`` (the wrapper's) is the
    global one, and this worker's node set and cross set hold it as Horovod says
    (its rank in the node set is its ``local_rank``, in the cross set its
    ``cross_rank``), and the job is not elastic (its world may change)."""
    if not _MADE:  # (no set made here: nothing to ask Horovod, initialised or not)
        return None
    if process_set is not None and process_set is not hvd.global_process_set and \
            getattr(process_set, "process_set_id", 0) != 0:
        return None
    if os.environ.get("HOROVOD_ELASTIC") == "1":  # the world may change: no fixed nodes
        return None
    rank = hvd.rank()
    mine = [s for s in _MADE if s.process_set_id is not None and s.ranks and rank in s.ranks]
    node = next((s for s in mine if len(s.ranks) == hvd.local_size()), None)
    cross = next((s for s in mine if s is not node and len(s.ranks) == hvd.cross_size()), None)
    if node is None or cross is None or hvd.local_size() * hvd.cross_size() != hvd.size():
        return None
    if node.rank() != hvd.local_rank() or cross.rank() != hvd.cross_rank():
        return None
    return node, cross, node.rank()


_FINISH = {"hvd": None, "failed": False}


def finish_together(hvd) -> None:
    """Make this worker wait for every other at exit (``hvd.barrier()``; TensorFlow: a tiny
    ``allgather_object``), once per process.

    The hierarchical exchange ends a step with an allgather inside the node, so one
    node's workers can finish the last step, exit and shut Horovod down while another
    node's are still in theirs ("Horovod has been shut down").  The wrappers call this
    when they use it.  A worker leaving on an uncaught exception does not wait (the
    others could be waiting for it)."""
    if _FINISH["hvd"] is not None:
        return
    _FINISH["hvd"] = hvd
    previous = sys.excepthook

    def hook(*exc):
        _FINISH["failed"] = True
        previous(*exc)
    sys.excepthook = hook
    atexit.register(_barrier)


def _barrier() -> None:
    hvd = _FINISH["hvd"]
    if hvd is None or _FINISH["failed"]:
        return
    try:
        if hvd.is_initialized() and hvd.size() > 1:
            barrier = getattr(hvd, "barrier", None)  # (horovod.tensorflow has none)
            barrier() if barrier is not None else hvd.allgather_object(0, name="hvd_compress.finish")
    except Exception:  # Horovod already shut down: nothing to wait for
        pass
