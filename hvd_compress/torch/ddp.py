"""A ``DistributedDataParallel`` communication hook running hvd-compress's compressors.

    import hvd_compress.torch as hc

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state, hook = hc.ddp_comm_hook("topk:ratio=0.01", named_parameters=ddp.named_parameters())
    ddp.register_comm_hook(state, hook)

Each bucket DDP hands the hook is cut into its parameters' gradients, which go through
the exchange engine the Horovod optimizer runs (:class:`~hvd_compress.core.exchange.
Exchange`, or :class:`~hvd_compress.core.twophase.TwoPhase`) over ``torch.distributed``'s
collectives (:class:`~.torchdist.TorchDistributed`): per tensor the same encoding, error
feedback, rounds and aggregate, so the averaged gradients are the Horovod path's bits.

**State and DDP's bucket rebuild.**  A compressor's state (residuals, DGC's memory,
PowerSGD's Q) is keyed by tensor name, not by bucket: DDP rebuilds its buckets after the
first iteration (another grouping, other indices), which would orphan state keyed by
bucket index -- PyTorch's PowerSGD hook keys its error by index and so runs uncompressed
allreduces until ``start_powerSGD_iter >= 2``.  Keyed by parameter, the state carries
over the rebuild and compression may start at step 0.  Names are ``named_parameters``'
(give ``ddp.named_parameters()``: the Horovod optimizer's names and bits, modulo the
``module.`` prefix), else ``param<k>`` in the order DDP first hands the parameters over
(deterministic: DDP launches buckets in index order).

**The future.**  The exchange runs inside the hook (the engine's rounds wait for each
other), so the returned ``torch.futures.Future`` is already complete: the averaged
gradients overlap the rest of the backward pass only as far as DDP's own bucket order
lets a blocking hook.
"""

import torch
import torch.distributed as dist

from ..core.exchange import Exchange
from ..core.policy import DEFAULT_MIN_NUMEL
from ..core.stats import Stats
from ..core.twophase import TwoPhase
from .compressors import TorchPolicy, as_compression
from .torchdist import TorchDistributed

__all__ = ["DDPCompressionState", "compression_hook", "ddp_comm_hook", "EXCHANGES"]

#: the engines the hook runs: every compressed payload by allgather (summable ones by
#: allreduce), or the two-phase exchange (alltoall, then allgather: bytes per worker flat in p)
EXCHANGES = {"allgather": Exchange, "two-phase": TwoPhase}


class DDPCompressionState:
    """What :func:`compression_hook` keeps between calls, as ``PowerSGDState`` is for
    ``powerSGD_hook``.

    Knobs: ``compression`` -- a spec (``"topk:ratio=0.01"``), a compressor object, a
    per-tensor mapping or callable (as :func:`~.distributed.DistributedOptimizer` takes);
    ``process_group`` (None: the default group); ``named_parameters``; ``min_numel``
    (default 1,024 as the optimizer's: smaller tensors travel uncompressed, in one
    allreduce per bucket; 0: off); ``start_step=N`` (the first N iterations
    uncompressed, as ``start_powerSGD_iter``); ``exchange`` (``"allgather"`` or
    ``"two-phase"``: :data:`EXCHANGES`).  DGC applies momentum itself: give it in the
    spec (``dgc:momentum=0.9``) and use an optimizer without momentum.

    Account (as the optimizer's ``comm_stats`` / ``last_stats`` / ``comm_totals``,
    :class:`~hvd_compress.core.stats.Stats`): :attr:`stats` this iteration's so far,
    :attr:`last_stats` the last finished iteration's, :attr:`totals` since creation;
    :attr:`iter` counts finished iterations (one per ``bucket.is_last()``);
    :meth:`compression_stats` as ``PowerSGDState``'s, in bytes.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (tensors on the CPU, plain
    values: ``torch.save`` / ``torch.load(weights_only=True)``); pickling keeps the same
    and, as ``PowerSGDState``, leaves the process group out (the default group after
    loading; set :attr:`process_group` for another)."""

    def __init__(self, compression, process_group=None, named_parameters=None, *,
                 min_numel: int = DEFAULT_MIN_NUMEL, start_step: int = 0,
                 exchange: str = "allgather"):
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: expected one of {', '.join(EXCHANGES)}")
        self.process_group = process_group
        self.compression = as_compression(compression, min_numel, start_step)
        self.min_numel, self.start_step, self.exchange = int(min_numel), int(start_step), exchange
        self.iter = 0
        self.stats, self.last_stats, self.totals = Stats(), Stats(), Stats()
        self.dense_bytes = 0    # the buckets' bytes handed to the hook, since creation
        self._names = {}        # parameter -> name
        self._seen = []         # names in the order DDP first handed their parameters over
        self._seen_set = set()
        self._restored = []     # a checkpoint's such names: unnamed parameters take them
        self._engine = None
        if named_parameters is not None:
            self.name_parameters(named_parameters)
        elif (isinstance(self.compression, TorchPolicy) and self.compression.policy.single is None
              and self.compression.policy.rules is None):
            # a callable's choices are known only from the tensors; settled from the first
            # bucket alone, the uncompressed tensors' spec could differ from the optimizer's
            raise ValueError("ddp_comm_hook: a compression callable needs named_parameters "
                             "(e.g. named_parameters=ddp.named_parameters()): the plan is "
                             "settled from every parameter before the first bucket")
        if dist.is_available() and dist.is_initialized():
            self._collectives()  # (else at the first bucket)

    def name_parameters(self, named_parameters) -> None:
        """Key the state of these parameters by these names (``model.named_parameters()``):
        given to the constructor, or later -- after unpickling, or for another model
        object holding the same parameters' names."""
        self._names = {p: n for n, p in named_parameters}
        if isinstance(self.compression, TorchPolicy):
            self.compression.settle([_entry(n, p) for p, n in self._names.items()])

    # -- one bucket ------------------------------------------------------------------------
    def run(self, bucket) -> torch.futures.Future:
        """Average ``bucket``'s gradients across the group, compressed, into its buffer;
        a completed future holding the buffer (see the module docstring)."""
        buffer = bucket.buffer()
        self.dense_bytes += buffer.numel() * buffer.element_size()
        params = list(bucket.parameters())
        names = [self._name(p) for p in params]
        views = bucket.gradients()  # (views of ``buffer`` at DDP's own offsets)
        engine = self._engine_now(names, params)
        comp = self.compression
        if isinstance(comp, TorchPolicy):
            comp.policy_step = self.iter  # (the delayed start)
        engine.agree(lambda: self._plan(names, params), key=("ddp", bucket.index(), tuple(names)))
        results = engine.run(views, names, self.stats, outs=views)
        for view, result in zip(views, results):
            if result is not view:
                view.copy_(result)
        if bucket.is_last():
            self.iter += 1
            self.last_stats = self.stats
            self.totals.add(self.stats)
            self.stats = Stats()
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def compression_stats(self) -> tuple:
        """``(rate, dense bytes, bytes sent)`` since creation, as
        ``PowerSGDState.compression_stats()`` gives ``(rate, numel before, numel after)``:
        the buckets' bytes over the bytes this rank sent (every round, headers included)."""
        sent = int(self.totals["bytes_sent"] + self.stats["bytes_sent"])
        return (self.dense_bytes / sent if sent else 0.0), self.dense_bytes, sent

    def _name(self, p) -> str:
        """``p``'s name: given, or the next unnamed one (a checkpoint's, else ``param<k>``)."""
        name = self._names.get(p)
        if name is None:
            k = len(self._seen)
            name = self._restored[k] if k < len(self._restored) else f"param{k}"
            self._names[p] = name
        if name not in self._seen_set:
            self._seen.append(name)
            self._seen_set.add(name)
        return name

    def _collectives(self) -> TorchDistributed:
        """The group's collectives; the compressor bound to this rank (the global one, as
        Horovod's optimizer binds it) and the group's size."""
        coll = TorchDistributed(self.process_group)
        self.compression.bind(dist.get_rank(), coll.size)
        return coll

    def _engine_now(self, names, params):
        """The engine, made at the first bucket (the group is up by then)."""
        if self._engine is None:
            coll = self._collectives()
            comp = self.compression
            if isinstance(comp, TorchPolicy):  # (named_parameters settled it already)
                comp.settle([_entry(n, p) for n, p in zip(names, params)])
            self._engine = EXCHANGES[self.exchange](comp.core, coll, average=True)
        return self._engine

    def _plan(self, names, params) -> dict:
        """What every rank must hold for this bucket (checked once per bucket layout)."""
        return {"wrapper": "hvd_compress DDP communication hook",
                "compression": self.compression.describe(), "exchange": self.exchange,
                "tensors": [[n, list(p.shape), str(p.dtype)] for n, p in zip(names, params)]}

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The compressor's per-tensor state, its description (a checkpoint made with
        another compression is refused), the iteration count, the totals and the names
        given to unnamed parameters."""
        return {"compressor": self.compression.state_dict(),
                "spec": self.compression.describe(), "iter": self.iter,
                "totals": dict(self.totals), "dense_bytes": self.dense_bytes,
                "seen": list(self._seen)}

    def load_state_dict(self, sd: dict) -> None:
        if sd["spec"] != self.compression.describe():
            raise ValueError(f"checkpoint was made with compression {sd['spec']!r}, this hook "
                             f"uses {self.compression.describe()!r}")
        self.compression.load_state_dict(sd["compressor"])
        self.iter = int(sd.get("iter", 0))
        for key, value in sd.get("totals", {}).items():
            setattr(self.totals, key, value)
        self.dense_bytes = int(sd.get("dense_bytes", 0))
        self._restored = list(sd.get("seen", []))

    def __getstate__(self) -> dict:
        """Pickled: the knobs and :meth:`state_dict`; not the process group, nor the
        parameters (unnamed ones are named again in the order they come)."""
        return {"knobs": {"compression": _choice_text(self.compression),
                          "min_numel": self.min_numel, "start_step": self.start_step,
                          "exchange": self.exchange},
                "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        knobs = saved["knobs"]
        self.__init__(knobs.pop("compression"), **knobs)
        self.load_state_dict(saved["state"])


def compression_hook(state: DDPCompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp.register_comm_hook(state, compression_hook)``
    (see the module docstring).  DDP checks the return annotation against
    ``torch.futures.Future[torch.Tensor]`` (so no postponed annotations in this module);
    ``bucket`` (a ``dist.GradBucket``) is left unannotated, so that importing this module
    needs no ``torch.distributed`` symbol on a build without it."""
    return state.run(bucket)


def ddp_comm_hook(compression, process_group=None, named_parameters=None, **knobs):
    """``(state, hook)`` for ``ddp.register_comm_hook(*ddp_comm_hook("topk:ratio=0.01"))``:
    a :class:`DDPCompressionState` over ``process_group`` and :func:`compression_hook`."""
    state = DDPCompressionState(compression, process_group, named_parameters, **knobs)
    return state, compression_hook


def _choice_text(comp) -> str:
    """The text :func:`~.compressors.as_compression` makes ``comp`` again from."""
    policy = getattr(comp, "policy", None)
    if policy is None:
        return str(comp.spec)
    if policy.single is not None:
        return str(policy.single)
    if policy.rules is not None:
        return ";".join(f"{p}={s}" for p, s in policy.rules)
    raise TypeError("a hook state with a compression callable cannot be pickled; save its "
                    "state_dict() and make the state again with the callable")


def _entry(name, p):
    return name, tuple(p.shape), str(p.dtype).replace("torch.", "")
