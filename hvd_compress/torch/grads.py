"""The PyTorch optimizer's gradients on their way out and back: the hooks that send a
group once its backward passes are in, what a parameter sends (zeros where it has no
gradient, dense where it must be) and where its average lands (decoded straight into
``p.grad`` where the shapes allow)."""

from __future__ import annotations

import torch

from .sparse import densify

__all__ = ["GradientPath", "gradient", "collect"]


class GradientPath:
    """One optimizer's gradients through its :class:`~hvd_compress.session.Session`.

    ``names``: parameter -> name; ``comp``: the optimizer's compression; ``dga``: set
    to a :class:`~.localsteps.DelayedAveraging` when gradients are averaged late (it
    keeps a copy of what is sent and tags the steps in flight); ``own``: set where the
    optimizer exchanges in its step (1-bit / 0-1 Adam, :mod:`.adam`): no hooks, and
    :meth:`synchronize` does nothing."""

    def __init__(self, session, names, comp, sparse_as_dense: bool):
        self.session, self.names, self.comp = session, names, comp
        self.sparse_as_dense, self.hooks, self.dga, self.own = sparse_as_dense, [], None, False

    def register_hooks(self, params) -> None:
        """Horovod's way: a parameter's hook fires once its gradient is accumulated, and
        the group goes out when every member has had all its passes (once only)."""
        if not self.hooks and not self.own:
            self.hooks = [p.register_post_accumulate_grad_hook(self._hook(p)) for p in params]

    def _hook(self, p):
        def hook(param):
            if not self.session.local_phase():
                group = self.session.ready(p)
                if group is not None:
                    self.launch(group)
        return hook

    def grad(self, p):
        """What ``p`` sends (:func:`gradient`)."""
        return gradient(p, self.names[p], self.comp, self.sparse_as_dense)

    def launch(self, group, src=None) -> None:
        """Encode and send ``group``'s gradients (or the tensors ``src`` maps them to)."""
        dga = self.dga
        grads = [self.grad(p) if src is None else src[p] for p in group]
        if dga is not None and src is None:
            grads = dga.keep(group, grads)
        self.session.send(group, grads, [self.names[p] for p in group],
                          dga.tag if dga is not None else "")

    def collect(self, pending, dest=None) -> None:
        """Finish ``pending``'s batches into the gradients (or ``dest``): :func:`collect`."""
        collect(self.session.engine, pending, self.session.stats, dest)

    def exchange_all(self, src) -> None:
        """Send the tensors in ``src`` (parameter -> tensor; each group's members there,
        in its order: all of them, or a Streaming DiLoCo fragment's) and leave their
        averages there (local SGD's parameter changes, DiLoCo's pseudo-gradients)."""
        s, pending = self.session, {}
        for group in s.groups:
            part = group if all(p in src for p in group) else tuple(p for p in group if p in src)
            if part:
                self.launch(part, src=src)
                pending[part] = s.pending.pop(part)
        self.collect(pending, dest=src)

    def synchronize(self) -> None:
        """Send the groups whose hooks did not fire and finish the step's exchange."""
        if self.session.exchanges() and not self.own:
            self.session.synchronize(self.launch, self.collect)


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
