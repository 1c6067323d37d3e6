"""The PyTorch optimizer's gradients on their way out and back: what a parameter sends
(zeros where it has no gradient, dense where it must be) and where its average lands
(decoded straight into ``p.grad`` where the shapes allow)."""

from __future__ import annotations

import torch

from .sparse import densify

__all__ = ["gradient", "collect"]


def gradient(p, name: str, comp, sparse_as_dense: bool):
    """What parameter ``p`` (named ``name``) sends with compression ``comp``."""
    if p.grad is None:
        # Another rank may have a gradient for it (dynamic graphs): take part with zeros.
        p.grad = torch.zeros_like(p)
    grad = p.grad
    passthrough = comp.passthrough_for(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
    if grad.is_sparse and (sparse_as_dense or not passthrough):  # see .sparse
        grad = densify(grad, name, not passthrough)
    return grad  # (a sparse p.grad gets the average back sparse, as in Horovod)


def collect(engine, pending, stats, dest=None) -> None:
    """Finish the batches in ``pending`` (group -> Batch) and leave each parameter's
    average in ``p.grad`` (or in ``dest[p]``), decoded straight into it where it can."""
    groups = list(pending)
    targets = [[p.grad if dest is None else dest[p] for p in g] for g in groups]
    outs = [[t if t is not None and not t.is_sparse and t.dtype == p.dtype
             and t.shape == p.shape else None for p, t in zip(g, ts)]
            for g, ts in zip(groups, targets)]
    results = engine.receive([pending[g] for g in groups], stats, outs)
    for group, res, ts in zip(groups, results, targets):
        for p, result, target in zip(group, res, ts):
            if result is not target:
                if dest is None:
                    _set_grad(p, result)
                else:
                    target.copy_(result)


def _set_grad(p, result):
    result = result.to(p.dtype)
    if p.grad is None:
        p.grad = result
    elif p.grad.is_sparse:
        p.grad.zero_().add_(result.to_sparse())
    else:
        p.grad.copy_(result)
