"""Horovod's global process set left empty when horovod.torch and horovod.tensorflow are
both imported and the other one is initialised: among two workers the wrappers refuse it
clearly instead of skipping every exchange (each worker would train alone: at 0.2.6 the
two ranks below kept gradients 2 and 4 instead of averaging 3).  Launched as
``horovodrun -np 2`` (Horovod's launcher without its start-up probe, tests.harness.HOROVODRUN)
running ``python -c`` directly: the import order is the point, so no harness imports first."""

import functools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import HOROVODRUN

pytestmark = pytest.mark.multiprocess

TORCH = """
import horovod.{first}, horovod.{second}
import horovod.torch as hvd, torch
import hvd_compress.torch as hc
hvd.init()
m = torch.nn.Linear(4, 1, bias=False)
try:
    opt = hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                  named_parameters=m.named_parameters(), compression="none")
    m(torch.full((2, 4), float(hvd.rank() + 1))).sum().backward()
    opt.step()
    print("BUILT", hvd.global_process_set.included(), m.weight.grad[0, 0].item())
except RuntimeError as e:
    print("REFUSED", e)
"""

TF = """
import horovod.{first}, horovod.{second}
import horovod.tensorflow as hvd, tensorflow as tf
import hvd_compress.tensorflow as hct
hvd.init()
v = tf.Variable(tf.ones((4, 1)))
try:
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(tf.fill((2, 4), float(hvd.rank() + 1)) @ v)
    tape = hct.DistributedGradientTape(t, compression="none")
    print("BUILT", hvd.global_process_set.included(), float(tape.gradient(loss, [v])[0][0, 0]))
except RuntimeError as e:
    print("REFUSED", e)
"""


def _launch(code, workers=2):
    """Run ``code`` under ``horovodrun -np workers`` (or plain Python for ``workers=None``)
    and return its marker lines (BUILT, STEPPED, REFUSED)."""
    cmd = [sys.executable, "-c", code] if workers is None else \
        [*HOROVODRUN, "-np", str(workers), "--gloo", sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines()
            if any(mark in line for mark in ("BUILT", "STEPPED", "REFUSED"))]


@pytest.mark.parametrize("framework,other", [("torch", "tensorflow"), ("tensorflow", "torch")])
def test_an_empty_global_process_set_is_refused_among_workers(framework, other):
    pytest.importorskip("tensorflow")  # both frameworks are the point
    code = TORCH if framework == "torch" else TF
    bad = _launch(code.format(first=framework, second=other))  # the other imported last
    assert len(bad) == 2 and all("REFUSED" in line and "holds no ranks" in line and
                                 f"Import horovod.{framework} after the other" in line
                                 for line in bad), bad
    good = _launch(code.format(first=other, second=framework))
    assert len(good) == 2 and all(line.endswith("BUILT True 3.0") for line in good), good


# One worker, then (as an elastic job that grew) two: the wrapper made while the job had
# one worker is let through, and refuses at its first exchange once there are two.
# ``hvd.size`` answering 2 stands in for the growth; the emptied process set is Horovod's.
# The wrappers of one framework share a process per import order (the tape and the Keras
# optimizer: both built, then both stepped; each prints its lines under its own name).
GROWN = """
import horovod.{first}, horovod.{second}
import horovod.{framework} as hvd
hvd.init()
{builds}
hvd.size = lambda: 2
{steps}
"""

STEP = """
try:
    {step}
    print("{wrapper} STEPPED", hvd.global_process_set.ranks)
except RuntimeError as e:
    print("{wrapper} REFUSED", e)
"""

GROWN_PARTS = {
    "torch": ("""import torch, hvd_compress.torch as hc
m = torch.nn.Linear(4, 1, bias=False)
opt = hc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                              named_parameters=m.named_parameters(), compression="none")
m(torch.ones(2, 4)).sum().backward()""", "opt.step()"),
    "tape": ("""import tensorflow as tf, hvd_compress.tensorflow as hct
v = tf.Variable(tf.ones((4, 1)))
with tf.GradientTape() as t:
    loss = tf.reduce_sum(tf.ones((2, 4)) @ v)
tape = hct.DistributedGradientTape(t, compression="none")""", "tape.gradient(loss, [v])"),
    "keras": ("""import tensorflow as tf, keras, hvd_compress.tensorflow.keras as hck
kv = tf.Variable(tf.ones((4, 1)))
kopt = hck.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="none")""",
              "kopt.apply_gradients([(tf.ones((4, 1)), kv)])"),
}
FRAMEWORK = {"torch": "torch", "tape": "tensorflow", "keras": "tensorflow"}


def _grown_code(framework, first, second):
    """One plain process (one worker) with every wrapper of ``framework``, horovod.``first``
    imported before horovod.``second``."""
    wrappers = sorted(w for w in GROWN_PARTS if FRAMEWORK[w] == framework)
    builds = "\n".join(f'{GROWN_PARTS[w][0]}\nprint("{w} BUILT")' for w in wrappers)
    steps = "".join(STEP.format(step=GROWN_PARTS[w][1], wrapper=w) for w in wrappers)
    return GROWN.format(first=first, second=second, framework=framework, builds=builds,
                        steps=steps)


@functools.lru_cache(maxsize=None)
def _all_grown():
    """The four plain processes (each framework, each import order), two at a time: each
    is one process importing both frameworks (8 s of one core), so run one after another
    they would leave the other core idle.  ``{(framework, first): {wrapper: its marker
    lines, unprefixed}}``."""
    runs = [(f, first, second) for f, other in (("torch", "tensorflow"), ("tensorflow", "torch"))
            for first, second in ((f, other), (other, f))]
    with ThreadPoolExecutor(2) as pool:
        lines = pool.map(lambda run: _launch(_grown_code(*run), workers=None), runs)
    return {(f, first): {w: [line.split(" ", 1)[1] for line in got if line.startswith(w + " ")]
                         for w in GROWN_PARTS if FRAMEWORK[w] == f}
            for (f, first, _), got in zip(runs, lines)}


def _grown(framework, first, second):
    """``{wrapper: marker lines}`` of the plain process of ``framework`` with horovod.``first``
    imported before horovod.``second`` (:func:`_all_grown`)."""
    return _all_grown()[(framework, first)]


@pytest.mark.parametrize("wrapper", sorted(GROWN_PARTS))
def test_an_empty_global_process_set_is_refused_once_the_job_grows(wrapper):
    pytest.importorskip("tensorflow")
    framework = FRAMEWORK[wrapper]
    other = "tensorflow" if framework == "torch" else "torch"
    bad = _grown(framework, framework, other)[wrapper]  # the other imported last: the set is empty
    assert bad[0] == "BUILT" and len(bad) == 2 and bad[1].startswith("REFUSED") and \
        "holds no ranks" in bad[1], bad
    good = _grown(framework, other, framework)[wrapper]
    assert good == ["BUILT", "STEPPED [0]"], good
