"""hvd-compress for TensorFlow 2.

    import horovod.tensorflow as hvd
    import hvd_compress.tensorflow as hct

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hct.DistributedGradientTape(tape, compression="topk:ratio=0.01")
    grads = tape.gradient(loss, model.trainable_variables)

The compressors run the reference core's algorithms on tf tensors (same bits
as numpy), in eager mode and inside ``tf.function``, with per-variable state in
``tf.Variable``s; the summable ones (``fp16``, ``bf16``, ``randomk``,
``powersgd``) also work in Horovod's own ``hvd.DistributedGradientTape``.
"""

from ..requirements import require

require("tensorflow")  # TensorFlow and horovod.tensorflow, or an ImportError naming what is missing

from ..frontend import class_names  # noqa: E402
from . import compressors, keras  # noqa: E402  (hvd_compress.tensorflow.keras.DistributedOptimizer)
from .backend import TensorFlowBackend  # noqa: E402
from .compressors import (  # noqa: E402
    TFCompressor,
    TFPolicy,
    as_compression,
    as_compressor,
    broadcast_compression_state,
    compressor,
)
from .tape import DistributedGradientTape  # noqa: E402

__all__ = ["TensorFlowBackend", "TFCompressor", "TFPolicy", "compressor", "as_compressor",
           "as_compression", "broadcast_compression_state",
           "DistributedGradientTape", "keras", "elastic", *class_names()]


def __getattr__(name):
    """``hct.elastic`` (imported on first use: it imports Horovod's elastic modules);
    ``hct.TopK``, ``hct.QSGD``, ...: the named classes, made from the registry."""
    if name == "elastic":
        import importlib
        return importlib.import_module(f"{__name__}.elastic")
    return getattr(compressors, name)
