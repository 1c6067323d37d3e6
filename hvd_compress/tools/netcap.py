"""Capped links on one machine: a network namespace per worker, a bridge, ``tc``.

To measure compression where bandwidth is scarce without a cluster, each
worker runs in its own network namespace, joined to a bridge in the root
namespace by a veth pair whose two ends are shaped by ``tc`` (a token bucket
at ``rate``, optionally behind ``netem`` for added ``latency``), so every byte
Horovod moves between workers crosses a capped link.  Needs root and
``iproute2``; :func:`available` says whether this machine can.

How it was made to work (Horovod 0.28.1, Debian 12): workers are launched
without ``horovodrun`` -- Horovod's own rendezvous server runs in the root
namespace on the bridge address and each worker gets the environment
``horovodrun --gloo`` would give it.  Horovod 0.28.1 builds its process-set
Gloo context without the interface setting and resolves the machine's
hostname, which would land on loopback; a per-namespace ``/etc/netns/<ns>/hosts``
(mounted over ``/etc/hosts`` by ``ip netns exec``) maps the hostname to the
namespace's own address.  MPI cannot cross the namespaces (PMIx reaches its
daemon over loopback), so capped runs use Gloo.

Everything made is named with this process's id and removed by
:meth:`CappedNetwork.close` -- also on Ctrl-C or SIGTERM (the first one raises
:class:`~hvd_compress.tools.stopping.Stopped`, later ones wait for the clean-up) --
what a clean-up cut short left by :func:`remove_mine`, and leftovers of processes
that died by :func:`clean_stale`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess

from . import mwms
from .stopping import stop_signals
from .workers import stop, usable_cores, wait_all

PREFIX = "hvdc"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


#: the rates :func:`parse_rate` reads with ``unit=True``, in words (command-line messages)
RATE_FORMS = ("a number and its unit, in bits per second: 100mbit, 1gbit, 10gbit, 2.5gbit, "
              "500kbit (units bit, kbit, mbit, gbit, tbit; also written 1gbps, 1g or 1gbit/s)")


def parse_rate(text: str, unit: bool = False) -> float:
    """Bits per second from ``tc``-style text: ``100mbit``, ``1gbit``, ``2.5Gbit``, ``1e9``.
    ``unit``: a bare number (``5``, ``1e9``) is refused -- on a command line it is a unit
    forgotten, not 5 bit/s (:data:`RATE_FORMS`)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a rate like 100mbit, 1gbit, 10gbit")
    if unit and not (m.group(2) or m.group(3)):
        raise ValueError(f"bandwidth {text!r} has no unit; expected {RATE_FORMS}")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"bandwidth {text!r}: must be positive")
    return value


def parse_latency(text: str) -> float:
    """Seconds from ``5ms``, ``100us``, ``0.2s`` (a bare number is milliseconds)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"latency {text!r}: expected e.g. 1ms, 200us")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def available() -> tuple[bool, str]:
    """(True, "") when namespaces and tc can be used here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "capped links need root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"capped links need the '{tool}' command (Debian package iproute2)"
    return True, ""


def _run(*cmd, check=True):
    # in a session of its own: a Ctrl-C to our group must not cut a clean-up command short
    res = subprocess.run(list(cmd), capture_output=True, text=True, start_new_session=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


def our_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def our_links() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    """The pid that made a namespace or link of ours (its name holds it in base 36)."""
    m = re.match(rf"{PREFIX}[bnv]([0-9a-z]+?)(-\d+i?)?$", name)
    return int(m.group(1), 36) if m else None


def clean_stale() -> None:
    """Remove namespaces and links left by processes of ours that are gone."""
    for name in our_namespaces() + our_links():
        pid = _owner(name)
        if pid is not None and not _alive(pid):
            _remove(name)


def remove_mine() -> list[str]:
    """Remove every namespace and link this process made (what a :class:`CappedNetwork`
    whose clean-up was cut short left); the names removed."""
    mine = [n for n in our_namespaces() + our_links() if _owner(n) == os.getpid()]
    for name in mine:
        _remove(name)
    return mine


def _remove(name: str) -> None:
    if name in our_namespaces():
        _run("ip", "netns", "delete", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    else:
        _run("ip", "link", "delete", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)  # (a namespace never made)


class CappedNetwork:
    """``n`` namespaces, each worker's link capped at ``rate_bps`` each way.

    Use as a context manager; :meth:`exec_prefix` gives the command prefix that
    runs a program in worker ``i``'s namespace, :meth:`address` its address.
    """

    def __init__(self, n: int, rate_bps: float | None, latency_s: float = 0.0):
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        self.n, self.rate_bps, self.latency_s = n, rate_bps, latency_s
        pid = os.getpid()
        tag = _base36(pid)  # interface names are at most 15 characters
        self.subnet = f"10.213.{pid % 250}"
        self.bridge = f"{PREFIX}b{tag}"
        self.namespaces = [f"{PREFIX}n{tag}-{i}" for i in range(n)]
        self.veths = [f"{PREFIX}v{tag}-{i}" for i in range(n)]
        self._made: list[str] = []
        self._signals = contextlib.ExitStack()

    # -- set-up and tear-down ----------------------------------------------------------
    def __enter__(self) -> CappedNetwork:
        # SIGTERM/SIGHUP raise (once) so that close() runs; inside a caller's stop_signals
        # (hvd-compress-compare's), the caller's handlers stay
        self._signals.enter_context(stop_signals((signal.SIGTERM, signal.SIGHUP)))
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        clean_stale()
        self._made.append(self.bridge)  # named before it is made: a signal in between
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        host = socket.gethostname()
        for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths)):
            self._made.append(ns)
            _run("ip", "netns", "add", ns)
            inner = f"{veth}i"
            self._made.append(veth)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {host}\n")
            if self.rate_bps or self.latency_s:
                self._shape([], veth)  # toward the worker
                self._shape(["ip", "netns", "exec", ns], "eth0")  # from the worker

    def _shape(self, prefix: list, dev: str) -> None:
        parent = ["root"]
        if self.latency_s:
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", f"{self.latency_s * 1e6:.0f}us", "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate_bps:
            # A bucket of ~2 ms of traffic (at least 64 KB) keeps the rate smooth
            # without starving a TCP window; 100 ms of queue before drops.
            burst = max(65536, int(self.rate_bps / 8 * 0.002))
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf",
                 "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "100ms")

    def close(self) -> None:
        """Remove everything made (idempotent); safe to call from a signal handler path."""
        while self._made:
            _remove(self._made[-1])
            self._made.pop()
        self._signals.close()

    # -- using it ----------------------------------------------------------------------
    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]


def gloo_env(slot, addr: str, port: int, iface: str, threads: int) -> dict:
    """What ``horovodrun --gloo`` puts in a worker's environment for its ``slot`` (one of
    Horovod's host assignments), the rendezvous at ``addr:port``, the network interface
    Gloo uses, and the worker's share of this machine's cores."""
    return {"HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": iface, "PYTHONUNBUFFERED": "1",
            # the workers share this machine's cores, as under horovodrun -np n
            "HVD_COMPRESS_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}


def launch_horovod(net: CappedNetwork, command: list[str], env: dict | None = None,
                   log_path: str | None = None, timeout_s: float = 600.0, per_node: int = 1) -> int:
    """Run ``command`` as a Horovod Gloo job of ``net.n * per_node`` workers, ``per_node``
    in each namespace: a simulated cluster of ``net.n`` nodes whose links to each other
    are capped, while the workers of one node talk inside their namespace, uncapped.

    The environment is what ``horovodrun --gloo`` gives each worker, with one host per
    namespace (``worker<i>``: Horovod's local and cross ranks follow).  Output of all
    workers goes to ``log_path`` (prefixed by rank).  Returns the first non-zero exit
    code (0 when all succeed); a worker that fails or a time-out stops the others."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    n = net.n * per_node
    plan = get_host_assignments(parse_hosts(",".join(f"worker{i}:{per_node}"
                                                     for i in range(net.n))), n)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    threads = max(1, usable_cores() // n)
    log = open(log_path, "a") if log_path else subprocess.DEVNULL
    procs = []
    try:
        for slot in plan:
            wenv = dict(os.environ if env is None else env)
            wenv.update(gloo_env(slot, net.bridge_address, port, "eth0", threads))
            node = int(slot.hostname[len("worker"):])
            procs.append(subprocess.Popen(net.exec_prefix(node) + list(command), env=wenv,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        return wait_all(procs, timeout_s)
    finally:
        for p in procs:
            stop(p)
        server.stop()
        if log is not subprocess.DEVNULL:
            log.close()


MWMS_PORT = 23456  # each worker listens in its own namespace, at its own address


def launch_mwms(net: CappedNetwork, command: list[str], env: dict | None = None,
                log_path: str | None = None, timeout_s: float = 600.0) -> int:
    """Run ``command`` as ``net.n`` TensorFlow MultiWorkerMirroredStrategy workers
    (:mod:`.mwms`: ``TF_CONFIG`` naming every worker's address on the bridge), worker i
    in namespace i.  Output to ``log_path``; the first non-zero exit code, 124 on a
    time-out."""
    workers = [f"{net.address(i)}:{MWMS_PORT}" for i in range(net.n)]
    with open(log_path or os.devnull, "a") as log:
        return mwms.run(command, net.n, timeout=timeout_s, env=env, workers=workers,
                        prefix=net.exec_prefix, out=log)
