"""Horovod's documented TensorFlow patterns with our tape and Keras optimizer, under Gloo
and under MPI (tests/workers/tf_patterns.py; the np 2 bodies share one launch per
controller, the np 3 process-set body has its own):

* Horovod's Keras callbacks, for Keras 3 (hvd_compress.tensorflow.keras.callbacks), with
  our Keras optimizer under ``horovodrun -np 2 --gloo``; each checked against what
  Horovod's documentation says it does (Horovod 0.28.1's own fail on Keras 3);
* ``process_set=`` (np 3, ranks 0 and 1 in the set), next to Horovod's tape;
* ``hvd.broadcast_variables`` after the first step (Horovod's TF2 custom loop), next to
  Horovod's tape, and the resume case (one rank restores a compressor's state)."""

import numpy as np
import pytest

from tests.harness import run_horovod
from tests.launches import TF_GLOO, TF_GLOO3, TF_MPI
from tests.workers.reference import check_join, check_predivided

pytestmark = pytest.mark.multiprocess

F, SPEC = 3.0, "threshold:tau=0.05"  # test_gradient_predivide_factor_is_horovods
# The np 2 bodies run in one launch per controller, one after another, with other modules'
# np 2 bodies (tests.launches): launching and importing TensorFlow cost seconds.
NP2 = {"gloo": [("keras_callbacks", {}), ("broadcast_variables", {}), ("join_uneven", {}),
                ("predivide", {"factor": F, "spec": SPEC})],
       "mpi": [("keras_callbacks", {}), ("broadcast_variables", {}), ("join_uneven", {})]}


_SHARED = {"gloo": TF_GLOO, "mpi": TF_MPI}
for _c, _cases in NP2.items():
    for _b, _kw in _cases:
        _SHARED[_c].add(__name__, _b, f"tests.workers.tf_patterns:{_b}", _kw)


@pytest.fixture(scope="module")
def np2(request):
    """``np2(controller, body)``: that body's per-rank results from the controller's one
    np 2 launch."""
    return lambda controller, body: _SHARED[controller].results(request, body)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def runs(request, np2):
    return np2(request.param, "keras_callbacks")


def test_broadcast_gives_every_rank_roots_weights_and_keeps_residuals_local(runs):
    a, b = runs[0]["broadcast"], runs[1]["broadcast"]
    assert a["weights"] == b["weights"]
    assert runs[0]["no broadcast"]["weights"] != runs[1]["no broadcast"]["weights"]
    assert a["residuals"] and a["residuals"] != b["residuals"]  # each rank's own


def test_metric_average(runs):
    a, b = runs[0]["metric"]["loss"], runs[1]["metric"]["loss"]
    np.testing.assert_allclose(a, b, rtol=1e-6)
    plain = [r["no broadcast"]["loss"] for r in runs]
    assert plain[0] != plain[1]


def test_learning_rate_warmup_follows_goyal(runs):
    size, spe, lr0, warm = 2, 4, 0.1, 2
    want = []
    for epoch in range(3):
        for b in range(spe):
            if epoch < warm:
                e = epoch + b / spe + 1 / spe
                want.append(lr0 / size * (e * (size - 1) / warm + 1))
            else:
                want.append(want[-1])
    for rank in runs:
        np.testing.assert_allclose(rank["warmup"]["lr"], want, rtol=1e-6)
        assert rank["warmup"]["lr"][2 * spe - 1] == pytest.approx(lr0)


def test_learning_rate_schedule_staircase(runs):
    for rank in runs:
        np.testing.assert_allclose(rank["schedule"]["lr"], [0.1] * 4 + [0.1] * 4 + [0.05] * 4,
                                   rtol=1e-6)


# -- process sets (np 3, ranks 0 and 1 in the set) ---------------------------------------------
# under Gloo in the np 3 launch other modules share (tests.launches), under MPI alone
TF_GLOO3.add(__name__, "process_set", "tests.workers.tf_patterns:process_set")


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def process_set_runs(request):
    if request.param == "gloo":
        return TF_GLOO3.results(request, "process_set")
    return run_horovod("tests.workers.tf_patterns:process_set", np=3, timeout=600,
                       controller=request.param)


def test_process_set_tape_and_keras_average_within_the_set(process_set_runs):
    runs = process_set_runs
    for rank in runs[:2]:
        horovod = rank["tape:horovod:None"]["weights"]
        for run in ("tape:ours:none", "keras:none"):  # Horovod's tape's results, with none
            for a, b in zip(rank[run]["weights"], horovod):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        for run in ("tape:ours:topk:ratio=0.3", "tape:ours:powersgd:rank=1",
                    "keras:topk:ratio=0.3"):
            assert runs[0][run]["weights"] == runs[1][run]["weights"]  # the set agrees
        # the compressor counts the set's ranks, not the world's (PowerSGD averages Q by it)
        for run in ("tape:ours:topk:ratio=0.3", "tape:ours:powersgd:rank=1", "keras:none",
                    "keras:topk:ratio=0.3"):
            assert rank[run]["bound"] == [rank["rank"], 2], run
    assert runs[0]["tape:ours:topk:ratio=0.3"]["weights"] != \
        runs[0]["tape:ours:none"]["weights"]  # (compressed: not the same as none)


def test_process_set_rank_outside_trains_on_its_own_gradients(process_set_runs):
    alone = process_set_runs[2]
    theirs = alone["tape:horovod:None"]["weights"]
    for run in ("tape:ours:none", "tape:ours:topk:ratio=0.3", "keras:none",
                "keras:topk:ratio=0.3"):
        for a, b in zip(alone[run]["weights"], theirs):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert theirs != process_set_runs[0]["tape:horovod:None"]["weights"]


# -- hvd.broadcast_variables after the first step (Horovod's TF2 custom loop) -----------------
@pytest.fixture(scope="module", params=["gloo", "mpi"])
def broadcast_runs(request, np2):
    return np2(request.param, "broadcast_variables")


def test_broadcast_variables_with_the_tape_is_horovods(broadcast_runs):
    a, b = broadcast_runs
    # Horovod 0.28.1 assigns inside a tf.function, where Keras 3 variables are tensors:
    # it takes the tf.Variables under them (``v.value``)
    assert "has no attribute 'assign'" in a["keras_variables_error"]
    for rank in (a, b):
        for x, y in zip(rank["ours:none"]["weights"], rank["horovod:None"]["weights"]):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    for run in ("horovod:None", "ours:none", "ours:topk:ratio=0.3", "ours:randomk:ratio=0.3"):
        assert a[run]["weights"] == b[run]["weights"], run  # one model after the broadcast


def test_broadcast_leaves_residuals_per_rank_and_step_counters_equal(broadcast_runs):
    a, b = broadcast_runs
    for run in ("ours:topk:ratio=0.3", "ours:randomk:ratio=0.3"):
        assert a[run]["steps"] == b[run]["steps"] == [3, 3], run
        assert a[run]["residuals"] != b[run]["residuals"], run  # each rank's own


def test_resume_on_one_rank_needs_broadcast_compression_state(broadcast_runs):
    a, b = broadcast_runs
    # rank 0 restored 2 steps of random-k state, rank 1 started afresh
    assert a["resume:sync=False"]["steps"] == [3, 3] and b["resume:sync=False"]["steps"] == [1, 1]
    assert a["resume:sync=False"]["grads"] != b["resume:sync=False"]["grads"]  # other indices
    # with broadcast_compression_state: rank 0's counters, the same indices, one average
    assert a["resume:sync=True"]["steps"] == b["resume:sync=True"]["steps"] == [3, 3]
    assert a["resume:sync=True"]["grads"] == b["resume:sync=True"]["grads"]
    assert a["resume:sync=True"]["residuals"] != b["resume:sync=True"]["residuals"]


# -- hvd.join() for uneven data (TF2 custom loop) ----------------------------------------------
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_join_with_uneven_batches_is_horovods(controller, np2):
    """Rank 1 runs one step fewer and joins; rank 0's last exchange completes with rank 1
    adding zeros, as with Horovod's tape (summed payloads only: see docs/horovod.md)."""
    runs = np2(controller, "join_uneven")
    for rank in runs:
        assert rank["horovod:None"]["last"] == rank["ours:none"]["last"] == 0
        for a, b in zip(rank["ours:none"]["weights"], rank["horovod:None"]["weights"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # rank 0's extra step moved its weights; rank 1 stopped a step earlier
    assert runs[0]["ours:none"]["weights"] != runs[1]["ours:none"]["weights"]
    assert runs[0]["ours:randomk:ratio=0.3"]["last"] == 0
    # Random-k: each step's average is the numpy reference (rank 1 adding zeros once
    # joined), and the weights are plain SGD over those averages
    check_join("randomk:ratio=0.3", [r["ours:randomk:ratio=0.3"] for r in runs], _sgd,
               key="weights")


def _sgd(weights, grads, lr=0.1):
    """keras.optimizers.SGD(lr) over ``grads`` (per step, one array per variable)."""
    weights = [np.array(w, np.float32) for w in weights]
    for g in grads:
        weights = [w - np.float32(lr) * np.ravel(x) for w, x in zip(weights, g)]
    return weights


PREDIVIDE_REFUSAL = "gradient_predivide_factor not supported with op != Average"


def test_gradient_predivide_factor_is_horovods(np2):
    """``gradient_predivide_factor=f`` in our tape as in Horovod's: with none the
    allreduce gets prescale 1/f and postscale f (Horovod's tape's weights bit for bit,
    and f shows in those bits); with a compressor whose output does not scale with its
    input (threshold) the gradients are divided by f before encoding and the average
    multiplied by f, so the result differs from f = 1's; op=Sum with f is refused."""
    f, spec = F, SPEC
    runs = np2("gloo", "predivide")
    for rank in runs:
        assert rank[f"ours:none:{f}"]["weights"] == rank[f"horovod:None:{f}"]["weights"]
        assert rank[f"horovod:None:{f}"]["weights"] != rank["horovod:None:1.0"]["weights"]
        for key in ("refused:horovod:None", "refused:ours:none", f"refused:ours:{spec}"):
            assert rank[key] is not None and PREDIVIDE_REFUSAL in rank[key], (key, rank[key])
    scaled = check_predivided(spec, f, [r[f"ours:{spec}:{f}"] for r in runs])
    plain = check_predivided(spec, 1.0, [r[f"ours:{spec}:1.0"] for r in runs])
    assert max(np.abs(a - b).max() for a, b in zip(scaled[0].values(), plain[0].values())) > 0.01
