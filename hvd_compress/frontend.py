"""What the PyTorch and TensorFlow compressor objects share (framework-neutral).

A front end holds a validated spec, builds the core compressor on its
framework's backend lazily (once Horovod tells the rank and size), and keeps
Horovod's contract -- ``compress(tensor) -> (tensor, ctx)``,
``decompress(tensor, ctx) -> tensor`` -- through the exchange engine: only
summable payloads may go through Horovod's own allreduce-only wrappers, whose
allreduce is the final round.
"""

from __future__ import annotations

from . import spec as specmod
from .core import build
from .core.base import Encoded
from .core.exchange import Exchange, new_stats

__all__ = ["CompressorFrontend", "horovod_builtin_spec", "new_stats"]


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

    def _protocol(self):
        """What the exchange engine drives: the core (torch), or a wrapper that binds the
        core's state to variables (TensorFlow)."""
        return self.core

    def _horovod_collectives(self):
        """The framework's Horovod collectives over the global process set."""
        raise NotImplementedError

    def _contract_name(self, tensor) -> str:
        """The name keying ``tensor``'s state inside Horovod's own optimizer or tape."""
        raise NotImplementedError

    # -- Horovod's contract ----------------------------------------------------------------
    def compress(self, tensor):
        """Encode ``tensor`` (and run PowerSGD's first round); Horovod's allreduce of the
        returned tensor is the final round."""
        self._refuse_unsummable()
        engine = self.__dict__.get("_contract_engine")
        if engine is None or engine.comp is not self._protocol():
            engine = Exchange(self._protocol(), self._horovod_collectives(), average=False)
            self.__dict__["_contract_engine"] = engine
        enc = engine.prepare(tensor, self._contract_name(tensor))
        return engine.wired(enc.payload), enc

    def decompress(self, tensor, ctx):
        """The dense tensor from what Horovod's allreduce returned."""
        if not isinstance(ctx, Encoded):
            return tensor
        return self._protocol().aggregate(tensor, ctx)

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
