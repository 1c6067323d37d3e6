"""Horovod's rules for an optimizer (0.28.1): naming and grouping its parameters, the
arguments it takes, its messages, and how its helper functions call an optimizer."""

from __future__ import annotations

import sys

import horovod.torch as hvd
import torch
from horovod.common.util import split_list

from ..localsteps import check_horovod_args

#: Horovod's warning for a second synchronize in one step, and its error for zero_grad()
#: while gradients are in flight (its words)
SYNCHRONIZED_TWICE = ("optimizer.step() called without optimizer.skip_synchronize() context "
                      "after optimizer.synchronize(). This can cause training slowdown. You may "
                      "want to consider using optimizer.skip_synchronize() context if you use "
                      "optimizer.synchronize() in your code.")
ZERO_GRAD_IN_FLIGHT = ("optimizer.zero_grad() was called after loss.backward() but before "
                       "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                       "can cause a race condition.")


def check_args(specs, op, gradient_predivide_factor, backward_passes_per_step, local_sgd,
               local_sgd_warmup_steps, delay, start_step) -> None:
    """The optimizer's argument checks (Horovod's and ours) over ``specs``: those known when
    it is made, and a per-tensor policy's chosen ones again once the parameters are named."""
    check_horovod_args(hvd, "hvd_compress.torch.DistributedOptimizer",
                       "horovod.torch.DistributedOptimizer", op, gradient_predivide_factor,
                       backward_passes_per_step, local_sgd, local_sgd_warmup_steps, delay, specs,
                       start_step)


def checked_names(param_groups, named_parameters):
    """``named_parameters`` as a list, checked as Horovod checks it (or made up)."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = {k for k in names if names.count(k) > 1}
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(sorted(dups))}")
    all_ids = {id(v) for g in param_groups for v in g["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return named_parameters


def make_groups(params, names, groups):
    """The collectives' groups, as Horovod forms them: one per parameter (``None``), the
    user's lists (the rest alone), or ``groups`` equal parts, in name order."""
    ordered = sorted(params, key=lambda p: names[p])
    if groups is None:
        return [(p,) for p in ordered]
    if isinstance(groups, list):
        seen, out = set(), []
        for lst in groups:
            for p in lst:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
            members = tuple(p for p in ordered if any(p is q for q in lst))
            if members:
                out.append(members)
        out += [(p,) for p in ordered if id(p) not in seen]
        return out
    if not groups > 0:
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    return [tuple(g) for g in split_list(ordered, groups) if g]


def called_by_broadcast_optimizer_state(frames: int = 6) -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` called ``step()`` (within
    ``frames`` frames: torch wraps an optimizer's ``step`` in hooks of its own).

    It fills an empty optimizer state by calling ``step()`` with zero gradients on
    the ranks that have none -- possibly not all ranks -- and expects a Horovod
    optimizer to take the wrapped optimizer's own step there, without any
    collective (it recognises its own class by module; ours by this check)."""
    frame = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return False
        if frame.f_code.co_name == "broadcast_optimizer_state" and \
                frame.f_globals.get("__name__") == "horovod.torch.functions":
            return True
        frame = frame.f_back
    return False


@torch.no_grad()
def state_init_step(param_groups, base_step, closure):
    """The step Horovod's ``broadcast_optimizer_state`` takes, with zero gradients, on the
    ranks that have no state, only to make it: local (``base_step``: the wrapped
    optimizer's own), and the parameters are put back as they were.  (Horovod's leaves
    that step's change: weight decay -- AdamW, ASGD, Muon -- moves those ranks'
    parameters after ``broadcast_parameters``, and the ranks train apart by it.)"""
    params = [p for g in param_groups for p in g["params"]]
    kept = [p.detach().clone() for p in params]
    try:
        return base_step(closure)
    finally:
        for p, k in zip(params, kept):
            p.copy_(k)
