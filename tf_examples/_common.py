"""Helpers the TensorFlow examples share: Horovod set-up, the device, Keras fit plumbing, the summary."""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress.tools import devices, runtools  # noqa: E402


def choose_device(ap, args) -> str:
    """``--device`` checked at start-up (TensorFlow imported to ask it): ``cuda`` or
    ``cpu``; ``cuda`` where TensorFlow sees no GPU exits here, with one line, before
    Horovod starts or any data loads."""
    return devices.choose(ap, args, "tensorflow")


def place(tf, kind: str, local_rank: int) -> str:
    """Let this worker see only its device, before TensorFlow runs anything (Horovod's
    practice): under ``cuda`` the GPU of its local rank modulo the GPUs here (workers may
    share one: each takes the memory it needs, not all of it), where the model and the
    batches then go by themselves; under ``cpu`` no GPU.  Returns the summary's
    ``device`` (``cuda:<index>`` or ``cpu``)."""
    gpus = tf.config.list_physical_devices("GPU")
    if kind != "cuda":
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        return "cpu"
    index = devices.gpu_index(local_rank, len(gpus))
    tf.config.set_visible_devices(gpus[index], "GPU")
    tf.config.experimental.set_memory_growth(gpus[index], True)
    return f"cuda:{index}"


def init(seed: int, device: str = "cpu"):
    """hvd.init(), the device placed (:func:`place`; ``device`` as :func:`choose_device`
    gives it), one thread pool share per worker, seeds; returns (hvd, keras, tf, hct,
    the summary's device)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    from hvd_compress import nodes
    hvd.init(process_sets=nodes.node_process_sets())  # the hierarchical exchange's, if any
    label = place(tf, device, hvd.local_rank())
    threads = runtools.worker_threads(hvd.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    runtools.limit_kernel_threads(threads)
    keras.utils.set_random_seed(seed)
    return hvd, keras, tf, hct, label


def broadcast_initial(hvd, model) -> None:
    """The same initial weights on every rank."""
    for v in model.variables:
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{v.path}"))


def keras_optimizer(keras, hct, args, comp, model):
    """SGD wrapped in our Keras DistributedOptimizer; DGC keeps the momentum itself
    (except under local SGD, where each worker's own steps keep it)."""
    dgc = runtools.uses_dgc(comp) and not args.local_sgd
    momentum = 0.0 if dgc else args.momentum
    return hct.keras.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=momentum),
                                          compression=comp,
                                          backward_passes_per_step=args.backward_passes_per_step,
                                          local_sgd=args.local_sgd,
                                          local_sgd_warmup_steps=args.local_sgd_warmup_steps,
                                          buffers=model.non_trainable_variables, delay=args.delay,
                                          min_numel=args.min_numel, start_step=args.start_step,
                                          hierarchical=runtools.HIERARCHICAL[args.hierarchical],
                                          exchange=args.exchange)


def runs_eagerly(comp) -> bool:
    """Whether a compressor of ``comp`` sends payloads whose size depends on the values
    (threshold-v, adaptive quantization): Keras must then run the step eagerly."""
    from hvd_compress.core import build
    return any(build(str(s)).variable_size for s in comp.specs())


def epoch_callback(keras, comp, eager=False):
    """A callback that sets DGC's warm-up epoch (tracing the step again when the density
    changes) and counts batches (``.steps``); ``eager``: the payloads' sizes vary and
    each update's bytes are read from the optimizer's account."""
    import hvd_compress.tensorflow as hct

    class Epochs(hct.keras.CompressionWarmupCallback):
        steps = 0
        sized = 0  # sum over batches of the payload bytes per update in force (DGC's warm-up)
        split = dict.fromkeys(runtools.SPLIT_KEYS + WIRE_KEYS, 0.0)  # eager: summed over batches

        def on_epoch_begin(self, epoch, logs=None):
            super().on_epoch_begin(epoch, logs)
            self.per_update = bytes_per_update(comp, self.model.trainable_variables)

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            self.sized += int(self.model.optimizer.last_stats["bytes_sent"]) if eager \
                else self.per_update
            if eager:  # the engine's own clock ran in this step
                for key in self.split:
                    self.split[key] += float(self.model.optimizer.last_stats[key])

        def mean_per_update(self) -> float:
            return self.sized / max(1, self.steps)

    return Epochs(comp)


def all_workers(hvd, tf) -> None:
    """Wait until every worker reaches this point (one small allreduce): before an
    evaluation, timed, so the training time is the slowest worker's; after it, untimed,
    so all resume together and none evaluates while another trains (under local SGD the
    workers do not meet between averages, and on shared cores one worker's evaluation
    slowed another's timed steps: the PyTorch examples' ``all_workers``,
    docs/results/adam-era.md)."""
    if hvd.size() > 1:
        hvd.allreduce(tf.zeros([1]), name="hvd_compress.example.all_workers")


def curve_callback(keras, xte, yte, epochs: int, stop=None, meet=None):
    """A callback that evaluates the test accuracy after every epoch but the last (the
    caller evaluates that one after training, when local SGD has averaged) and keeps
    the points of the summary's curve (:func:`runtools.curve_point`).  ``.t0``: when
    training started (set before ``fit``); ``.eval_s``: the seconds spent evaluating and
    in the untimed meeting after it, which the training time leaves out.  Under local
    SGD an epoch before the last evaluates this worker's replica (the workers differ
    until their next average).
    ``stop(accuracy)``, called on every worker after such an epoch, ends ``fit`` there
    when it returns True (``--stop-at``: the same answer on every worker); ``.stopped``
    then says so.  ``meet()`` (:func:`all_workers`) runs before each evaluation, timed,
    and after it, untimed."""
    import time

    class Curve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.t0, self.eval_s, self.points, self.stopped = time.perf_counter(), 0.0, [], False

        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 >= epochs:
                return
            if meet is not None:
                meet()
            now = time.perf_counter()
            acc = float(self.model.evaluate(xte, yte, verbose=0)[1])
            self.points.append(runtools.curve_point(epoch + 1, now - self.t0 - self.eval_s, acc))
            if meet is not None:
                meet()
            self.eval_s += time.perf_counter() - now
            if stop is not None and stop(acc):
                self.stopped = self.model.stop_training = True

    return Curve()


#: exchanges the split of a traced run is measured on (after one untimed), eagerly
SAMPLE_EXCHANGES = 5
#: the bytes leaving and reaching a worker over its links, per exchange: the account's
#: (traced steps cannot count them as they go: taken with the split, eagerly)
WIRE_KEYS = ("wire_out", "wire_in")


def sample_split(tf, hct, args, variables, loss_of, hierarchical=None,
                 exchanges: int = SAMPLE_EXCHANGES) -> tuple[dict, str]:
    """The encode / communicate / decode milliseconds of one exchange of a traced run,
    where the engine's clock (Python, run at trace time) cannot see the steps: measured
    on ``exchanges`` eager exchanges (after one untimed) of the gradients of
    ``loss_of()`` with respect to ``variables``, by a tape with a compressor of its own
    (the run's state is not touched), past DGC's warm-up.  Eager dispatch costs more per
    op than a traced step, so the figures are an upper bound.  Every worker calls it.
    Returns (per-exchange ms by key and the bytes over the links (:data:`WIRE_KEYS`), or {}
    when not measured; how they were measured, or why not)."""
    if args.local_sgd:  # averages of parameters, on a schedule: not one exchange per step
        return {}, "not measured: local SGD averages the parameters on its own schedule"
    comp = hct.as_compression(args.compression, args.min_numel, 0)  # (the compressed phase)
    runtools.past_warmup(comp)
    total = dict.fromkeys(runtools.SPLIT_KEYS + WIRE_KEYS, 0.0)
    for i in range(exchanges + 1):
        with tf.GradientTape() as tape:
            loss = loss_of()
        tape = hct.DistributedGradientTape(tape, compression=comp, hierarchical=hierarchical,
                                           exchange=args.exchange)
        tape.gradient(loss, variables)
        if i:
            for key in total:
                total[key] += float(tape.last_stats[key])
    return ({k: v / exchanges for k, v in total.items()},
            f"eager sample: {exchanges} exchanges of the model's gradients after training")


def compression(hct, args):
    """The compressor, or per-tensor policy, the flags ask for."""
    return hct.as_compression(args.compression, args.min_numel, args.start_step)


def bytes_per_update(comp, variables) -> int:
    from hvd_compress.tensorflow.exchange import plan_rows
    return sum(r["bytes"] for r in plan_rows(comp, variables))


def bytes_sent(args, comp, variables, buffers, updates, final=True, per_update=None) -> int:
    """Bytes one worker sent in ``updates`` optimizer updates (the payload sizes are
    fixed per variable and epoch; traced steps cannot count them as they go), with
    ``final`` the last average before evaluation (see fit_and_report); ``per_update``:
    the mean payload per update where it changed over the epochs (DGC's warm-up)."""
    import tensorflow as tf

    if per_update is None:
        per_update = bytes_per_update(comp, variables)
    schedule = runtools.local_schedule(args)
    if schedule is None:
        return per_update * updates
    dense = sum(int(np.prod(b.shape)) * tf.as_dtype(b.dtype).size for b in buffers
                if tf.as_dtype(b.dtype).is_floating)
    warm = sum(1 for i in range(updates) if schedule.synchronous(i))
    averages = sum(1 for i in range(updates) if schedule.averages_after(i))
    averages += final and runtools.needs_final_average(args, updates)
    return per_update * (warm + averages) + dense * averages


def finish(args, example, comp, model, batches, size, train_s, accuracy, wall_s,
           per_update=None, final_average=True, split=None, **extra) -> None:
    """Print and (with --json) write the summary; rank 0 only calls it.
    ``final_average``: whether local SGD's last average before evaluating may have run
    (not when ``--stop-at`` ended training); ``split``: the encode / comm / decode ms
    summed over the updates (missing keys: not measured)."""
    updates = max(1, batches // runtools.passes_per_step(args))
    sent = bytes_sent(args, comp, model.trainable_variables, model.non_trainable_variables,
                      updates, final=final_average, per_update=per_update)
    doc = runtools.summary("tensorflow", example, args.compression, size, updates,
                           batches * args.batch_size * size, train_s,
                           {"bytes_sent": sent, **(split or {})},
                           accuracy, wall_s, **runtools.local_fields(args),
                           hierarchical=bool(getattr(model.optimizer, "hierarchical", False)),
                           exchange=runtools.exchange_used(model.optimizer),
                           exchange_why=runtools.exchange_why(model.optimizer), **extra)
    runtools.write_summary(args.json, doc)


def fit_and_report(args, example, hvd, keras, hct, model, comp, xtr, ytr, xte, yte, t_start,
                   device="cpu"):
    """Compile, broadcast the initial weights, fit (evaluating after every epoch: the
    summary's curve), evaluate, and write the summary (with the time split: see
    :func:`sample_split`; ``device``: where it ran, as :func:`init` returns it)."""
    import time

    import tensorflow as tf

    rank, size = hvd.rank(), hvd.size()
    opt = keras_optimizer(keras, hct, args, comp, model)
    runtools.print_plan(opt.plan(model.trainable_variables), args, rank)
    eager = runs_eagerly(comp)
    if eager and rank == 0 and not args.quiet:
        print("payload sizes depend on the values: Keras runs the step eagerly", flush=True)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], run_eagerly=eager)
    broadcast_initial(hvd, model)
    epochs = epoch_callback(keras, comp, eager)
    curve = curve_callback(keras, xte, yte, args.epochs, lambda acc: runtools.stop_agreed(
        args, acc, lambda answer: hvd.broadcast_object(answer, 0, name="stop_at")),
        meet=lambda: all_workers(hvd, tf))
    curve.t0 = time.perf_counter()
    model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              verbose=2 if rank == 0 and not args.quiet else 0, callbacks=[epochs, curve])
    if curve.stopped:  # --stop-at: the target was met; its epoch is the last point
        points = curve.points
        train_s, acc = points[-1]["seconds"], points[-1]["test_accuracy"]
    else:
        if runtools.needs_final_average(args, epochs.steps):  # evaluate the mean model
            model.optimizer.average_parameters(model.trainable_variables)
        all_workers(hvd, tf)
        train_s = time.perf_counter() - curve.t0 - curve.eval_s
        acc = float(model.evaluate(xte, yte, verbose=0)[1])
        points = curve.points + [runtools.curve_point(args.epochs, train_s, acc)]
    updates = max(1, epochs.steps // runtools.passes_per_step(args))
    if eager:  # the engine timed every step itself
        split, how = epochs.split, "every step (eager)"
    else:  # a traced step: timed on a sample, after training (every worker)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        xs, ys = xtr[:args.batch_size], ytr[:args.batch_size]
        per, how = sample_split(
            tf, hct, args, model.trainable_variables,
            lambda: loss_fn(ys, model(xs, training=False)),
            runtools.HIERARCHICAL[args.hierarchical])
        split = {k: v * updates for k, v in per.items()}
    if rank == 0:
        if not args.quiet:
            print(f"test accuracy {acc:.4f} after {len(points)} epochs", flush=True)
        finish(args, example, comp, model, epochs.steps, size, train_s, acc,
               time.perf_counter() - t_start, per_update=epochs.mean_per_update(),
               epochs=len(points), curve=points, final_average=not curve.stopped,
               split=split, split_measured=how, device=device)
