"""DiLoCo's syncs by hand in numpy (float32), every rank simulated: the reference of
tests/test_diloco.py.

The inputs are what each rank held after its own inner steps (the workers record it);
the reference keeps the anchors, the outer Nesterov buffers and every rank's
compressor (its error-feedback residuals) across syncs, and gives each synced
tensor's new value.  Its arithmetic is the engine's, spelled out again here: each
rank encodes its pseudo-gradient ``anchor - p_r``; the decoded payloads summed in
rank order, times ``1 / size``; then ``buf = mu * buf + g`` (``g`` at the first
sync), ``anchor - lr * (g + mu * buf)``, each operation rounded to float32.
"""

from __future__ import annotations

import numpy as np

from hvd_compress.core import build


def exchange_mean(comps, xs, name):
    """The engine's average of the ranks' ``xs`` (float32) through ``comps`` (one numpy
    compressor per rank): payloads summed (allreduce) or gathered, decoded, summed in
    rank order, times ``1 / size``."""
    size = len(xs)
    encs = [c.encode(x, name) for c, x in zip(comps, xs)]
    if comps[0].passthrough or comps[0].summable:
        total = encs[0].payload
        for e in encs[1:]:
            total = comps[0].reduce_pair(total, e.payload)
        got = comps[0].aggregate(total, encs[0])
    else:
        got = [c.aggregate([e.payload for e in encs], enc) for c, enc in zip(comps, encs)][0]
    return got * (1.0 / size)


class HandDiLoCo:
    """The anchors and outer buffers of a DiLoCo run (``first``: the parameters every
    rank starts from, by name), ``size`` ranks compressing with ``spec``.  ``outer_lr``
    None: local SGD's fragment-wise average (anchor + the mean change)."""

    def __init__(self, first, size, spec, outer_lr, momentum):
        self.anchor = {n: np.asarray(v, np.float32) for n, v in first.items()}
        self.buf = {}
        self.comps = [build(spec, rank=r, world_size=size) for r in range(size)]
        self.lr, self.mu = outer_lr, momentum

    def sync(self, inner, names) -> dict:
        """Sync the tensors ``names`` (in exchange order) given ``inner[r][name]``, every
        rank's values; returns their new values (the anchors)."""
        for name in names:
            ps = [np.asarray(rank[name], np.float32) for rank in inner]
            a = self.anchor[name]
            if self.lr is None:  # local SGD: the mean change since the last average
                self.anchor[name] = a + exchange_mean(self.comps, [p - a for p in ps], name)
                continue
            g = exchange_mean(self.comps, [a - p for p in ps], name)
            buf = g if name not in self.buf else self.buf[name] * np.float32(self.mu) + g
            self.buf[name] = buf
            self.anchor[name] = a - (g + buf * np.float32(self.mu)) * np.float32(self.lr)
        return {name: self.anchor[name] for name in names}
