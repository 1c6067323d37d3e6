"""What the PyTorch and TensorFlow compressor objects share (framework-neutral).

A front end holds a validated spec, builds the core compressor on its
framework's backend lazily (once Horovod tells the rank and size), and keeps
Horovod's contract rules: only summable payloads may go through Horovod's own
allreduce-only wrappers.
"""

from __future__ import annotations

from . import spec as specmod
from .core import build


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
