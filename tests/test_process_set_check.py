"""Horovod's global process set left empty when horovod.torch and horovod.tensorflow are
both imported and the other one is initialised: the wrappers refuse it clearly instead of
skipping every exchange (each worker would train alone).  Fresh interpreters: the state is
per process."""

import subprocess
import sys

import pytest

TORCH = """
import horovod.{first}, horovod.{second}
import horovod.torch as hvd, torch
import hvd_compress.torch as hc
hvd.init()
m = torch.nn.Linear(4, 3)
try:
    hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                            named_parameters=m.named_parameters(), compression="topk:ratio=0.5")
    print("BUILT", hvd.global_process_set.included())
except RuntimeError as e:
    print("REFUSED", e)
"""

TF = """
import horovod.{first}, horovod.{second}
import horovod.tensorflow as hvd, tensorflow as tf
import hvd_compress.tensorflow as hct
hvd.init()
v = tf.Variable(tf.ones((4, 3)))
try:
    with hct.DistributedGradientTape(tf.GradientTape(), compression="topk:ratio=0.5") as tape:
        loss = tf.reduce_sum(v * v)
    tape.gradient(loss, [v])
    print("BUILT", hvd.global_process_set.included())
except RuntimeError as e:
    print("REFUSED", e)
"""


def _run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("framework,other", [("torch", "tensorflow"), ("tensorflow", "torch")])
def test_an_empty_global_process_set_is_refused(framework, other):
    code = TORCH if framework == "torch" else TF
    bad = _run(code.format(first=framework, second=other))  # the other imported last
    assert "REFUSED" in bad and "global process set holds no ranks" in bad, bad
    assert f"Import horovod.{framework} after the other" in bad
    good = _run(code.format(first=other, second=framework))
    assert "BUILT True" in good, good
