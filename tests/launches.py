"""Launches that several test modules share: one launch per pytest run serves them all.

Launching costs seconds (the launcher, importing a framework in every worker, ``hvd.init``),
so worker bodies of the same kind -- framework, controller, worker count, environment -- run
one after another in one launch (:func:`tests.harness.run_many`) whatever module they check.

``TF_NODES``: TensorFlow under 4 workers in 2 simulated nodes (Gloo, node process sets at
init): the hierarchy's bodies (tests/test_tensorflow_hierarchy.py) and the two-phase
exchange's (tests/test_tensorflow_twophase.py).  The two-phase body names its exchange
(``exchange="two-phase"``: the pinned hierarchy only stands for ``"auto"``) and runs over
the whole world, whose links the simulated nodes leave as they are.

:class:`Shared` launches: each test module registers its bodies at import (pytest imports
every module it collected before the first test runs); the first test that asks launches
the bodies of the modules this run selected, in one launch, and every later ask reads its
results.  A body's exception fails the launch, and so every test that reads it, with every
worker's traceback (tests.harness.LaunchError)."""

from __future__ import annotations

from tests.harness import LaunchError, run_horovod, run_many, run_nodes, shared_launches

TF_NODES = shared_launches({"tf-nodes": (run_nodes, [
    ("hierarchy", "tests.workers.tf_hierarchy:tape_matches_definition", {}),
    ("two-phase", "tests.workers.tf_twophase:tape_matches_definition", {})],
    {"nodes": 2, "np": 4, "timeout": 900, "env": {"HVD_COMPRESS_EXCHANGE": "hierarchical"}})})


class Shared:
    """One launch (``launch(**launch_kwargs)``) for the bodies several modules registered."""

    def __init__(self, launch, **launch_kwargs):
        self.launch, self.launch_kwargs = launch, launch_kwargs
        self.calls = {}  # {(module, key): (target, kwargs)}, in registration order
        self.made = None

    def add(self, module: str, key: str, target: str, kwargs: dict | None = None) -> None:
        """Register ``target(**kwargs)`` as ``key`` of test module ``module`` (its
        ``__name__``)."""
        self.calls[(module, key)] = (target, dict(kwargs or {}))

    def results(self, request, key: str) -> list:
        """Per-rank results of the asking module's body ``key`` (``request``: the pytest
        fixture request of a test of that module)."""
        module = request.module.__name__
        if self.made is None:
            chosen = {item.module.__name__ for item in request.session.items
                      if getattr(item, "module", None) is not None} | {module}
            self.made = self._run([mk for mk in self.calls if mk[0] in chosen])
        if isinstance(self.made, LaunchError):
            raise self.made
        if (module, key) not in self.made:  # (a module this run had not selected)
            alone = self._run([(module, key)])
            if isinstance(alone, LaunchError):
                raise alone
            self.made.update(alone)
        return self.made[(module, key)]

    def _run(self, keys):
        names = {f"{m}:{k}": (m, k) for m, k in keys}
        calls = [(name, *self.calls[mk]) for name, mk in names.items()]
        try:
            got = run_many(self.launch, calls, **self.launch_kwargs)
        except LaunchError as exc:
            return exc
        return {names[name]: value for name, value in got.items()}


#: TensorFlow, ``horovodrun -np 2 --gloo``
TF_GLOO = Shared(run_horovod, np=2, controller="gloo", timeout=1800)
#: TensorFlow, ``horovodrun -np 2 --mpi``
TF_MPI = Shared(run_horovod, np=2, controller="mpi", timeout=1800)
#: PyTorch, ``horovodrun -np 2 --gloo``
TORCH_GLOO = Shared(run_horovod, np=2, controller="gloo", timeout=1800)
#: PyTorch, ``horovodrun -np 2 --mpi``
TORCH_MPI = Shared(run_horovod, np=2, controller="mpi", timeout=1800)
#: PyTorch, ``horovodrun -np 3 --gloo`` (a world size that is not a power of two); its
#: bodies start Horovod by ``tests.workers.diloco.init_with_pair`` (the process set of ranks
#: 0 and 1 must be registered at the first ``hvd.init``)
TORCH_GLOO3 = Shared(run_horovod, np=3, controller="gloo", timeout=1800)
#: TensorFlow, ``horovodrun -np 3 --gloo``; its bodies start Horovod by
#: ``tests.workers.tf_patterns.init_with_pair`` (as TORCH_GLOO3's)
TF_GLOO3 = Shared(run_horovod, np=3, controller="gloo", timeout=1800)
