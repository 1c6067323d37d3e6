"""A training run in which rank 1 dies at step ``--die-at`` (``os._exit(1)``, as a crash
or an OOM kill looks to its peers), for tests/test_dead_worker.py.

Launched as a script by horovodrun: ``dead_worker.py FRAMEWORK MARKER [--die-at N]``;
``MARKER`` is a unique word on the command line, so the test can look for processes
left behind.  Rank 0 trains on: it must fail, not wait forever, once its peer is gone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _say(rank, step):
    print(f"[rank {rank}] step {step}", flush=True)


def _die(rank, step, at):
    """Rank 1 leaves at step ``at`` without a word to its peers (its time goes to stdout)."""
    if rank == 1 and step == at:
        print(f"DYING {time.time():.3f}", flush=True)
        os._exit(1)


def train_torch(die_at: int, steps: int, spec: str) -> None:
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=spec, min_numel=0)
    for step in range(steps):
        _die(hvd.rank(), step, die_at)
        x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        _say(hvd.rank(), step)
        time.sleep(0.05)


def train_tf(die_at: int, steps: int, spec: str) -> None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as hct

    hvd.init()
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.normal([16, 2]), name="w")
    for step in range(steps):
        _die(hvd.rank(), step, die_at)
        x = tf.random.normal([8, 16])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        tape = hct.DistributedGradientTape(tape, compression=spec, min_numel=0)
        (g,) = tape.gradient(loss, [w])
        w.assign_sub(0.01 * g)
        _say(hvd.rank(), step)
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["torch", "tensorflow"])
    parser.add_argument("marker")
    parser.add_argument("--die-at", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--spec", default="topk:ratio=0.25")
    args = parser.parse_args()
    train = train_torch if args.framework == "torch" else train_tf
    train(args.die_at, args.steps, args.spec)


if __name__ == "__main__":
    main()
