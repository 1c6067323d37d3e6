"""What the PyTorch and TensorFlow compressor objects share (framework-neutral).

A front end holds a validated spec, builds the core compressor on its
framework's backend lazily (once Horovod tells the rank and size), and keeps
Horovod's contract -- ``compress(tensor) -> (tensor, ctx)``,
``decompress(tensor, ctx) -> tensor`` -- through the exchange engine: only
summable payloads may go through Horovod's own allreduce-only wrappers, whose
allreduce is the final round.
"""

from __future__ import annotations

import inspect

from . import spec as specmod
from .core import build, registry
from .core.base import Encoded
from .core.exchange import Exchange, new_stats
from .core.planrow import PlanRow

__all__ = ["CompressorFrontend", "horovod_builtin_spec", "choice_of", "new_stats", "named_class",
           "compressor", "class_names"]


def horovod_builtin_spec(compression) -> str:
    """The spec of Horovod's own ``Compression.none`` / ``Compression.fp16`` (any framework)."""
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return "none"
    if name == "FP16Compressor":
        return "fp16"
    raise TypeError(f"compression must be an hvd_compress compressor, a spec string like "
                    f"'topk:ratio=0.01', or horovod's Compression.none/fp16; got {compression!r}")


def choice_of(compression):
    """A wrapper's ``compression=`` as the per-tensor policy reads it: None as ``"none"``,
    Horovod's ``Compression.none/fp16`` as their spec text, anything else (a spec, a
    mapping, a callable, a compressor or policy object) as it is."""
    if compression is None:
        return "none"
    if isinstance(compression, (str, dict, list, tuple, CompressorFrontend)) or \
            hasattr(compression, "policy") or \
            (callable(compression) and not hasattr(compression, "compress")):
        return compression
    return horovod_builtin_spec(compression)


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
            engine.agreed = self.__dict__.setdefault("_agreed_plans", set())
            self.__dict__["_contract_engine"] = engine
        # The ranks agree on the compressor at the first call (Horovod's optimizer drives
        # the op, settings and tensors: they are not ours to check here).
        engine.agree(lambda: {"wrapper": "Horovod's compress()/decompress()",
                              "compression": str(self.spec)}, key="contract")
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

    @property
    def variable_size(self) -> bool:
        """Payload sizes depend on the values (threshold-v, adaptive quantization)."""
        return self.core.variable_size

    @property
    def integer_sum(self) -> bool:
        """Integer codes summed by allreduce (``sum=int``): the hierarchical exchange
        takes them (:func:`hvd_compress.core.hierarchy.sharded`)."""
        return self.core.integer_sum

    @property
    def scale_free(self) -> bool:
        """The aggregate does not scale with the inputs (signSGD's and Signum's vote): the
        engine leaves ``gradient_predivide_factor`` out."""
        return self.core.scale_free

    def describe(self) -> str:
        """The compression as checkpoints and plan checks record it."""
        return str(self.spec)

    def specs(self) -> list:
        return [self.spec]

    def passthrough_for(self, name: str, shape, dtype: str) -> bool:
        return self.passthrough

    def plan(self, entries) -> list[PlanRow]:
        """Per tensor (``entries``: ``(name, shape, dtype)``) its :class:`PlanRow`, as a
        per-tensor policy's :meth:`~hvd_compress.pertensor.PolicyFrontend.plan`: every one
        with this spec."""
        from .core.base import TensorMeta
        core = self.core
        rows = []
        for n, s, d in entries:
            shape = tuple(int(x) for x in s)
            rows.append(PlanRow(n, shape, d, str(self.spec), not self.passthrough,
                                int(core.payload_nbytes(TensorMeta(n, shape, d)))))
        return rows

    @property
    def passthrough(self) -> bool:
        """Uncompressed (``none``): Horovod's own averaging allreduce, nothing decoded."""
        return self.core.passthrough

    @property
    def epoch(self):
        """DGC's warm-up epoch (None for compressors without a schedule)."""
        return getattr(self.core, "epoch", None)

    def set_epoch(self, epoch: int) -> bool:
        """DGC's warm-up epoch (no-op for other compressors); returns whether the payload
        sizes changed (DGC's density did)."""
        if hasattr(self.core, "set_epoch"):
            return bool(self.core.set_epoch(epoch))
        return False

    def _keep_epoch(self, old) -> None:
        """After the core was built again (other rank or parameters), DGC's warm-up epoch
        of the ``old`` core carries over (a ``set_epoch`` made before the first step)."""
        epoch = getattr(old, "epoch", None)
        if epoch is not None:  # (the core's own: the same sizes as before, nothing to re-trace)
            self.core.set_epoch(epoch)

    def _refuse_unsummable(self) -> None:
        """Horovod's wrappers can only allreduce: say so clearly, naming ours."""
        if self.core.integer_sum:
            raise RuntimeError(
                f"compression {str(self.spec)!r} sums integer codes, which the averaging "
                f"allreduce of {self.HOROVOD_WRAPPER} would truncate; use {self.OUR_WRAPPER} "
                "(a drop-in replacement taking the same arguments)")
        if not self.summable:
            raise RuntimeError(
                f"compression {str(self.spec)!r} sends packed bytes that cannot be summed by "
                f"allreduce, so it cannot run inside {self.HOROVOD_WRAPPER}; use "
                f"{self.OUR_WRAPPER} (a drop-in replacement taking the same arguments), which "
                "sends it with allgather")


# -- the named classes (hc.TopK, hct.QSGD, ...), made from the registry ------------------------
def _spec_text(name: str, params: dict) -> str:
    given = [f"{k}={v}" for k, v in params.items() if v is not None]
    return name + (":" + ",".join(given) if given else "")


def class_names() -> list:
    """The named classes every framework offers: one per registered algorithm, and Compose."""
    return [a.class_name for a in registry.algorithms()] + ["Compose"]


def named_class(base: type, class_name: str) -> type:
    """The subclass of ``base`` (a framework's compressor class) called ``class_name``:
    ``__init__`` takes the algorithm's parameters (positionally in schema order, or by
    keyword; None: the default) and builds the spec.  Made once per base and registry
    entry, so ``isinstance`` and pickling work; raises AttributeError for unknown names."""
    cache = base.__dict__.get("_named_classes")
    if cache is None:
        cache = {}
        setattr(base, "_named_classes", cache)
    alg = next((a for a in registry.algorithms() if a.class_name == class_name), None)
    if class_name in cache and cache[class_name][0] is alg:  # (an entry replaced: remade)
        return cache[class_name][1]
    if class_name == "Compose":
        def __init__(self, sparsifier, quantizer):
            base.__init__(self, f"{sparsifier.spec}+{quantizer.spec}")
        doc = "A sparsifier then a quantizer of the kept values, e.g. Compose(TopK(0.01), QSGD(16))."
        sig_params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for n in ("sparsifier", "quantizer")]
    else:
        if alg is None:
            raise AttributeError(class_name)
        __init__ = _init_for(base, alg)
        doc = alg.doc
        sig_params = [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default)
                      for k, p in alg.params.items()]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    __init__.__signature__ = inspect.Signature([self_param] + sig_params)
    cls = type(class_name, (base,), {"__init__": __init__, "__doc__": doc,
                                     "__module__": base.__module__, "__qualname__": class_name})
    cache[class_name] = (alg, cls)
    return cls


def _init_for(base, alg):
    keys = list(alg.params)

    def __init__(self, *args, **kwargs):
        if len(args) > len(keys):
            raise TypeError(f"{alg.class_name}() takes at most {len(keys)} positional "
                            f"arguments ({', '.join(keys) or 'none'}), got {len(args)}")
        given = dict(zip(keys, args))
        for key, value in kwargs.items():
            if key not in keys:
                raise TypeError(f"{alg.class_name}() got an unexpected keyword argument {key!r}; "
                                f"it takes {', '.join(keys) or 'none'}")
            if key in given:
                raise TypeError(f"{alg.class_name}() got multiple values for argument {key!r}")
            given[key] = value
        base.__init__(self, _spec_text(alg.name, given))
    return __init__


def compressor(base: type, spec):
    """An instance of ``base``'s named class for ``spec`` (``Compose`` for two parts)."""
    parsed = specmod.parse(spec)
    name = "Compose" if parsed.composed else registry.get(parsed.name).class_name
    cls = named_class(base, name)
    obj = cls.__new__(cls)
    base.__init__(obj, parsed)
    return obj
