"""hvd-compress: gradient compression for Horovod.

The numpy reference core (``hvd_compress.core``) defines every algorithm;
``hvd_compress.torch`` and ``hvd_compress.tensorflow`` run the same algorithms
on framework tensors and plug into Horovod's ``DistributedOptimizer``.
"""

__version__ = "0.4.0"

# The accelerators (numba kernels, loaded on first use) into the core's provider slot.
from . import accel  # noqa: E402,F401
from .core.agreement import PlanMismatchError  # noqa: E402,F401
