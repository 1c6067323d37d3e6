"""The TF wrappers' own state (hvd_compress.tensorflow.wrapperstate) and the compressor's
state_dict: typed fields in variables, checkpointed with the compressor under the names
checkpoints have always had, loadable into a compressor that has not run yet."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from hvd_compress.tensorflow import TFPolicy, compressor  # noqa: E402
from hvd_compress.tensorflow.compressors import as_compression  # noqa: E402
from hvd_compress.tensorflow.wrapperstate import COUNTERS, wrapper_state  # noqa: E402


def _round_trip(comp, x, name="w"):
    """One exchange among one rank: every round's payload is its own sum."""
    enc = comp.encode(x, name)
    for _ in range(1, comp.rounds(enc.meta)):
        enc = comp.next_round(enc, enc.payload)
    return comp.aggregate(enc.payload if comp.core.summable else [enc.payload], enc)


def _grads(shape, n, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.standard_normal(shape).astype(np.float32)) for _ in range(n)]


@pytest.mark.parametrize("shape", [(40, 30), (3, 3, 8, 16)])
@pytest.mark.parametrize("spec", ["powersgd:rank=2", "powersgd:rank=2,warm_start=false",
                                  "topk:ratio=0.1", "dgc:ratio=0.05", "onebit"])
def test_a_fresh_compressor_loads_a_state_dict_and_continues_bit_for_bit(spec, shape):
    """load_state_dict into a compressor that has not run: every saved field comes back
    with its saved shape (PowerSGD's Q too), and the next steps equal the run's that
    continued (eagerly, and in a traced step)."""
    xs = _grads(shape, 6)
    a = compressor(spec)
    for x in xs[:3]:
        _round_trip(a, x)
    saved = a.state_dict()
    b = compressor(spec)
    b.load_state_dict(saved)
    got = b.state_dict()["tensors"]["w"]
    for key, value in saved["tensors"]["w"].items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=key)
    assert sorted(got) == sorted(saved["tensors"]["w"])
    for x in xs[3:5]:
        assert np.array_equal(_round_trip(a, x).numpy(), _round_trip(b, x).numpy())
    traced = tf.function(lambda x: _round_trip(b, x))
    assert np.array_equal(_round_trip(a, xs[5]).numpy(), traced(xs[5]).numpy())


def test_a_policys_step_loads_into_a_fresh_policy():
    first, second = as_compression("topk:ratio=0.1", 100, 3), as_compression("topk:ratio=0.1", 100, 3)
    assert isinstance(first, TFPolicy)
    wrapper_state(first).policy_steps.assign(2)
    second.load_state_dict(first.state_dict())
    assert second.state_dict()["step"] == 2
    assert int(wrapper_state(second).policy_steps.numpy()) == 2


def _old_layout(spec, xs):
    """A compressor with its state as the code before the wrapper state kept it: the
    tape's and optimizer's accumulators in its ``accumulators`` dict (a tensor's sum
    under its name, local SGD's anchor, DGA's rings under ``<name>/anchor``,
    ``/dga_local``, ``/dga_avg``) and the counters in its ``counters`` dict."""
    old = compressor(spec)
    for x in xs:
        _round_trip(old, x)
    like = xs[0]
    old.accumulators = {"w": tf.Variable(like * 2.0), "w/anchor": tf.Variable(like * 3.0),
                        "w/dga_local": tf.Variable(tf.stack([like, like * 4.0])),
                        "w/dga_avg": tf.Variable(tf.stack([like * 5.0, like]))}
    old.counters = {name: tf.Variable(tf.constant(7 + i, tf.int64))
                    for i, name in enumerate(COUNTERS)}
    return old


def _assert_state_is(comp, old, like):
    state = wrapper_state(comp)
    for i, name in enumerate(COUNTERS):
        assert int(getattr(state, name).numpy()) == 7 + i
    np.testing.assert_array_equal(state.sum("w", like).numpy(), old.accumulators["w"].numpy())
    np.testing.assert_array_equal(state.anchor("w", like).numpy(),
                                  old.accumulators["w/anchor"].numpy())
    local, avg = state.ring("w", like, 2)
    np.testing.assert_array_equal(local.numpy(), old.accumulators["w/dga_local"].numpy())
    np.testing.assert_array_equal(avg.numpy(), old.accumulators["w/dga_avg"].numpy())


def _use_every_field(comp, like):
    state = wrapper_state(comp)
    for name in COUNTERS:
        getattr(state, name).assign_add(1)
    state.sum("w", like).assign(like)
    state.anchor("w", like)
    state.ring("w", like, 2)


def test_a_checkpoint_of_the_old_layout_restores_into_the_wrapper_state(tmp_path):
    """A checkpoint saved with the accumulators and counters held by the compressor (the
    old layout) restores into the wrapper state: deferred, before the state exists, and
    at once into variables already made (every object matched); the compressor's own
    state continues bit for bit."""
    spec, xs = "topk:ratio=0.1", _grads((20, 10), 5, seed=1)
    old = _old_layout(spec, xs[:3])
    path = tf.train.Checkpoint(compressor=old).save(str(tmp_path / "old"))

    later = compressor(spec)  # restored before first use: the values wait for the variables
    tf.train.Checkpoint(compressor=later).restore(path)
    _assert_state_is(later, old, xs[0])
    for x in xs[3:]:
        assert np.array_equal(_round_trip(old, x).numpy(), _round_trip(later, x).numpy())

    made = compressor(spec)  # the wrapper state's variables made first
    _round_trip(made, xs[0])
    _use_every_field(made, xs[0])
    tf.train.Checkpoint(compressor=made).restore(path).assert_existing_objects_matched()
    _assert_state_is(made, old, xs[0])


def test_the_wrapper_state_checkpoints_under_the_old_names(tmp_path):
    """What a compressor with its wrapper state saves has the names and values of the old
    layout: checkpoints restore either way."""
    spec, xs = "topk:ratio=0.1", _grads((20, 10), 3, seed=2)
    old = _old_layout(spec, xs)
    new = compressor(spec)
    for x in xs:
        _round_trip(new, x)
    state = wrapper_state(new)
    for i, name in enumerate(COUNTERS):
        getattr(state, name).assign(7 + i)
    like = xs[0]
    state.sum("w", like).assign(like * 2.0)
    state.anchor("w", like).assign(like * 3.0)
    local, avg = state.ring("w", like, 2)
    local.assign(tf.stack([like, like * 4.0]))
    avg.assign(tf.stack([like * 5.0, like]))
    old_path = tf.train.Checkpoint(compressor=old).save(str(tmp_path / "old"))
    new_path = tf.train.Checkpoint(compressor=new).save(str(tmp_path / "new"))
    names = {n for n, _ in tf.train.list_variables(old_path)}
    assert names == {n for n, _ in tf.train.list_variables(new_path)}
    assert any("counters/policy_steps" in n for n in names)
    for name in names - {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"}:
        np.testing.assert_array_equal(tf.train.load_variable(new_path, name),
                                      tf.train.load_variable(old_path, name), err_msg=name)


def test_a_compressor_without_wrapper_state_checkpoints_as_before(tmp_path):
    """A compressor whose wrappers kept nothing (or that never ran in one) saves no
    counters or accumulators: a checkpoint of it matches a restore strictly."""
    comp = compressor("topk:ratio=0.1")
    _round_trip(comp, _grads((20, 10), 1)[0])
    wrapper_state(comp)  # looked up (as an exchange does), nothing made
    path = tf.train.Checkpoint(compressor=comp).save(str(tmp_path / "ckpt"))
    names = [n for n, _ in tf.train.list_variables(path)]
    assert not any("counters" in n or "accumulators" in n for n in names)
    again = compressor("topk:ratio=0.1")
    _round_trip(again, _grads((20, 10), 1)[0])
    tf.train.Checkpoint(compressor=again).restore(path).assert_existing_objects_matched()


def test_a_policy_over_a_given_compressor_keeps_its_state_with_that_compressor(tmp_path):
    """The wrapper state of a per-tensor policy made over a compressor object the user
    gave is that object's: a checkpoint of the object holds the policy's delayed-start
    counter and sums."""
    given = compressor("topk:ratio=0.1")
    policy = as_compression(given, 100, 2)
    assert isinstance(policy, TFPolicy) and wrapper_state(policy) is wrapper_state(given)
    wrapper_state(policy).policy_steps.assign(5)
    wrapper_state(policy).sum("w", tf.ones([3])).assign([1.0, 2.0, 3.0])
    path = tf.train.Checkpoint(c=given).save(str(tmp_path / "ckpt"))
    again = compressor("topk:ratio=0.1")
    tf.train.Checkpoint(c=again).restore(path)
    assert int(wrapper_state(again).policy_steps.numpy()) == 5
    np.testing.assert_array_equal(wrapper_state(again).sum("w", tf.ones([3])).numpy(), [1, 2, 3])
    own = as_compression("topk:ratio=0.1", 100, 2)  # no object given: the policy's own
    assert wrapper_state(own) is not wrapper_state(given)
    assert wrapper_state(own).policy_steps is not wrapper_state(given).policy_steps


def test_the_wrapper_state_is_made_outside_a_trace_and_kept_across_calls():
    """Variables first asked for inside tf.function are made once, eagerly; the traced
    step updates them on every call."""
    comp = compressor("topk:ratio=0.1")

    @tf.function
    def step(g):
        state = wrapper_state(comp)
        total = state.sum("w", g).assign_add(g)
        with tf.control_dependencies([total]):
            return state.passes.assign_add(1)

    for _ in range(3):
        step(tf.ones([4]))
    state = wrapper_state(comp)
    assert int(state.passes.numpy()) == 3
    np.testing.assert_array_equal(state.sum("w", tf.ones([4])).numpy(), np.full(4, 3.0))
    assert step.experimental_get_tracing_count() <= 2
    with pytest.raises(KeyError, match="no wrapper counter"):
        state.set_counts({"bogus": 1})
