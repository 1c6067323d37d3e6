"""hvd-compress for TensorFlow 2 (in progress: the array backend is here).

:class:`TensorFlowBackend` runs the reference core's algorithms on tf tensors
with the same bits as numpy; the Horovod integration (DistributedGradientTape,
Keras optimizer) builds on it.
"""

from .backend import TensorFlowBackend

__all__ = ["TensorFlowBackend"]
