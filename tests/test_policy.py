"""Per-tensor compression policy (issue 16): the rule, mappings, callables, the delayed
start, DGC's momentum on uncompressed tensors, and the plan both frameworks print."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hvd_compress import spec as specmod
from hvd_compress.core import policy as pm
from tests.launches import TF_GLOO, TORCH_GLOO


def test_mapping_text_is_told_from_a_spec():
    assert not pm.is_mapping_text("topk:ratio=0.01")
    assert not pm.is_mapping_text("none")
    assert not pm.is_mapping_text("topk:ratio=0.01+qsgd:levels=4")
    assert pm.is_mapping_text("fc*=topk:ratio=0.01")
    assert pm.is_mapping_text("*=none;")
    rules = pm.parse_text("*embedding*=topk:ratio=0.001; *=fp16")
    assert [(p, str(s)) for p, s in rules] == [
        ("*embedding*", str(specmod.parse("topk:ratio=0.001"))), ("*", "fp16")]
    for bad in ("=fp16", "fc*=", "fc*=nosuch", ";"):
        with pytest.raises(ValueError):
            pm.parse_text(bad)


def test_small_tensor_rule_and_first_match():
    p = pm.Policy({"fc1.*": "topk:ratio=0.1", "fc*": "onebit"}, min_numel=100)
    assert p.spec_for("fc1.weight", (24, 144), "float32").name == "topk"
    assert p.spec_for("fc2.weight", (5, 24), "float32").name == "onebit"  # 120 >= 100
    assert p.spec_for("fc2.bias", (5,), "float32").name == "none"        # 5 < 100
    assert p.spec_for("fc1.bias", (2000,), "float32").name == "topk"     # a large vector
    assert p.spec_for("conv.weight", (4, 1, 3, 3), "float32").name == "none"  # 36 < 100
    assert p.spec_for("other", (50, 50), "float32").name == "none"        # no pattern
    off = pm.Policy("topk:ratio=0.1", min_numel=0)
    assert off.uniform and off.spec_for("b", (5,), "float32").name == "topk"
    seen = []

    def choose(name, shape, dtype):
        seen.append((name, shape, dtype))
        return "qsgd:levels=4" if name.startswith("a") else None
    c = pm.Policy(choose, min_numel=10)
    assert c.spec_for("a", (4, 4), "float32").name == "qsgd"
    assert c.spec_for("b", (4, 4), "float32").name == "none"
    assert c.spec_for("a", (2, 2), "float32").name == "none"  # the rule runs first
    assert ("a", (4, 4), "float32") in seen
    with pytest.raises(ValueError, match="returned"):
        pm.Policy(lambda *a: "nosuch", min_numel=0).spec_for("x", (4, 4), "float32")
    for bad in ({"min_numel": -1}, {"start_step": -2}, {"min_numel": 1.5}):
        with pytest.raises(ValueError):
            pm.Policy("none", **bad)


def test_dgc_plans_carry_momentum_to_uncompressed_tensors():
    d = pm.dense_spec([specmod.parse("dgc:ratio=0.01,momentum=0.8,nesterov=true")])
    assert d.name == "dgc" and d.parts[0].params["dense"] is True
    assert d.parts[0].params["momentum"] == 0.8 and d.parts[0].params["nesterov"] is True
    assert pm.dense_spec([specmod.parse("dgc:momentum=0")]).name == "none"
    assert pm.dense_spec([specmod.parse("topk")]).name == "none"
    with pytest.raises(ValueError, match="without momentum"):
        pm.dense_spec([specmod.parse("dgc"), specmod.parse("topk")])


def test_dgc_dense_is_momentum_sgd_summed():
    """``dgc:dense=true`` sends u = m*u + g whole, summable (numpy reference)."""
    import numpy as np

    from hvd_compress.core import build
    c = build("dgc:momentum=0.5,dense=true")
    assert c.summable
    u = np.zeros(6, "float32")
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = rng.standard_normal(6).astype("float32")
        u = 0.5 * u + g
        enc = c.encode(g.reshape(2, 3), "t")
        assert enc.nbytes == 24
        np.testing.assert_array_equal(c.aggregate(enc.payload, enc).ravel(), u)


def _torch_plan(compression, min_numel=pm.DEFAULT_MIN_NUMEL):
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()
    torch.manual_seed(0)
    m = torch.nn.Sequential(  # biases, BatchNorm, a tiny layer and a big one
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 64), torch.nn.Linear(64, 4), torch.nn.Linear(4, 4))
    opt = hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                  named_parameters=m.named_parameters(),
                                  compression=compression, min_numel=min_numel)
    return opt


def _keras_plan(compression, min_numel=pm.DEFAULT_MIN_NUMEL):
    import keras

    import hvd_compress.tensorflow as hct
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same"),
        keras.layers.BatchNormalization(), keras.layers.Conv2D(32, 3, padding="same"),
        keras.layers.Flatten(), keras.layers.Dense(64), keras.layers.Dense(4),
        keras.layers.Dense(4)])
    opt = hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression,
                                         min_numel=min_numel)
    return opt.plan(model.trainable_variables)


def _by_size(name, shape, dtype):
    n = 1
    for d in shape:
        n *= d
    return "qsgd:levels=4" if n > 10000 else ("onebit" if len(shape) > 1 else None)


@pytest.mark.parametrize("compression,min_numel,compressed", [
    ("topk:ratio=0.01", pm.DEFAULT_MIN_NUMEL, 2),  # conv2 (4,608) and the big layer (131,072)
    ({"0.*": "fp16", "2.*": "fp16", "*conv2d*": "fp16", "*": "onebit"}, pm.DEFAULT_MIN_NUMEL, 2),
    (_by_size, 0, 5),                              # the rule off: every matrix gets a choice
    ("topk:ratio=0.01", 0, 12),                    # the rule off: every tensor compressed
])
def test_plan_is_the_same_in_both_frameworks(compression, min_numel, compressed):
    """One model's plan: the same tensors compressed, with the same compressor and bytes,
    in PyTorch and Keras (names and layouts differ), under the
    default rule, a mapping, a callable and the rule off."""
    opt = _torch_plan(compression, min_numel)
    t_rows = opt.plan()
    with open(os.devnull, "w") as sink:
        assert f"{compressed} compressed" in opt.print_plan(file=sink)
    k_rows = _keras_plan(compression, min_numel)

    def summary(rows):  # (1-bit scales per column: its bytes follow each framework's layout)
        return sorted((r["compressed"], r["compression"].split(":")[0],
                       None if r["compression"].startswith("onebit") else r["bytes"],
                       int(np.prod(r["shape"]))) for r in rows)
    assert summary(t_rows) == summary(k_rows)
    assert sum(r["compressed"] for r in t_rows) == compressed


TORCH_GLOO.add(__name__, "torch_checks", "tests.workers.policy:torch_checks")  # (tests.launches)


@pytest.fixture(scope="module")
def torch_results(request):
    return TORCH_GLOO.results(request, "torch_checks")


TF_GLOO.add(__name__, "tf_checks", "tests.workers.policy:tf_checks")  # (tests.launches)


@pytest.fixture(scope="module")
def tf_results(request):
    return TF_GLOO.results(request, "tf_checks")


def test_torch_mixed_plan_matches_the_reference(torch_results):
    for r in torch_results:
        assert r["plan"]["fc1.weight"] == "topk" and r["plan"]["fc2.weight"] == "onebit"
        assert r["plan"]["conv.weight"] == "none" and r["plan"]["fc1.bias"] == "none"
        assert r["mixed_max_err"] < 1e-6


def test_torch_uncompressed_tensors_share_one_collective(torch_results):
    for r in torch_results:
        assert r["compressed"] == 2
        assert r["collectives"] == [3, 3, 3]  # topk, onebit, and one for the rest


def test_torch_policy_checkpoint_resumes_bit_identically(torch_results):
    assert all(r["resume_identical"] for r in torch_results)


def test_torch_start_step(torch_results):
    for r in torch_results:
        assert r["start_equal_dense"]
        assert r["start_then_fresh_err"] < 1e-6
        assert r["start_sent_compressed"]


def test_torch_dgc_plan_keeps_momentum_on_small_tensors(torch_results):
    for r in torch_results:
        assert r["dgc_dense_err"] < 1e-6 and r["dgc_dense_moved"] > 1e-3


def test_tf_mixed_plan_matches_the_reference(tf_results):
    for r in tf_results:
        assert r["tf_plan"] == {"big": "topk", "mid": "onebit", "vec": "none", "tiny": "none"}
        assert r["tf_collectives"] == 3
        assert r["tf_mixed_max_err"] < 1e-6


def test_tf_policy_checkpoint_resumes_bit_identically(tf_results):
    for r in tf_results:
        assert r["tf_resume_identical"] and r["tf_policy_steps"] == 4


def test_tf_start_step_in_a_traced_step(tf_results):
    for r in tf_results:
        assert max(r["tf_start_step_errs"]) < 1e-6


def test_torch_policy_follows_the_optimizers_momentum_and_refusals():
    """Review fixes: the uncompressed tensors' spec is settled after DGC took the
    optimizer's momentum (any momentum, Nesterov; a callable's choice too); start_step
    with local SGD is refused; a checkpoint of one compressor (0.1) loads into a policy."""
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()

    def opt_for(compression, momentum=0.95, nesterov=True, **kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
        return hc.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, nesterov=nesterov),
            named_parameters=m.named_parameters(), compression=compression, **kw), m

    for choice in ("dgc:ratio=0.01", lambda n, s, d: "dgc:ratio=0.01" if len(s) > 1 else None):
        with pytest.warns(UserWarning, match="DGC applies momentum 0.95"):
            opt, _ = opt_for(choice)
        rows = {r["name"]: r["compression"] for r in opt.plan()}
        assert "momentum=0.95,nesterov=true" in rows["0.weight"]       # 2,048: DGC
        assert "momentum=0.95,nesterov=true" in rows["1.weight"]       # 128: uncompressed
        assert "dense=true" in rows["1.weight"] and rows["0.bias"] == rows["1.weight"]
        assert all(g["momentum"] == 0.0 for g in opt.param_groups)
    with pytest.raises(ValueError, match="start_step"):
        opt_for("topk", momentum=0.0, nesterov=False, start_step=3, local_sgd=True)
    old, m = opt_for("topk:ratio=0.1", momentum=0.0, nesterov=False, min_numel=0)
    old.compression.core.encode(torch.ones(32, 64), "0.weight")  # some residual state
    sd = old.state_dict()
    new, _ = opt_for("topk:ratio=0.1", momentum=0.0, nesterov=False)
    new.load_state_dict(sd)
    child = new.compression.child(new.compression.policy.single)
    assert torch.equal(torch.as_tensor(child.core.states["0.weight"]["residual"]),
                       torch.as_tensor(old.compression.core.states["0.weight"]["residual"]))


def test_torch_dgc_epoch_set_before_the_first_step_is_kept():
    """A resumed run sets DGC's epoch before its first step; building the compressors at
    that step (bind, the optimizer's momentum moved into DGC) used to restart the
    warm-up at epoch 0 (25% sent instead of 0.1%)."""
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()
    for compression in ("dgc:ratio=0.001", hc.DGC(ratio=0.001)):
        torch.manual_seed(0)
        m = torch.nn.Linear(100, 50)  # 5,000-element weight: compressed
        with pytest.warns(UserWarning, match="DGC applies momentum"):
            opt = hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                          named_parameters=m.named_parameters(),
                                          compression=compression)
        opt.compression.set_epoch(4)  # past the 4 warm-up epochs
        m(torch.ones(3, 100)).sum().backward()
        opt.step()
        dgcs = [c.core for c in opt.compression.children.values()]
        assert dgcs and all(c.epoch == 4 for c in dgcs)
        weight = next(r for r in opt.plan() if r["name"] == "weight")
        assert weight["bytes"] == 5 * 8  # ceil(0.1% of 5,000) slots of index + value


def test_tf_given_compressor_keeps_the_wrappers_counters(tf_results):
    """A compressor object given to the tape keeps its accumulators and counters even when
    the default rule wraps it in a policy (a checkpoint of that object holds them).  (In
    the launch: TensorFlow's Horovod is never initialised in the pytest process, see
    tests/conftest.py.)"""
    for r in tf_results:
        assert r["given_is_policy"] and r["given_passes"] == 2 and r["given_accs"]
        assert r["given_checkpointed"]
        assert "start_step" in r["given_refused"]


def test_torch_ranks_agree_on_the_delayed_start_after_a_rank0_resume(torch_results):
    assert [r["resumed_steps"] for r in torch_results] == [3, 3]
    assert torch_results[0]["resumed_collectives"] == torch_results[1]["resumed_collectives"] == 3
