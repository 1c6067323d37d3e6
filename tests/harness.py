"""Run test bodies under a real multi-process launch.

A *target* is ``"package.module:function"``.  Each launched process imports
the module, calls ``function(**kwargs)`` and writes what it returns (anything
JSON can hold) to ``<outdir>/rank<N>.json``; the harness collects those into a
list indexed by rank.  An exception inside a worker, a non-zero exit, a
missing result or a time-out fails the test with every worker's output shown.

Launchers:

* :func:`run_horovod` -- ``horovodrun -np N --gloo|--mpi`` (Horovod workers);
* :func:`run_horovod_elastic` -- elastic ``horovodrun`` (Gloo) whose host discovery
  script prints a file the test or its workers rewrite; every worker process that
  finished reports (under elastic Horovod a rank is no fixed process);
* :func:`run_nodes` -- ``nodesrun --nodes N -np P`` (Horovod Gloo workers in N simulated
  nodes: what the hierarchical exchange needs);
* :func:`run_mpi` -- ``mpirun -np N`` (plain mpi4py workers, no Horovod).

Put several checks in one worker function so one launch serves a whole test
module (launching costs seconds; see the ``scope="module"`` fixtures).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DEFAULT_TIMEOUT = 300
# horovodrun itself, less the ~4 s its start-up probe costs a launch (hvd_compress.tools.hvdrun;
# tests/test_dead_worker.py launches the real horovodrun script).
HOROVODRUN = [sys.executable, "-m", "hvd_compress.tools.hvdrun"]


class LaunchError(AssertionError):
    """A multi-process launch failed; the message holds every worker's output."""


def _bin(name: str) -> str:
    candidate = VENV_BIN / name
    return str(candidate) if candidate.exists() else name


def _env(outdir: str, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HVD_TEST_OUTDIR"] = outdir
    # mpirun refuses root without these; horovodrun adds the flag itself.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # an MPI rank waiting in a collective yields its core instead of spinning: the ranks
    # share 2 cores, and Open MPI spins unless it counts more ranks than slots (a TF np 3
    # launch: 25 s spinning, 17 s yielding)
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Keep the per-process thread pools small: the workers share 2 cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    env.setdefault("TF_NUM_INTEROP_THREADS", "1")
    # numba's too: a 2-thread pool's wake-up costs milliseconds per kernel call on small
    # tensors when the ranks share the cores (tests/conftest.py: one_numba_thread)
    env.setdefault("NUMBA_NUM_THREADS", "1")
    # Gloo waits 30 s for a peer by default: a rank's first numba compiles on the shared
    # cores outlasted that (a recv time-out aborted three launches of one CI run)
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "120")
    # the exchange the workers' references define (a test of "auto" sets it empty)
    env.setdefault("HVD_COMPRESS_EXCHANGE", "allgather")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _run(cmd: list[str], outdir: str, np: int, timeout: float, env: dict | None) -> str:
    """Run ``cmd`` in its own process group; its output, or LaunchError with every
    worker's output on a non-zero exit or a time-out (the whole group is killed)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(outdir, env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise LaunchError(_report(cmd, f"timed out after {timeout:.0f}s", out, outdir, np))
    if proc.returncode != 0:
        raise LaunchError(_report(cmd, f"exit code {proc.returncode}", out, outdir, np))
    return out


def _launch(cmd: list[str], np: int, target: str, kwargs: dict | None,
            timeout: float, env: dict | None) -> list:
    with tempfile.TemporaryDirectory(prefix="hvd-test-") as outdir:
        Path(outdir, "kwargs.json").write_text(json.dumps(kwargs or {}))
        full = cmd + [sys.executable, "-m", "tests.workers.entry", target]
        out = _run(full, outdir, np, timeout, env)
        results = []
        for rank in range(np):
            path = Path(outdir, f"rank{rank}.json")
            if not path.exists():
                raise LaunchError(_report(full, f"rank {rank} wrote no result", out, outdir, np))
            results.append(json.loads(path.read_text()))
        return results


def _report(cmd, why, out, outdir, np) -> str:
    parts = [f"launch failed ({why}): {' '.join(cmd)}", "---- combined output ----", out or ""]
    for err in sorted(Path(outdir).glob("*.err")):
        parts += [f"---- {err.stem} traceback ----", err.read_text()]
    return "\n".join(parts)


def run_horovod(target: str, np: int = 2, controller: str = "gloo", kwargs: dict | None = None,
                timeout: float = DEFAULT_TIMEOUT, env: dict | None = None) -> list:
    """Run ``target`` under ``horovodrun -np np`` with Gloo or MPI; return per-rank results."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    cmd = [*HOROVODRUN, "-np", str(np), f"--{controller}", "-H", f"localhost:{np}"]
    return _launch(cmd, np, target, kwargs, timeout, env)


def run_nodes(target: str, nodes: int = 2, np: int = 4, kwargs: dict | None = None,
              timeout: float = DEFAULT_TIMEOUT, env: dict | None = None) -> list:
    """Run ``target`` as an ``np``-worker Horovod Gloo job in ``nodes`` simulated nodes
    (``python -m hvd_compress.tools.nodesrun``); return per-rank results."""
    cmd = [sys.executable, "-m", "hvd_compress.tools.nodesrun", "--nodes", str(nodes), "-np", str(np)]
    return _launch(cmd, np, target, kwargs, timeout, env)


def run_mpi(target: str, np: int = 2, kwargs: dict | None = None,
            timeout: float = DEFAULT_TIMEOUT, env: dict | None = None) -> list:
    """Run ``target`` under ``mpirun -np np`` (mpi4py workers); return per-rank results."""
    cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none"]
    return _launch(cmd, np, target, kwargs, timeout, env)


def run_horovod_elastic(target: str, hosts: str, np: int, min_np: int, max_np: int,
                        kwargs: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
                        env: dict | None = None) -> list:
    """Run ``target`` under elastic ``horovodrun -np np --min-np min_np --max-np max_np``
    (Gloo, on this machine's loopback).  The host discovery script prints the file
    ``$HVD_TEST_OUTDIR/hosts``, which starts as ``hosts`` (lines ``name:slots``; names
    that resolve to this machine, e.g. ``localhost`` and ``127.0.0.1``) and which the
    workers may rewrite (:func:`set_hosts`) to make workers leave or join.

    Returns the results of every worker process that returned, in no particular order:
    under elastic Horovod ranks change, so each worker names itself in its result (a
    worker Horovod removed from the job ends inside Horovod 0.28.1 and reports nothing).
    A worker's exception fails the launch even where the elastic job went on without
    it; so do a time-out and a non-zero exit."""
    with tempfile.TemporaryDirectory(prefix="hvd-test-") as outdir:
        Path(outdir, "kwargs.json").write_text(json.dumps(kwargs or {}))
        set_hosts(hosts, outdir)
        script = Path(outdir, "discover.sh")
        script.write_text(f"#!/bin/sh\ncat '{outdir}/hosts'\n")
        script.chmod(0o755)
        cmd = [*HOROVODRUN, "-np", str(np), "--min-np", str(min_np), "--max-np",
               str(max_np), "--host-discovery-script", str(script), "--network-interface",
               "lo", "--gloo", sys.executable, "-m", "tests.workers.entry", target]
        out = _run(cmd, outdir, np, timeout, env)
        if any(Path(outdir).glob("*.err")):
            raise LaunchError(_report(cmd, "a worker raised", out, outdir, np))
        results = [json.loads(p.read_text()) for p in sorted(Path(outdir).glob("worker*.json"))]
        if not results:
            raise LaunchError(_report(cmd, "no worker wrote a result", out, outdir, np))
        return results


def set_hosts(hosts: str, outdir: str | None = None) -> None:
    """Replace what :func:`run_horovod_elastic`'s discovery script prints (atomically)."""
    outdir = outdir or os.environ["HVD_TEST_OUTDIR"]
    tmp = Path(outdir, "hosts.tmp")
    tmp.write_text(hosts if hosts.endswith("\n") else hosts + "\n")
    os.replace(tmp, Path(outdir, "hosts"))


def run_script(script: str, args=(), np: int = 2, controller: str = "gloo",
               timeout: float = DEFAULT_TIMEOUT, env: dict | None = None) -> str:
    """Launch ``horovodrun -np np python script args...``; return its combined output.

    A non-zero exit or a time-out raises :class:`LaunchError` with the output."""
    cmd = [*HOROVODRUN, "-np", str(np), f"--{controller}", "-H", f"localhost:{np}",
           sys.executable, str(REPO / script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="hvd-test-") as outdir:
        return _run(cmd, outdir, np, timeout, env)


#: runs several scripts' command lines in one process (:func:`run_scripts_in_one_process`)
_CLI_RUNNER = """
import contextlib, io, json, os, runpy, sys
done = []
for script, argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    sys.argv, sys.path[0] = [script, *argv], os.path.dirname(script)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # as the interpreter maps it to an exit status
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=sys.stderr)
    done.append([code or 0, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(done))
"""


def run_scripts_in_one_process(calls, timeout: float = DEFAULT_TIMEOUT) -> list:
    """``python script argv...`` for each ``(script, argv)`` of ``calls``, one after another
    in one process (each as ``__main__``, its folder first on ``sys.path``, an exit by
    ``SystemExit`` mapped to the status the interpreter would give): for command lines that
    exit early (``--help``, usage errors) of scripts whose imports cost seconds.  Returns
    ``[(status, stdout, stderr)]`` in order."""
    proc = subprocess.run([sys.executable, "-c", _CLI_RUNNER], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          input=json.dumps([[str(REPO / script), list(map(str, argv))]
                                            for script, argv in calls]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout)]


#: one fresh process per thread count runs every registered program (below)
_DIGEST_RUNNER = """
import contextlib, io, json, sys
out = {}
for key, code in json.loads(sys.stdin.read()).items():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, key, "exec"), {"__name__": "__main__"})
    out[key] = printed.getvalue().strip()
print(json.dumps(out))
"""


class DigestsByThreads:
    """The thread-count independence checks of the compiled TensorFlow ops: what each
    program prints (a digest of its results; ``sys.argv[1]`` is the intra-op thread count it
    sets) per thread count, the fused ops on.  Tests of several modules register their
    programs at import (:meth:`add`); the first :meth:`digests` runs all of them, one after
    another, in one fresh process per thread count (each program sets the same count, which
    TensorFlow lets a process set again once it has run), not a process per program and
    count (importing TensorFlow costs 6.5 s a process).  The processes run at once: the
    1-thread one would leave a core idle (a count is the threads a process uses, whatever
    else runs beside it)."""

    def __init__(self, threads=(1, 2)):
        self.threads, self.codes, self.made = threads, {}, {}

    def add(self, key: str, code: str) -> None:
        self.codes[key] = code

    def digests(self, key: str) -> list[str]:
        """What program ``key`` printed, per thread count."""
        if key not in self.made:
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", HVD_COMPRESS_FUSED="1")
            pending = json.dumps({k: c for k, c in self.codes.items() if k not in self.made})
            def run(t):
                return subprocess.run([sys.executable, "-c", _DIGEST_RUNNER, str(t)], input=pending,
                                      capture_output=True, text=True, cwd=REPO, env=env,
                                      timeout=DEFAULT_TIMEOUT)
            with ThreadPoolExecutor(len(self.threads)) as pool:
                procs = list(pool.map(run, self.threads))
            per = []
            for proc in procs:
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
                per.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            self.made.update({k: [got[k] for got in per] for k in per[0]})
        return self.made[key]


#: the thread-count checks of the compiled TensorFlow ops (test_tensorflow_fused.py,
#: test_tensorflow_lowrank.py)
THREAD_DIGESTS = DigestsByThreads()


def run_many(launch, calls, **launch_kwargs) -> dict:
    """Run several worker bodies in one launch (tests/workers/many.py): ``launch`` is one of
    the launchers above (e.g. :func:`run_horovod`), ``calls`` a list of ``(key,
    "module:function", kwargs)``, run one after another in the same processes.  Returns
    ``{key: per-rank results}``, as the launcher would have returned for that body alone."""
    calls = [[key, target, dict(kwargs or {})] for key, target, kwargs in calls]
    results = launch("tests.workers.many:run", kwargs={"calls": calls}, **launch_kwargs)
    return {key: [r[key] for r in results] for key, _, _ in calls}


def shared_launches(plans: dict):
    """``results(group, key)``: ``key``'s per-rank results from ``group``'s one launch,
    where ``plans`` maps each group to ``(launch, calls, launch_kwargs)`` for
    :func:`run_many`.  A group launches when a test first asks for it (so a ``-k``
    selection launches only what it needs); a failed launch fails every test that asks,
    without launching again.  Meant for a ``scope="module"`` fixture."""
    made = {}

    def results(group, key):
        if group not in made:
            launch, calls, launch_kwargs = plans[group]
            try:
                made[group] = run_many(launch, calls, **launch_kwargs)
            except LaunchError as exc:
                made[group] = exc
        if isinstance(made[group], LaunchError):
            raise made[group]
        return made[group][key]
    return results


def write_cifar_batches(folder, images: int) -> None:
    """Six python-pickle batches of ``images`` images each (CIFAR-10's format), the pixels
    shifted by label: what the examples' CIFAR-10 readers are tested on."""
    import pickle

    import numpy as np
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, images)
        data = (rng.integers(0, 80, (images, 3072)) + labels[:, None] * 16).astype(np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels.tolist()}, f)
