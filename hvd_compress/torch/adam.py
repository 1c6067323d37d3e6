"""1-bit Adam and 0/1 Adam for PyTorch: the optimizers, and their step inside the shell.

    opt = hc.DistributedOptimizer(hc.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100),
                                  named_parameters=model.named_parameters(),
                                  compression="efsignsgd", exchange="two-phase")

The rules and their papers are :mod:`hvd_compress.core.adam`'s; these classes keep Adam's
state (``exp_avg``, ``exp_avg_sq``, 0/1 Adam's accumulated update ``u``) per parameter and
do the arithmetic with the core's functions on torch tensors.  Alone (not wrapped) they are
a single worker's optimizer; wrapped by :func:`~.distributed.DistributedOptimizer` they
exchange what their rule says: dense gradients (warm-up, variance steps) through a plain
average, the momentum (1-bit Adam), gradients (0/1 Adam between variance steps) and the
accumulated updates (0/1 Adam's syncs) through the optimizer's compression and exchange
(``"two-phase"`` keeps the bytes per worker constant in the workers, as DeepSpeed's
compressed allreduce does), error feedback on both sides.  The wrapper's gradient hooks
stay off: every exchange happens in ``step()``.
"""

from __future__ import annotations

import torch

from ..core import adam as rule
from .backend import TorchBackend
from .compressors import emptied_state

__all__ = ["OneBitAdam", "ZeroOneAdam"]

_B = TorchBackend()


class _Alone:
    """The exchanges of a single worker: nothing to average."""

    def dense(self, src: dict) -> None:
        pass

    def compressed(self, src: dict) -> None:
        pass

    def restart_feedback(self) -> None:
        pass


class _CompressedAdam(torch.optim.Optimizer):
    """What 1-bit Adam and 0/1 Adam share: Adam's state, the hyper-parameters per group,
    and a step that runs :attr:`schedule`'s rule with an exchange (:meth:`rule_step`)."""

    #: the wrapper runs :meth:`rule_step` with its exchanges instead of averaging gradients
    hvd_compress_rule = True
    ALGORITHM = ""

    def __init__(self, params, lr, betas, eps, weight_decay, bias_correction, schedule):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay,
                                      bias_correction=bool(bias_correction)))
        self.schedule = schedule
        self.rule_steps = 0  # steps taken (the rule counts from 1)

    # -- the step ------------------------------------------------------------------------
    def step(self, closure=None):
        """One step of this worker alone (wrapped, the shell runs :meth:`rule_step`)."""
        return self.rule_step(closure, _Alone())

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]
                if p.requires_grad and p.numel() > 0]

    def _hyper(self, group) -> rule.AdamHyper:
        b1, b2 = group["betas"]
        return rule.AdamHyper(float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                              float(group["weight_decay"]), bool(group["bias_correction"]))

    def _state(self, p) -> dict:
        st = self.state[p]
        if not st:
            for key in self.STATE:  # every key from the start: ranks' states look alike
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if "u" in self.STATE:
                st["lrs"] = 0.0
        return st

    #: the per-parameter tensors (zeros at first)
    STATE = ("exp_avg", "exp_avg_sq")

    def rule_init(self, closure=None):
        """Make every parameter's state without a step: what Horovod's
        ``broadcast_optimizer_state`` steps a fresh optimizer for (a rule step there would
        count, and move the freeze one step early)."""
        for p in self._params():
            self._state(p)

    @staticmethod
    def _grad(p):
        if p.grad is None:  # another rank may have one: take part with zeros
            return torch.zeros_like(p)
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(p).__name__} gradients must be dense for 1-bit/0-1 Adam")
        return p.grad.detach()

    def rule_step(self, closure, exchange):
        """Take step ``t`` of the rule, exchanging through ``exchange`` (``dense(src)`` /
        ``compressed(src)``: average a dict parameter -> tensor in place;
        ``restart_feedback()``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rule_steps += 1
        t = self.rule_steps
        self.schedule.seek(t - 1)
        with torch.no_grad():
            self._take(t, self._kind(t), exchange)
        self.schedule.advance(t)
        return loss

    def _kind(self, t: int) -> str:
        raise NotImplementedError

    def _take(self, t: int, kind: str, exchange) -> None:
        params, hy = self._params(), self._hyper_of
        states = {p: self._state(p) for p in params}
        if kind == "variance":
            g = {p: self._grad(p).clone() for p in params}
            exchange.dense(g)
            for p in params:
                h, st = hy[p], states[p]
                st["exp_avg_sq"].copy_(rule.variance(st["exp_avg_sq"], g[p], h.beta2))
                st["exp_avg"].copy_(rule.moment(st["exp_avg"], g[p], h.beta1))
        elif kind == "compressed":
            g = {p: self._grad(p).clone() for p in params}
            exchange.compressed(g)
            for p in params:
                st = states[p]
                st["exp_avg"].copy_(rule.moment(st["exp_avg"], g[p], hy[p].beta1))
        else:  # the worker's own gradient into its momentum
            for p in params:
                st = states[p]
                st["exp_avg"].copy_(rule.moment(st["exp_avg"], self._grad(p),
                                                hy[p].beta1))
            if kind == "momentum":
                exchange.compressed({p: states[p]["exp_avg"] for p in params})
        k = self._variance_updates(t, kind)
        dens = {p: rule.denominator(_B, states[p]["exp_avg_sq"], hy[p], k)
                for p in params}
        for p in params:
            h, st = hy[p], states[p]
            d = rule.direction(p, st["exp_avg"], dens[p], h, t)
            p.copy_(p - d * h.lr)
            if kind == "local":
                st["u"].copy_(st["u"] - d * h.lr)
                st["lrs"] = st["lrs"] + h.lr
        if kind == "local" and self.schedule.syncs(t):
            self._sync(t, params, states, dens, hy, exchange)

    def _variance_updates(self, t: int, kind: str) -> int:
        raise NotImplementedError

    def _sync(self, t, params, states, dens, hy, exchange) -> None:
        raise NotImplementedError

    @property
    def _hyper_of(self) -> dict:
        """Parameter -> its group's :class:`~hvd_compress.core.adam.AdamHyper` (now: a
        scheduler may have changed ``lr``)."""
        return {p: self._hyper(g) for g in self.param_groups for p in g["params"]}

    # -- state ---------------------------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        sd["hvd_compress_rule"] = {"algorithm": self.ALGORITHM, "steps": self.rule_steps,
                                   "schedule": self.schedule.state_dict()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        mine = state_dict.pop("hvd_compress_rule", None)
        super().load_state_dict(state_dict)
        if mine is not None:
            if mine["algorithm"] != self.ALGORITHM:
                raise ValueError(f"checkpoint is of {mine['algorithm']!r}, this optimizer is "
                                 f"{self.ALGORITHM!r}")
            self.rule_steps = int(mine["steps"])
            self.schedule.load_state_dict(mine["schedule"])


class OneBitAdam(_CompressedAdam):
    """1-bit Adam (Tang et al., ICML 2021): Adam for ``freeze_step`` steps with dense
    gradients, then the variance frozen and the momentum sent compressed with error
    feedback (wrapped; :mod:`hvd_compress.core.adam`).  Arguments as
    ``torch.optim.AdamW``'s (``weight_decay`` decoupled); ``bias_correction=False`` is
    DeepSpeed's update."""

    ALGORITHM = "onebit-adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 freeze_step=100000, bias_correction=True):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction,
                         rule.OneBitSchedule(freeze_step))

    freeze_step = property(lambda self: self.schedule.freeze_step)

    def _kind(self, t):
        return "variance" if self.schedule.dense(t) else "momentum"

    def _variance_updates(self, t, kind):
        return self.schedule.variance_updates(t)


class ZeroOneAdam(_CompressedAdam):
    """0/1 Adam (Lu et al., ICLR 2023): the variance updated at doubling intervals (dense
    gradients there, compressed ones between) until ``var_freeze_step``, then local steps
    whose accumulated update is synced compressed at intervals doubling every
    ``local_step_scaler`` steps up to ``local_step_clipper`` (wrapped;
    :mod:`hvd_compress.core.adam`).  Defaults are DeepSpeed's."""

    ALGORITHM = "zeroone-adam"
    STATE = ("exp_avg", "exp_avg_sq", "u")  # u: the update accumulated since the last sync

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16, bias_correction=True):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction,
                         rule.ZeroOneSchedule(var_freeze_step, var_update_scaler,
                                              local_step_scaler, local_step_clipper))

    def _kind(self, t):
        return self.schedule.kind(t)

    def rule_step(self, closure, exchange):
        if self.schedule.entering_local(self.rule_steps + 1):
            exchange.restart_feedback()
        return super().rule_step(closure, exchange)

    def _variance_updates(self, t, kind):
        return self.schedule.var_updates + (kind == "variance")

    def _sync(self, t, params, states, dens, hy, exchange):
        """Back to the agreed point, the compressed average of the accumulated updates
        (in momentum units), the momentum they imply, and the step they make."""
        sent = {}
        for p in params:
            u = states[p]["u"]
            p.copy_(p - u)
            sent[p] = u * dens[p]
        exchange.compressed(sent)
        for p in params:
            st, h = states[p], hy[p]
            back = -1.0 / (st["lrs"] * rule.momentum_factor(h, t))
            st["exp_avg"].copy_(sent[p] * back)
            p.copy_(p + sent[p] / dens[p])
            st["u"].zero_()
            st["lrs"] = 0.0


class ShellExchange:
    """The exchanges of a wrapped :class:`OneBitAdam` / :class:`ZeroOneAdam`, through
    the optimizer's session, the tensors fused into one buffer: ``dense`` by a plain
    average, ``compressed`` by the optimizer's compression and exchange;
    ``restart_feedback`` empties the compressor's state (every residual, the owners'
    too).  A single worker exchanges nothing."""

    def __init__(self, opt, session, comp):
        self.opt, self.session, self.comp = opt, session, comp

    @classmethod
    def of(cls, opt, comp):
        """The exchange of shell ``opt`` if it wraps a 1-bit / 0-1 Adam, else None."""
        if not getattr(opt, "hvd_compress_rule", False):
            return None
        opt._path.own = True  # no gradient hooks; synchronize() does nothing
        return cls(opt, opt._session, comp)

    def step(self, closure):
        """The shell's ``step()``: the rule's step with these exchanges, then the account."""
        s = self.session
        if s.follow_world(self.comp) and s.communicates():
            s.ready_engine()  # at the first: the ranks agree, and take the root's step count
        self.opt.rule_steps = s.steps  # the rule counts the shell's steps, equal on every rank
        loss = self.opt.rule_step(closure, self)
        s.steps += 1
        s.close_step()
        return loss

    def dense(self, src: dict) -> None:
        if self.session.communicates():
            from ..core import build
            flat = rule.fuse(_B, list(src.values()))
            self.session.average_dense([flat], ["hvd_compress.adam.dense"],
                                       lambda: build("none", backend=_B))
            self._back(flat, src)

    def compressed(self, src: dict) -> None:
        """``src``'s average through the compression, as one fused buffer
        (:func:`~hvd_compress.core.adam.fuse`; a per-tensor policy sees one tensor,
        named :data:`~hvd_compress.core.adam.FUSED`)."""
        s = self.session
        if s.communicates():
            s.follow_world(self.comp)
            s.ready_engine()
            flat = rule.fuse(_B, list(src.values()))
            (avg,) = s.exchange([flat], [rule.FUSED], lambda x: (tuple(x.shape), "float32"))
            self._back(avg, src)

    @staticmethod
    def _back(flat, src: dict) -> None:
        for t, piece in zip(src.values(), rule.unfuse(_B, flat, list(src.values()))):
            t.copy_(piece)

    def restart_feedback(self) -> None:
        self.comp.load_state_dict(emptied_state(self.comp.state_dict()))



def check_rule_args(optimizer, op, gradient_predivide_factor, backward_passes_per_step,
                    local_sgd, delay, hvd) -> None:
    """What a wrapped 1-bit / 0-1 Adam cannot be combined with (its rule decides what
    travels, every step)."""
    name = type(optimizer).__name__
    if local_sgd or delay:
        raise ValueError(f"{name} takes its own local steps; local_sgd and delay do not apply")
    if backward_passes_per_step != 1:
        raise ValueError(f"{name} steps after every backward pass: backward_passes_per_step "
                         "must be 1 (accumulate gradients yourself)")
    if op != hvd.Average or gradient_predivide_factor != 1.0:
        raise ValueError(f"{name} averages: op must be Average, gradient_predivide_factor 1")


def adopt_rule(wrapped, optimizer) -> None:
    """The wrapped optimizer takes ``optimizer``'s schedule, steps and state (the wrapper
    is made from its parameter groups only)."""
    import copy
    wrapped.schedule = copy.deepcopy(optimizer.schedule)
    wrapped.rule_steps = optimizer.rule_steps
    wrapped.state.update(optimizer.state)
