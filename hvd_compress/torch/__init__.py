"""hvd-compress for PyTorch.

    import horovod.torch as hvd
    import hvd_compress.torch as hc

    hvd.init()
    opt = hc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=hc.TopK(ratio=0.01))   # or hc.compressor("topk:ratio=0.01")

Compressors run the reference core's algorithms on torch tensors (CPU or CUDA)
and keep Horovod's ``compress``/``decompress`` contract; the summable ones
(``FP16``, ``BF16``, ``RandomK``, ``PowerSGD``) also work in Horovod's own
``hvd.DistributedOptimizer``.  For ``torch.nn.parallel.DistributedDataParallel``
(NCCL or Gloo, no Horovod): ``ddp.register_comm_hook(*hc.ddp_comm_hook("topk:ratio=0.01"))``
(:mod:`.ddp`).  Adam with compressed communication: wrap ``hc.OneBitAdam(...)`` or
``hc.ZeroOneAdam(...)`` (:mod:`.adam`).
"""

from ..requirements import require

require("torch")  # PyTorch and horovod.torch, or an ImportError naming what is missing

from ..frontend import class_names  # noqa: E402
from . import compressors  # noqa: E402
from .adam import OneBitAdam, ZeroOneAdam  # noqa: E402
from .backend import TorchBackend  # noqa: E402
from .compressors import TorchCompressor, as_compressor, compressor  # noqa: E402
from .ddp import DDPCompressionState, compression_hook, ddp_comm_hook  # noqa: E402
from .distributed import DistributedOptimizer  # noqa: E402

__all__ = ["TorchBackend", "TorchCompressor", "compressor", "as_compressor",
           "DistributedOptimizer", "DDPCompressionState", "compression_hook", "ddp_comm_hook",
           "OneBitAdam", "ZeroOneAdam",
           *class_names()]


def __getattr__(name):
    """``hc.TopK``, ``hc.QSGD``, ...: the named classes, made from the registry."""
    return getattr(compressors, name)
