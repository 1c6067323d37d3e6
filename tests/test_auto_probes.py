"""What ``exchange="auto"``'s probes are timed on (:mod:`hvd_compress.core.autoexchange`):
the size of the largest tensor, the user's place in a schedule, the shape the steps send."""

import numpy as np
import pytest

from hvd_compress.core import Exchange, build
from hvd_compress.core.twophase import TwoPhase
from tests.test_exchange_engine import Table
from tests.test_twophase import _on_ranks


def test_auto_probes_at_the_size_of_the_largest_tensor_it_is_told_of(monkeypatch):
    """The first exchange of a wrapper that sends as gradients are ready may hold a small
    tensor alone: ``measure(..., largest=)`` (the wrapper's largest tensor) sets the size
    the codecs and the end-to-end probes are timed at, the same on every rank."""
    from hvd_compress.core import autoexchange
    from hvd_compress.core.autoexchange import AutoChoice
    p, big = 4, 40_000
    timed_at, ran = [], []
    codec = autoexchange.codec_seconds

    def recording_codec(probe, B, like, largest, p=4, like_shape=None):
        timed_at.append((largest, like_shape))
        return codec(probe, B, like, largest, p, like_shape)
    monkeypatch.setattr(autoexchange, "codec_seconds", recording_codec)

    class Recording:
        def __init__(self, engine):
            self.engine = engine

        def run(self, xs, *args, **kwargs):
            ran.append(tuple(xs[0].shape))
            return self.engine.run(xs, *args, **kwargs)
    table = Table(p)

    def auto(r):
        comp = build("topk:ratio=0.1", rank=r, world_size=p)
        engines = {"flat": Exchange(comp, table.rank(r)), "two-phase": TwoPhase(comp, table.rank(r))}

        def make(key, probe):
            return Recording({"flat": Exchange, "two-phase": TwoPhase}[key](probe, table.rank(r)))
        choice = AutoChoice(p, 1, engines, table.rank(r), make_engine=make)
        choice.measure(comp, [np.ones((3, 2), np.float32)], ["small"], largest=lambda: (200, 200))
        return choice
    choices = _on_ranks(p, auto)
    assert timed_at == [(big, (200, 200))] * p
    assert ran and all(shape == (200, 200) for shape in ran)  # the tensor's own shape
    assert all(c.probed == choices[0].probed and c.probe_values == big for c in choices)


def test_probes_time_dgc_as_its_steps_run_it():
    """A fresh DGC is at warm-up epoch 0 (25% density at ratio 0.001) and sends vectors
    whole: the probes take the user's epoch and a matrix, so they time the 0.1% selection
    the steps run (a vector at epoch 0 timed a dense send)."""
    from hvd_compress.core.autoexchange import PROBE_COLS, probe_like, probe_shape
    from hvd_compress.core.backend import NUMPY
    from hvd_compress.core.registry import build
    pytest.importorskip("torch")
    from hvd_compress.core.policy import Policy
    from hvd_compress.torch import compressor
    from hvd_compress.torch.compressors import TorchPolicy
    user = compressor("dgc:ratio=0.001")
    assert user.epoch == 0
    user.set_epoch(4)
    policy = TorchPolicy(Policy("fc*=dgc:ratio=0.001;*=topk:ratio=0.01"))
    assert policy.epoch is None
    policy.set_epoch(3)
    assert policy.epoch == 3
    fresh = build("dgc:ratio=0.001", backend=NUMPY)
    probe = probe_like(build("dgc:ratio=0.001", backend=NUMPY), user)
    assert fresh.density(0) > 0.2 and probe.density(0) == pytest.approx(0.001)
    assert probe_like(build("topk:ratio=0.01", backend=NUMPY), user).spec == \
        build("topk:ratio=0.01", backend=NUMPY).spec  # no schedule: as built
    m = 1 << 16
    assert probe_shape(probe, m) == (m // PROBE_COLS, PROBE_COLS)
    assert probe_shape(build("topk:ratio=0.01", backend=NUMPY), m) == (m,)
    x = np.random.default_rng(0).standard_normal(probe_shape(probe, m)).astype(np.float32)
    enc = probe.encode(x, "w")
    assert enc.payload.nbytes < 0.01 * x.nbytes  # the selection, not the whole tensor


def test_probes_keep_the_largest_tensors_columns():
    """1-bit is column-wise (a column's mean a sign): the probes keep the largest tensor's
    trailing dimensions and cut its rows to the probe's size; a vector, or a row larger
    than the probe, falls back to a vector (a matrix for DGC)."""
    from hvd_compress.core.autoexchange import probe_shape, scaled_shape
    from hvd_compress.core.backend import NUMPY
    onebit, dgc = build("onebit", backend=NUMPY), build("dgc:ratio=0.001", backend=NUMPY)
    assert probe_shape(onebit, 1 << 20, (80_000, 256)) == (4096, 256)
    assert probe_shape(onebit, 1 << 12, (80_000, 256)) == (16, 256)
    assert probe_shape(onebit, 1 << 20, (64, 3, 3, 3)) == (64, 3, 3, 3)  # smaller: whole
    assert scaled_shape((10, 1 << 21), 1 << 20) is None
    assert probe_shape(onebit, 1 << 20, (10, 1 << 21)) == (1 << 20,)
    assert probe_shape(onebit, 1 << 20, (1 << 22,)) == (1 << 20,)
    assert probe_shape(dgc, 1 << 20, (1 << 22,)) == ((1 << 20) // 16, 16)
    assert probe_shape(dgc, 1 << 20, (80_000, 256)) == (4096, 256)
    # one list of candidates serves the codec probes and the end-to-end ones (which score a
    # shape by the exchanges it allows): the first of the best-scored is taken
    from hvd_compress.core.autoexchange import probe_shapes
    assert probe_shapes(1 << 20, (80_000, 256)) == [(4096, 256), (1 << 20,), (1 << 16, 16)]
    assert probe_shapes(1 << 20, (1 << 22,)) == [(1 << 20,), (1 << 16, 16)]
    assert probe_shape(onebit, 1 << 20, (80_000, 256), score=len) == (4096, 256)
    assert probe_shape(onebit, 1 << 20, (80_000, 256), score=lambda s: -len(s)) == (1 << 20,)
    # where no shape is split into chunks (DGC with dense=true sends every tensor whole),
    # the first candidate: a vector (it was the 16-column matrix; both time the dense path)
    dense = build("dgc:ratio=0.01,dense=true", backend=NUMPY)
    assert probe_shape(dense, 1 << 20) == (1 << 20,)
