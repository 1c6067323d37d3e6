"""Stopping a launcher and everything it started: signals turned into one exception, and
the processes below a launcher killed as a tree.

The launchers start their jobs in sessions of their own (``start_new_session=True``), so
a terminal's Ctrl-C reaches the launcher alone and the launcher decides what stops; and
the jobs start their workers in further sessions (``horovodrun``'s middlemen, the
simulated nodes' and capped links' workers).  Killing a job's process group therefore
misses its workers, which were left training, reparented to init.  Here:

* :func:`stop_signals`: the first SIGINT, SIGTERM or SIGHUP raises :class:`Stopped` (a
  KeyboardInterrupt) in the main thread; later ones are noted and not raised, so the
  clean-up that the first one started runs to its end;
* :func:`kill_tree`: every descendant of some processes, frozen (SIGSTOP: a frozen process
  forks no more) from the top down until no new one appears, then killed (SIGKILL) --
  whatever session each is in;
* :func:`become_subreaper`: orphans below this process are reparented to it rather than
  to init, so :func:`kill_tree` finds them (Linux ``PR_SET_CHILD_SUBREAPER``).

Linux: the tree is read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

__all__ = ["Stopped", "stop_signals", "kill_tree", "children", "become_subreaper", "reap"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_active: list = []  # the signals of the stop_signals() in force, outermost first


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (:func:`stop_signals`); ``signum`` says which.  The exit
    status of a program it stops is ``128 + signum`` (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stop_signals(signals=SIGNALS):
    """Inside: the first of ``signals`` raises :class:`Stopped`, the later ones are
    ignored (a second Ctrl-C does not break the clean-up).  A signal this process
    inherited as ignored stays ignored (``nohup``'s SIGHUP).  Nested uses, and uses
    outside the main thread, leave the handlers as they are."""
    if _active:
        yield _active[0]
        return
    got: list[int] = []

    def handler(signum, frame):
        got.append(signum)
        if len(got) == 1:
            raise Stopped(signum)

    old = {}
    try:
        for sig in signals:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        for sig, h in old.items():
            signal.signal(sig, h)
        yield got
        return
    _active.append(got)
    try:
        yield got
    finally:
        _active.clear()
        for sig, h in old.items():
            signal.signal(sig, h)


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process this one can see."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        out[int(name)] = (int(fields[1]), fields[0])
    return out


def children(pid: int, table: dict | None = None) -> list[int]:
    """The processes whose parent is ``pid``."""
    table = _table() if table is None else table
    return [p for p, (pp, _) in table.items() if pp == pid]


def _below(roots, table) -> set[int]:
    out, todo = set(), list(roots)
    while todo:
        for c in children(todo.pop(), table):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(roots, include_roots: bool = True, spare=()) -> set[int]:
    """Kill ``roots`` (with ``include_roots``) and all their descendants, in whatever
    session or process group; ``spare``: pids left alone with their own descendants.
    Returns the pids signalled.  Each round freezes the processes it found, so none of
    them starts another before the kill."""
    me = os.getpid()
    roots = [int(r) for r in roots if int(r) > 1]  # never pid 0 (all of init's) nor init
    frozen: set[int] = set()
    spare = set(spare) | {me}
    for _ in range(100):
        table = _table()
        found = {p for p in (set(roots) if include_roots else set()) | _below(roots, table)
                 if p in table and p not in spare and table[p][1] != "Z"}
        found -= {q for s in spare if s != me for q in _below([s], table)}
        new = found - frozen
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        frozen |= new
    for p in frozen:
        _signal(p, signal.SIGKILL)
    return frozen


def reap(pids=None, timeout: float = 2.0, spare=()) -> None:
    """Collect the exit status of this process's children among ``pids`` (killed ones:
    waiting up to ``timeout`` s for each to end), or, without ``pids``, of every child
    that has ended (orphans reparented here by :func:`become_subreaper`; call it where no
    ``subprocess.Popen`` of ours is still running, whose status it would take; ``spare``:
    children left to their owners)."""
    if pids is None:
        table = _table()
        pids = [p for p in children(os.getpid(), table) if table[p][1] == "Z" and p not in spare]
        timeout = 0.0
    deadline = time.monotonic() + timeout
    for p in pids:
        while True:
            try:
                if os.waitpid(p, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except (ChildProcessError, OSError):  # not our child, or already collected
                break
            time.sleep(0.01)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Make this process the one that orphans below it are reparented to (``on``), or no
    longer; False where the system cannot (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(bool(on)), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
