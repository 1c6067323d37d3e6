"""What the PyTorch and TensorFlow compressor objects share (framework-neutral).

A front end holds a validated spec, builds the core compressor on its
framework's backend lazily (once Horovod tells the rank and size), and keeps
Horovod's contract rules: only summable payloads may go through Horovod's own
allreduce-only wrappers.
"""

from __future__ import annotations

from . import spec as specmod
from .core import build


def new_stats() -> dict:
    """One step's account of bytes sent and milliseconds spent (optimizers and tapes)."""
    return {"bytes_sent": 0, "encode_ms": 0.0, "comm_ms": 0.0, "decode_ms": 0.0, "collectives": 0}


def horovod_builtin_spec(compression) -> str:
    """The spec of Horovod's own ``Compression.none`` / ``Compression.fp16`` (any framework)."""
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return "none"
    if name == "FP16Compressor":
        return "fp16"
    raise TypeError(f"compression must be an hvd_compress compressor, a spec string like "
                    f"'topk:ratio=0.01', or horovod's Compression.none/fp16; got {compression!r}")


class CompressorFrontend:
    """Base of ``hvd_compress.torch.TorchCompressor`` and ``...tensorflow.TFCompressor``."""

    #: the core backend (set by each framework)
    BACKEND = None
    #: where Horovod's allreduce-only wrappers live, and ours, for the refusal message
    HOROVOD_WRAPPER = ""
    OUR_WRAPPER = ""

    def _init_frontend(self, spec, rank=None, world_size=None):
        self.spec = specmod.parse(spec)
        self._rank, self._world_size = rank, world_size
        self._core = None

    def _build_core(self):
        rank, size = self._rank, self._world_size
        if rank is None:
            rank, size = self._horovod_rank_size()
        return build(self.spec, backend=self.BACKEND, rank=rank, world_size=size)

    def _horovod_rank_size(self):
        return 0, 1

    @property
    def summable(self) -> bool:
        return self.core.summable

    def set_epoch(self, epoch: int) -> None:
        """DGC's warm-up epoch (no-op for other compressors)."""
        if hasattr(self.core, "set_epoch"):
            self.core.set_epoch(epoch)

    def _refuse_unsummable(self) -> None:
        """Horovod's wrappers can only allreduce: say so clearly, naming ours."""
        if not self.summable:
            raise RuntimeError(
                f"compression {str(self.spec)!r} sends packed bytes that cannot be summed by "
                f"allreduce, so it cannot run inside {self.HOROVOD_WRAPPER}; use "
                f"{self.OUR_WRAPPER} (a drop-in replacement taking the same arguments), which "
                "sends it with allgather")
