"""Horovod's documented PyTorch patterns with our optimizer, next to Horovod's own.

Written from Horovod's documentation (gradient clipping with ``synchronize()``
and ``skip_synchronize()``; ``hvd.join()`` for uneven data), each under a real
``horovodrun -np 2`` launch under Gloo and under MPI (tests/workers/torch_patterns.py; the
allgather-payload join case under Gloo only).  The np 2 cases that succeed share one
launch per controller.
"""

import re

import numpy as np
import pytest

from tests.harness import LaunchError, run_horovod
from tests.launches import TORCH_GLOO, TORCH_GLOO3, TORCH_MPI
from tests.workers.reference import check_join, check_predivided

pytestmark = pytest.mark.multiprocess


CONTROLLERS = ["gloo", "mpi"]  # every pattern under both of Horovod's controllers
F, SPEC = 3.0, "threshold:tau=0.05"  # test_gradient_predivide_factor_is_horovods
# The np 2 patterns that succeed run in one launch per controller (tests.harness.run_many),
# one after another: launching costs seconds.
CASES = {"gloo": [("clipping", {}), ("join_uneven", {"spec": "none"}),
                  ("join_uneven", {"spec": "randomk:ratio=0.3"}), ("ops", {}),
                  ("predivide", {"factor": F, "spec": SPEC})],
         "mpi": [("clipping", {}), ("join_uneven", {"spec": "none"}), ("ops", {})]}


def _key(body, kwargs):
    return ":".join([body, *map(str, kwargs.values())])


_SHARED = {"gloo": TORCH_GLOO, "mpi": TORCH_MPI}  # (with other modules' np 2 bodies: tests.launches)
for _c, _cases in CASES.items():
    for _b, _kw in _cases:
        _SHARED[_c].add(__name__, _key(_b, _kw), f"tests.workers.torch_patterns:{_b}", _kw)


@pytest.fixture(scope="module")
def launched(request):
    """``launched(controller, body, **kwargs)``: the per-rank results of that case, from
    the controller's one launch."""
    return lambda controller, body, **kwargs: _SHARED[controller].results(request, _key(body, kwargs))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_clipping_between_synchronize_and_step_is_horovods(controller, launched):
    runs = launched(controller, "clipping")
    for rank in runs:
        assert len(rank["ours:none"]) == len(rank["horovod:None"]) == 4
        for ours, theirs in zip(rank["ours:none"], rank["horovod:None"]):
            assert ours["norm"] == theirs["norm"]  # bit for bit (docs/horovod.md: "as Horovod")
            assert ours["params"] == theirs["params"]
        assert sum(e["norm"] > 0.2 for e in rank["ours:none"]) >= 2  # clipping was active
        assert any(e["norm"] > 0.2 for e in rank["ours:topk:ratio=0.3"])
    assert runs[0]["ours:topk:ratio=0.3"] == runs[1]["ours:topk:ratio=0.3"]  # ranks agree


@pytest.mark.parametrize("spec, controller", [("none", "gloo"), ("randomk:ratio=0.3", "gloo"),
                                              ("none", "mpi")])
def test_join_with_uneven_batches(spec, controller, launched):
    """Allreduce payloads (none, the summable compressors): the ranks that joined add
    zeros, as in Horovod; with none the parameters are Horovod's."""
    runs = launched(controller, "join_uneven", spec=spec)
    for rank in runs:
        assert rank["ours"]["last"] == 0  # rank 0 ran the most batches: it joined last
        if spec == "none":
            assert rank["horovod"]["last"] == 0
            for a, b in zip(rank["ours"]["params"], rank["horovod"]["params"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    if spec != "none":
        check_join(spec, [r["ours"] for r in runs], _torch_sgd_momentum)


def _torch_sgd_momentum(params, grads, lr=0.1, momentum=0.5):
    """torch.optim.SGD(lr, momentum) over ``grads`` (per step, one list per parameter)."""
    params = [np.array(p, np.float32) for p in params]
    buf = None
    for g in grads:
        g = [np.array(x, np.float32) for x in g]
        buf = g if buf is None else [np.float32(momentum) * b + x for b, x in zip(buf, g)]
        params = [p - np.float32(lr) * b for p, b in zip(params, buf)]
    return params


def test_join_with_an_allgather_compressor_fails_fast():
    """Horovod 0.28.1 runs only allreduce while ranks have joined: an allgather payload
    (top-k) then stops its background loop on the joined rank.  The launch must end with
    an error, not hang (docs/horovod.md).  The cause named, not a time-out or any other
    failure: the joined rank's background loop stops inside ``hvd.join()`` and rank 0,
    waiting in the step's exchange, loses its peer."""
    with pytest.raises(LaunchError, match="exit code") as failure:
        run_horovod("tests.workers.torch_patterns:join_uneven", np=2, timeout=120,
                    kwargs={"spec": "topk:ratio=0.3"})
    text = str(failure.value)
    assert re.search(r"\[1\]<stderr>:.*\[1\]: Horovod background loop uncaught exception", text), \
        text[-3000:]
    ranks = dict(re.findall(r"---- rank(\d) traceback ----\n(.*?)(?=---- rank\d traceback|\Z)",
                            text, re.S))
    assert "hvd.join()" in ranks["1"] and "HorovodInternalError" in ranks["1"], text[-3000:]
    assert "opt.step()" in ranks["0"] and "HorovodInternalError" in ranks["0"], text[-3000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_ops_as_horovods(controller, launched):
    for rank in launched(controller, "ops"):
        for op in ("Sum", "Min"):
            for a, b in zip(rank[f"ours:{op}"], rank[f"horovod:{op}"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        assert rank["ours:Sum"] != rank["ours:Min"]
        assert "op must be Average or Sum" in rank["refused:Min"]
        assert "Adasum" in rank["refused:Adasum"]


# np 3: under Gloo in the launch other modules share (tests.launches), under MPI alone
TORCH_GLOO3.add(__name__, "process_set", "tests.workers.torch_patterns:process_set")


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_process_set(controller, request):
    runs = TORCH_GLOO3.results(request, "process_set") if controller == "gloo" else \
        run_horovod("tests.workers.torch_patterns:process_set", np=3, timeout=180,
                    controller=controller)
    for rank in runs[:2]:
        for a, b in zip(rank["ours:none"], rank["horovod:None"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert runs[0]["ours:none"] == runs[1]["ours:none"]
    assert runs[0]["ours:topk:ratio=0.3"] == runs[1]["ours:topk:ratio=0.3"]
    assert runs[2]["ours:none"] == runs[2]["horovod:None"]  # alone: its own gradients
    assert runs[2]["ours:none"] != runs[0]["ours:none"]


PREDIVIDE_REFUSAL = "gradient_predivide_factor not supported with op != Average"


def test_gradient_predivide_factor_is_horovods(launched):
    """``gradient_predivide_factor=f`` as Horovod applies it: with none the allreduce gets
    prescale 1/f and postscale f (Horovod's optimizer's parameters bit for bit, and f
    shows in those bits); with a compressor whose output does not scale with its input
    (threshold: +tau, -tau or 0) the gradients are divided by f before encoding and the
    average multiplied by f, so the result differs from f = 1's; op=Sum with f is
    refused, as Horovod refuses it."""
    f, spec = F, SPEC
    runs = launched("gloo", "predivide", factor=f, spec=spec)
    for rank in runs:
        assert rank[f"ours:none:{f}"]["params"] == rank[f"horovod:None:{f}"]["params"]
        assert rank[f"horovod:None:{f}"]["params"] != rank["horovod:None:1.0"]["params"]
        for key in ("refused:horovod:None", "refused:ours:none", f"refused:ours:{spec}"):
            assert rank[key] is not None and PREDIVIDE_REFUSAL in rank[key], (key, rank[key])
    scaled = check_predivided(spec, f, [r[f"ours:{spec}:{f}"] for r in runs])
    plain = check_predivided(spec, 1.0, [r[f"ours:{spec}:1.0"] for r in runs])
    assert max(np.abs(a - b).max() for a, b in zip(scaled[0].values(), plain[0].values())) > 0.01
