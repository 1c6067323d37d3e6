"""The two-phase exchange's chunk paths (:mod:`hvd_compress.accel.host_chunks`): a tensor's
chunks encoded, an owner's payloads summed and the owners' chunks decoded in one call each,
with the bits and the states of a call a chunk (numpy and torch; 1-bit and top-k), and the
per-chunk calls where the chunk path must not serve (a NaN, a restored checkpoint, large
chunks)."""

import numpy as np
import pytest

from hvd_compress.accel.host_chunks import MANY
from hvd_compress.accel.jit import SERIAL_BELOW
from hvd_compress.core import build, new_stats
from hvd_compress.core.base import Encoded, TensorMeta
from hvd_compress.core.twophase import TwoPhase, chunk_bounds, chunk_name, owner_of
from tests.test_exchange_engine import Table
from tests.test_twophase import _on_ranks

SHAPES = {"w": (40, 30), "b": (97,), "c": (5, 4, 3, 2)}
#: the codecs with a chunk path (top-k: its owners are top-k too)
SPECS = ["onebit", "topk:ratio=0.1"]
#: DGC's: chunks sampled ("w": 400 values or fewer a chunk, the threshold from 20 of them)
#: and selected exactly ("c": 15 to 40), in its warm-up, after it, with Nesterov and without
#: masking
DGC_SPECS = ["dgc:ratio=0.1", "dgc:ratio=0.1,warmup_epochs=0",
             "dgc:ratio=0.05,warmup_epochs=0,nesterov=true,masking=false"]


def _grads(r, step, nan_at=None, ties=False):
    """Rank ``r``'s gradients at ``step``; with ``ties``, whole numbers (many equal
    magnitudes, zeros, -0)."""
    rng = np.random.default_rng([r, step, 5])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    if ties:
        out = [np.round(x) for x in out]
    if nan_at == (r, step):
        out[0][3, 7] = np.nan
    return out


def _same_bits(x, y, msg=""):
    """Equal arrays, and equal bits where nothing is NaN (+0 and -0 told apart)."""
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_array_equal(x, y, err_msg=msg)
    if not np.isnan(x).any():
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=msg)


def _run(spec, p, steps, chunked, monkeypatch, nan_at=None, restore_after=None, outs=False,
         ties=False):
    """``steps`` steps of ``spec``'s two-phase exchange on ``p`` simulated ranks (the chunk
    path on or off); with ``restore_after``, every rank's compressor is rebuilt from its
    checkpoint after that step.  The results, the compressors and the accounts."""
    with monkeypatch.context() as m:
        if not chunked:
            m.setattr(TwoPhase, "_path", staticmethod(lambda *args: None))
        table = Table(p)
        comps = [build(spec, rank=r, world_size=p) for r in range(p)]
        engines = [TwoPhase(c, table.rank(r)) for r, c in enumerate(comps)]
        stats = [new_stats() for _ in range(p)]
        results = []
        for step in range(steps):
            g = [_grads(r, step, nan_at, ties) for r in range(p)]

            def one(r):
                into = [np.zeros_like(x) for x in g[r]] if outs else None
                return engines[r].run(g[r], list(SHAPES), stats[r], tag=f".{step}", outs=into)
            results.append(_on_ranks(p, one))
            if step == restore_after:
                for r in range(p):
                    saved = comps[r].state_dict()
                    comps[r] = build(spec, rank=r, world_size=p)
                    comps[r].load_state_dict(saved)
                    engines[r].comp = comps[r]
    return results, comps, stats


def _same_state(a, b):
    """Every chunk's residual (DGC: ``u`` and ``v``) and step, the workers' and the owners',
    equal."""
    for one, other in ((a, b), (owner_of(a), owner_of(b))):
        assert sorted(one.states) == sorted(other.states)
        for key, st in one.states.items():
            assert st.step == other.states[key].step, key
            for field in ("residual", "u", "v"):
                if getattr(st, field, None) is not None:
                    _same_bits(getattr(st, field), getattr(other.states[key], field), key)


@pytest.mark.parametrize("case", [dict(p=3), dict(p=8), dict(p=4, outs=True),
                                  dict(p=4, nan_at=(2, 1)), dict(p=3, restore_after=1),
                                  dict(p=4, ties=True)],
                         ids=["p3", "p8", "into-buffers", "nan", "checkpoint", "ties"])
@pytest.mark.parametrize("spec", SPECS + DGC_SPECS)
def test_the_chunk_path_gives_the_per_chunk_calls_bits_and_states(spec, case, monkeypatch):
    got, comps, stats = _run(spec, steps=3, chunked=True, monkeypatch=monkeypatch, **case)
    want, loop_comps, loop_stats = _run(spec, steps=3, chunked=False, monkeypatch=monkeypatch,
                                        **case)
    for step_got, step_want in zip(got, want):
        for mine, theirs in zip(step_got, step_want):
            for x, y in zip(mine, theirs):
                _same_bits(x, y)
    for a, b in zip(comps, loop_comps):
        _same_state(a, b)
    for a, b in zip(stats, loop_stats):  # the account's bytes, as the per-chunk calls'
        assert [a[k] for k in ("bytes_sent", "wire_out", "wire_in")] == \
            [b[k] for k in ("bytes_sent", "wire_out", "wire_in")]
    p = case["p"]
    # one call each where the per-chunk way makes p + 1 and 2 p (the NaN step: its way);
    # DGC sends its vector "b" whole, by the allgather (an encode, p decodes)
    whole, steps = int(spec.startswith("dgc")), 3
    tensors = len(SHAPES) - whole
    assert loop_stats[0].encode_calls == steps * (tensors * (p + 1) + whole)
    assert loop_stats[0].decode_calls == steps * (tensors * 2 * p + whole * p)
    assert stats[0].encode_calls < loop_stats[0].encode_calls
    if "nan_at" not in case:
        assert (stats[0].encode_calls, stats[0].decode_calls) == \
            (steps * (2 * tensors + whole), steps * (2 * tensors + whole * p))
    if "nan_at" in case:  # (and the NaN reached the result, as the per-chunk way has it)
        assert np.isnan(np.asarray(got[1][0][0])).any()


@pytest.mark.parametrize("spec", SPECS)
def test_few_large_chunks_take_a_call_each(spec):
    """Few chunks of SERIAL_BELOW values or more: the per-chunk kernels' threads are worth
    their call, so the chunk path does not serve; MANY chunks (a thread each) it does.
    Nor does it serve without error feedback, or for another class (exactly)."""
    comp = build(spec, world_size=2)
    like = np.zeros(1, np.float32)
    assert TwoPhase._path(comp, like, chunk_bounds(2 * SERIAL_BELOW - 2, 2)) is not None
    assert TwoPhase._path(comp, like, chunk_bounds(2 * SERIAL_BELOW, 2)) is None
    assert TwoPhase._path(comp, like, chunk_bounds(MANY * SERIAL_BELOW, MANY)) is not None
    no_ef = spec + ("," if ":" in spec else ":") + "ef=0"
    assert TwoPhase._path(build(no_ef, world_size=2), like, chunk_bounds(64, 2)) is None
    others = ["efsignsgd"] if spec == "onebit" else \
        ["topk:ratio=0.1+qsgd:levels=4", "randomk:ratio=0.1", "dgc:ratio=0.1,clip_norm=1",
         "dgc:ratio=0.1+terngrad"]
    for other in others:
        assert TwoPhase._path(build(other, world_size=2), like, chunk_bounds(64, 2)) is None, other
    assert TwoPhase._path(build("dgc:ratio=0.1", world_size=2), like, chunk_bounds(64, 2))
    if spec != "onebit":  # a subclass of top-k computes something else: its own calls
        sub = type("MyTopK", (type(comp),), {})(comp.params, world_size=2)
        assert TwoPhase._path(sub, like, chunk_bounds(64, 2)) is None


@pytest.mark.parametrize("spec", SPECS)
def test_torch_tensors_take_the_same_chunk_path(spec):
    """CPU torch tensors: the chunk path's payloads equal the per-chunk torch encodes and
    the numpy chunk path's, byte for byte, and so do the owner's sum and the decode."""
    torch = pytest.importorskip("torch")
    from hvd_compress.torch.backend import TorchBackend
    TB = TorchBackend()
    n, p = 1000, 8
    bounds = chunk_bounds(n, p)
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    comps = {"torch": build(spec, backend=TB, world_size=p),
             "numpy": build(spec, world_size=p),
             "loop": build(spec, backend=TB, world_size=p)}
    metas = [TensorMeta(chunk_name("v", j, p), (b - a,), "float32") for j, (a, b) in enumerate(bounds)]
    got = {}
    for step in range(2):
        for key, comp in comps.items():
            v = torch.from_numpy(x * (step + 1)) if key != "numpy" else x * (step + 1)
            if key == "loop":
                encs = [comp.encode(v[a:b], m.name) for (a, b), m in zip(bounds, metas)]
            else:
                path = TwoPhase._path(comp, v, bounds)
                assert path is not None, key
                encs = path.encode(comp, v, "v", bounds, metas)
            got[key] = np.concatenate([np.asarray(e.payload) for e in encs])
        np.testing.assert_array_equal(got["torch"], got["loop"])
        np.testing.assert_array_equal(got["numpy"], got["loop"])
    for key in ("torch", "numpy"):  # (and the chunks' states are the per-chunk calls')
        for m in metas:
            mine, theirs = comps[key].states[m.name], comps["loop"].states[m.name]
            assert mine.step == theirs.step == 2
            np.testing.assert_array_equal(np.asarray(mine.residual), np.asarray(theirs.residual))
    # an owner's sum of p payloads, and every owner's chunk decoded
    buf = torch.from_numpy(got["torch"])
    torch_path = TwoPhase._path(comps["torch"], buf, bounds)
    if spec == "onebit":
        sizes = [8 + (b - a + 7) // 8 for a, b in bounds]
    else:  # k = ceil(ratio m) int32 indices, then k float32 values
        sizes = [8 * -(-(b - a) // 10) for a, b in bounds]
    assert list(torch_path.payload_sizes([b - a for a, b in bounds])) == sizes
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(n, np.float32)
    torch_path.decode_into(buf, offs, np.diff([a for a, _ in bounds] + [n]), out, 0.25)
    loop = comps["loop"]
    want = np.concatenate([np.asarray(loop.decode(buf[a:a + s], m)).reshape(-1) * np.float32(0.25)
                           for a, s, m in zip(offs, sizes, metas)])
    np.testing.assert_array_equal(out, want)
    # p copies of chunk 0's payload, as if from p senders, summed in rank order
    total = torch_path.aggregate(loop, buf, [0] * p, metas[0])
    first = Encoded(buf[:sizes[0]], metas[0], sizes[0])
    np.testing.assert_array_equal(np.asarray(total),
                                  np.asarray(loop.aggregate([first.payload] * p, first)))


@pytest.mark.parametrize("n, p, kind", [(40000, 2, "ties"), (40000, 2, "equal"),
                                        (MANY * (SERIAL_BELOW + 7), MANY, "normal")],
                         ids=["binned-ties", "all-equal", "many-large"])
def test_top_k_chunks_of_many_values_and_ties(n, p, kind):
    """Chunks large enough for the kernel's binned k-th largest (and, MANY of them, for the
    per-chunk calls' own fused selection): payloads, residuals and steps as the per-chunk
    calls make them, bit for bit, with many equal magnitudes, zeros and -0; the owner's sum
    and the decode too."""
    spec = "topk:ratio=0.05"
    bounds = chunk_bounds(n, p)
    metas = [TensorMeta(chunk_name("v", j, p), (b - a,), "float32") for j, (a, b) in enumerate(bounds)]
    path_comp, loop = build(spec, world_size=p), build(spec, world_size=p)
    rng = np.random.default_rng(11)
    for step in range(2):
        x = rng.standard_normal(n).astype(np.float32)
        if kind == "ties":  # whole numbers: few magnitudes, many zeros and -0
            x = np.round(x * 2)
        elif kind == "equal":  # the first chunk one value throughout, the second 0 and -0
            x[:bounds[0][1]] = np.float32(0.75)
            x[bounds[1][0]:] = np.where(x[bounds[1][0]:] > 0, np.float32(0), np.float32(-0.0))
        path = TwoPhase._path(path_comp, x, bounds)
        assert path is not None
        encs = path.encode(path_comp, x.copy(), "v", bounds, metas)
        want = [loop.encode(x[a:b].copy(), m.name) for (a, b), m in zip(bounds, metas)]
        for e, w, m in zip(encs, want, metas):
            np.testing.assert_array_equal(np.asarray(e.payload), np.asarray(w.payload), err_msg=m.name)
            assert e.nbytes == w.nbytes
            mine, theirs = path_comp.states[m.name], loop.states[m.name]
            assert mine.step == theirs.step == step + 1
            _same_bits(mine.residual, theirs.residual, m.name)
    buf = np.concatenate([np.asarray(e.payload) for e in encs])
    sizes = [e.nbytes for e in encs]
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(n, np.float32)
    path.decode_into(buf, offs, np.diff([a for a, _ in bounds] + [n]), out, 0.5)
    _same_bits(out, np.concatenate([loop.decode(w.payload, m) * np.float32(0.5)
                                    for w, m in zip(want, metas)]))
    # chunk 0's payload from every chunk's sender, as an owner receives p of them
    first = Encoded(want[0].payload, metas[0], sizes[0])
    total = path.aggregate(loop, np.concatenate([np.asarray(want[0].payload)] * p),
                           [sizes[0] * q for q in range(p)], metas[0])
    _same_bits(total, loop.aggregate([want[0].payload] * p, first))


@pytest.mark.parametrize("chunked", [True, False], ids=["chunk-path", "a-call-a-chunk"])
def test_auto_prices_the_chunk_paths_calls(chunked, monkeypatch):
    """``exchange="auto"`` prices a two-phase tensor whose chunks the chunk path takes at 2
    encodes and 2 decodes, not ``p + 1`` and ``2 p``: with codec calls the only cost, at
    64 workers two-phase wins by the chunk path (4 calls against the allgather's 65) and
    loses without it (193 calls)."""
    from hvd_compress.core.autoexchange import AutoChoice
    from hvd_compress.core.exchangecost import TWO_PHASE, Links
    if not chunked:
        monkeypatch.setattr(TwoPhase, "_path", staticmethod(lambda *args: None))
    p, shape, call = 64, (640, 16), 1e-3
    comp = build("topk:ratio=0.01", rank=0, world_size=p)
    choice = AutoChoice(p, 1, {"flat", "two-phase"}, None, links=Links(0.0, 0.0))
    choice.rates[str(comp.spec)] = (0.0, 0.0, call, call)  # seconds per value, per call
    got = choice.choose("w", shape, comp)
    calls = 4 if chunked else (p + 1) + 2 * p
    assert got.costs[TWO_PHASE] == pytest.approx(calls * call)
    assert got.costs["allgather"] == pytest.approx((1 + p) * call)
    assert got.exchange == (TWO_PHASE if chunked else "allgather"), got.reason


def test_torch_tensors_take_dgcs_chunk_path():
    """DGC's chunk path on CPU torch tensors: the payloads and the chunks' ``u`` and ``v``
    of the per-chunk torch encodes and of the numpy chunk path, over the warm-up and after:
    chunks of 625 values (7, then 20, sampled) and of 12 (5 sampled, then exact)."""
    torch = pytest.importorskip("torch")
    from hvd_compress.core.layout import column_shape
    from hvd_compress.torch.backend import TorchBackend
    TB = TorchBackend()
    spec = "dgc:ratio=0.1,warmup_epochs=2,steps_per_epoch=1"
    for n, p in ((5000, 8), (96, 8)):
        bounds = chunk_bounds(n, p)
        comps = {"torch": build(spec, backend=TB, world_size=p), "numpy": build(spec, world_size=p),
                 "loop": build(spec, backend=TB, world_size=p)}
        metas = [TensorMeta(chunk_name("w", j, p), column_shape(b - a), "float32")
                 for j, (a, b) in enumerate(bounds)]
        for step in range(4):
            x = np.random.default_rng([n, step]).standard_normal(n).astype(np.float32)
            got = {}
            for key, comp in comps.items():
                v = torch.from_numpy(x.copy()) if key != "numpy" else x.copy()
                if key == "loop":
                    encs = [comp.encode(v[a:b].reshape(m.shape), m.name)
                            for (a, b), m in zip(bounds, metas)]
                else:
                    encs = TwoPhase._path(comp, v, bounds).encode(comp, v, "w", bounds, metas)
                    assert encs is not None, key
                got[key] = np.concatenate([np.asarray(e.payload) for e in encs])
            np.testing.assert_array_equal(got["torch"], got["loop"], err_msg=f"{n} {step}")
            np.testing.assert_array_equal(got["numpy"], got["loop"], err_msg=f"{n} {step}")
        for key in ("torch", "numpy"):
            for m in metas:
                mine, theirs = comps[key].states[m.name], comps["loop"].states[m.name]
                assert mine.step == theirs.step == 4
                for field in ("u", "v"):
                    np.testing.assert_array_equal(np.asarray(getattr(mine, field)),
                                                  np.asarray(getattr(theirs, field)))
