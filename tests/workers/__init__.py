"""The bodies run by the launches of tests/launches.py (one module per subject)."""

import os


def started_with_pair(hvd, kept: list):
    """Horovod (``hvd``: ``horovod.torch`` or ``horovod.tensorflow``) up, with the process
    set of ranks 0 and 1 registered at init where the world has more than two ranks (a set
    must be registered at the first ``hvd.init``; the shared np 3 launches start Horovod
    through this); in a world of two that set is the global one (registering it again is
    refused).  ``kept``: the caller's list holding the set once made.  Returns ``(hvd, the
    set)``."""
    if not kept:
        if int(os.environ.get("HOROVOD_SIZE", "3")) > 2:
            kept.append(hvd.ProcessSet([0, 1]))
            hvd.init(process_sets=[kept[0]])
        else:
            hvd.init()
            kept.append(hvd.global_process_set)
    return hvd, kept[0]
