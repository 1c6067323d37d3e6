"""Where the examples train: ``--device cuda|cpu``, for both frameworks and for
``hvd-compress-compare``, which passes it to every run.

``cuda``: each worker on GPU ``local_rank % GPUs`` (:func:`gpu_index`), Horovod's one GPU
per worker where there are enough, else workers sharing one (a GPU runs several small
workers' kernels side by side); model, data, gradients and the compressors' state live
there.  ``cpu``: as before.  The default (``None``) is ``cuda`` where the framework sees a
GPU, else ``cpu``.  ``cuda`` where the framework sees none is refused before anything
starts, with one line that says why (:func:`choose`).  The frameworks are imported only
when asked about (no torch or tensorflow at import).
"""

from __future__ import annotations

DEVICES = ("cuda", "cpu")
#: the frameworks' names as the examples and compare's ``--framework`` spell them
FRAMEWORKS = ("torch", "tensorflow")


def gpu_count(framework: str) -> int:
    """GPUs ``framework`` sees in this process (0: none, or a build without GPU support)."""
    if framework == "torch":
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if framework == "tensorflow":
        import tensorflow as tf
        return len(tf.config.list_physical_devices("GPU"))
    raise ValueError(f"unknown framework {framework!r} (one of {', '.join(FRAMEWORKS)})")


def no_gpu(framework: str) -> str:
    """Why ``--device cuda`` cannot run here, in one line that says what to do instead."""
    if framework == "torch":
        import torch
        why = (f"PyTorch {torch.__version__} is built without CUDA" if torch.version.cuda is None
               else "torch.cuda.is_available() is False")
        return f"--device cuda: no CUDA device visible to PyTorch ({why}); use --device cpu"
    return ("--device cuda: no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') "
            "is empty); use --device cpu")


def resolve(choice: str | None, frameworks) -> str:
    """``--device``'s value for a run of ``frameworks`` (a name, or several: all must see a
    GPU): ``choice`` itself, or for None ``cuda`` where they all see a GPU, else ``cpu``.
    ValueError (:func:`no_gpu`'s line) for ``cuda`` where one sees none."""
    frameworks = [frameworks] if isinstance(frameworks, str) else list(frameworks)
    if choice not in (None, *DEVICES):
        raise ValueError(f"--device is one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "cpu":
        return "cpu"
    blind = next((f for f in frameworks if _count(f, choice) == 0), None)
    if blind is None:
        return "cuda"
    if choice == "cuda":
        raise ValueError(no_gpu(blind))
    return "cpu"


def _count(framework: str, choice: str | None) -> int:
    """:func:`gpu_count`, or ValueError in one line where ``framework`` does not import
    (an example asked for on a machine without it: not a traceback)."""
    try:
        return gpu_count(framework)
    except ImportError as exc:
        name = {"torch": "PyTorch", "tensorflow": "TensorFlow"}.get(framework, framework)
        head = "--device cuda: " if choice == "cuda" else ""
        raise ValueError(f"{head}{name} does not import here ({exc}); install it to run "
                         f"this") from exc


def choose(ap, args, framework: str) -> str:
    """An example's device (``args.device``, resolved), checked at start-up: where it cannot
    run, the parser ``ap`` exits with status 2 and one line, before Horovod or any data."""
    try:
        return resolve(args.device, framework)
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")


def gpu_index(local_rank: int, count: int) -> int:
    """The GPU of the worker of ``local_rank`` among ``count`` GPUs: workers beyond the
    GPUs share them, round robin."""
    return local_rank % max(1, count)


def add_device_arg(ap) -> None:
    """The examples' ``--device`` flag (runtools.common_parser adds it)."""
    ap.add_argument("--device", choices=DEVICES, default=None,
                    help="where to train: cuda (each worker on GPU local_rank %% GPUs: workers "
                         "may share one) or cpu (default: cuda where the framework sees a GPU, "
                         "else cpu)")
