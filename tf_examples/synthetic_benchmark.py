#!/usr/bin/env python
"""Horovod's TF2 synthetic benchmark shape, with compression: a custom loop with the tape.

    horovodrun -np 2 python tf_examples/synthetic_benchmark.py --compression topk:ratio=0.01

A small ResNet-like Keras model (``--width``, ``--blocks``, ``--image-size``) on
one random batch; ``--num-warmup-batches`` untimed steps, then ``--num-iters``
timed iterations of ``--num-batches-per-iter`` steps, each a ``tf.function``
with ``hvd_compress.tensorflow.DistributedGradientTape``; images/s per worker
and in total.  ``--horovod-tape`` uses Horovod's own tape (summable compressors).
"""

from __future__ import annotations

import time

import numpy as np
from _common import broadcast_initial, bytes_sent, choose_device, compression, init, sample_split
from models import resnet

from hvd_compress.tools import runtools


def main(argv=None):
    ap = runtools.common_parser(__doc__.split("\n\n")[0], batch_size=32, lr=0.01)
    runtools.add_synthetic_args(ap)
    ap.add_argument("--horovod-tape", action="store_true",
                    help="use horovod.tensorflow.DistributedGradientTape (summable compressors)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    hvd, keras, tf, hct, label = init(args.seed, choose_device(ap, args))
    rank, size = hvd.rank(), hvd.size()
    model = resnet(keras, args.width, args.blocks, args.image_size, args.num_classes)
    opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    comp = hct.compressor(args.compression) if args.horovod_tape else compression(hct, args)
    runtools.past_warmup(comp)
    if not args.horovod_tape:
        from hvd_compress.tensorflow.exchange import plan_rows
        runtools.print_plan(plan_rows(comp, model.trainable_variables), args, rank)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(args.seed + rank)
    data = tf.constant(rng.standard_normal((args.batch_size, args.image_size, args.image_size, 3),
                                           dtype=np.float32))
    target = tf.constant(rng.integers(0, args.num_classes, args.batch_size))
    bpps = args.backward_passes_per_step
    if args.horovod_tape and (args.local_sgd or args.delay):
        raise SystemExit("--horovod-tape has no --local-sgd or --delay")

    made = []  # the tape of the traced step (Python runs while tracing): its hierarchy

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if args.horovod_tape:
            tape = hvd.DistributedGradientTape(tape, compression=comp)
        else:
            tape = hct.DistributedGradientTape(
                tape, compression=comp, backward_passes_per_step=bpps, local_sgd=args.local_sgd,
                local_sgd_warmup_steps=args.local_sgd_warmup_steps,
                buffers=model.non_trainable_variables, delay=args.delay,
                min_numel=args.min_numel, start_step=args.start_step,
                hierarchical=runtools.HIERARCHICAL[args.hierarchical], exchange=args.exchange)
            made[:] = [tape]
        # Horovod 0.28.1's tape keys sources by tf.Variable.ref(): give it Keras 3's
        # underlying tf.Variables
        sources = [v.value for v in model.trainable_variables] if args.horovod_tape \
            else model.trainable_variables
        grads = tape.gradient(loss, sources)
        if args.horovod_tape or bpps == 1 or args.local_sgd:
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if args.local_sgd:
                tape.finish_step()
        elif tape.exchanged:
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    broadcast_initial(hvd, model)
    nparams = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if rank == 0 and not args.quiet:
        print(f"model: ResNet width {args.width} blocks {args.blocks}, {nparams:,} parameters; "
              f"batch {args.batch_size}; {size} workers; compression {args.compression}"
              + (f"; on {label}" if label != "cpu" else ""), flush=True)
    for _ in range(args.num_warmup_batches):
        step()
    progress = runtools.Progress(args.num_iters, "iterations", enabled=rank == 0 and not args.quiet)
    rates, train_s = [], 0.0
    for it in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            loss = step()
        float(loss)  # wait for the step
        dt = time.perf_counter() - t0
        train_s += dt
        rates.append(args.batch_size * args.num_batches_per_iter / dt)
        progress.update(it + 1, f"{rates[-1]:.1f} img/s per worker")
    mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
    steps = args.num_iters * args.num_batches_per_iter
    if args.horovod_tape:
        split, how = {}, "not measured: Horovod's own tape keeps no account"
    else:  # the traced step's split, timed on a sample (every worker)
        per, how = sample_split(tf, hct, args, model.trainable_variables,
                                lambda: loss_fn(target, model(data, training=False)),
                                runtools.HIERARCHICAL[args.hierarchical])
        updates = steps if args.local_sgd else steps // bpps
        split = {k: v * updates for k, v in per.items()}
    if rank == 0:
        if not args.quiet:
            print(f"img/sec per worker: {mean:.1f} +-{conf:.1f}", flush=True)
            print(f"total img/sec on {size} workers: {size * mean:.1f} +-{size * conf:.1f}",
                  flush=True)
        # bytes of the timed steps: all steps' minus the untimed warm-up steps'
        sent = bytes_sent(args, comp, model.trainable_variables, model.non_trainable_variables,
                          args.num_warmup_batches + steps, final=False) - \
            bytes_sent(args, comp, model.trainable_variables, model.non_trainable_variables,
                       args.num_warmup_batches, final=False)
        if not args.local_sgd:
            sent //= bpps  # an update every bpps passes
        doc = runtools.summary("tensorflow", "synthetic_benchmark", args.compression, size, steps,
                               steps * args.batch_size * size, train_s,
                               {"bytes_sent": sent, **split}, None,
                               time.perf_counter() - t_start, **runtools.local_fields(args),
                               parameters=nparams,
                               hierarchical=bool(made and made[0].hierarchical),
                               exchange=runtools.exchange_used(made[0]) if made else "",
                               exchange_why=runtools.exchange_why(made[0]) if made else {},
                               img_sec_per_worker_mean=round(mean, 2),
                               img_sec_per_worker_conf=round(conf, 2), split_measured=how,
                               device=label)
        runtools.write_summary(args.json, doc)


if __name__ == "__main__":
    main()
