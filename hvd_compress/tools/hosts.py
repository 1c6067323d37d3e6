"""Real hosts for ``hvd-compress-compare --hosts h1:4,h2:4`` (or ``--hostfile PATH``): the
hosts as ``horovodrun -H`` takes them, which of them a worker count fills, and which are
this machine.

``horovodrun`` gives ranks to the hosts in the order listed, filling each host's slots
before the next (:func:`layout`): ``-np 6`` on ``h1:4,h2:4`` is 4 workers on h1 and 2 on
h2.  A run's row records that layout (``hosts``) and its node count (``nodes``), so the
cost model sees the runs as the clusters they ran on.  ``horovodrun`` starts a host's
workers over ssh unless the host's name resolves to an address of this machine
(:func:`is_local`: ``localhost``, ``127.0.0.1``, this machine's hostname) -- two such
names make two "nodes" on one machine, which the tests use.
"""

from __future__ import annotations

__all__ = ["parse", "read_hostfile", "layout", "slots", "text_of", "is_local"]


def parse(text: str) -> list[tuple[str, int]]:
    """``h1:4,h2:4`` as ``[("h1", 4), ("h2", 4)]`` (a host without ``:slots`` has one, as
    in ``horovodrun -H``); ValueError for what horovodrun would refuse."""
    out = []
    for item in str(text).split(","):
        name, _, count = item.strip().partition(":")
        if not name or (count and not count.isdigit()) or (count and int(count) < 1):
            raise ValueError(f"--hosts {text!r}: expected host:slots[,host:slots...], e.g. h1:4,h2:4")
        out.append((name, int(count) if count else 1))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--hosts {text!r} names a host twice")
    return out


def read_hostfile(path: str) -> str:
    """A hostfile in horovodrun's format -- a line per host, ``hostname slots=N`` (blank
    lines and ``#`` comments skipped; no ``slots=``: one) -- as ``--hosts`` text."""
    try:
        with open(path) as f:
            lines = [line.split("#", 1)[0].split() for line in f]
    except OSError as exc:
        raise ValueError(f"--hostfile {path}: {exc.strerror or exc}") from None
    items = []
    for words in filter(None, lines):
        extra = dict(w.partition("=")[::2] for w in words[1:])
        count = extra.pop("slots", "1")
        if extra or not count.isdigit():
            raise ValueError(f"--hostfile {path}: expected lines 'hostname slots=N', got {' '.join(words)!r}")
        items.append(f"{words[0]}:{count}")
    if not items:
        raise ValueError(f"--hostfile {path} names no host")
    return ",".join(items)


def slots(hosts: list[tuple[str, int]]) -> int:
    return sum(n for _, n in hosts)


def layout(hosts: list[tuple[str, int]], np_: int) -> list[tuple[str, int]]:
    """The hosts ``np_`` ranks occupy and the workers on each, as horovodrun places them
    (in order, each host's slots filled before the next)."""
    if np_ > slots(hosts):
        raise ValueError(f"-np {np_} does not fit the hosts' {slots(hosts)} slots")
    out, left = [], np_
    for name, n in hosts:
        if left <= 0:
            break
        out.append((name, min(n, left)))
        left -= out[-1][1]
    return out


def text_of(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{name}:{n}" for name, n in hosts)


def is_local(name: str) -> bool:
    """Whether horovodrun starts this host's workers here, without ssh: its name resolves
    to an IPv4 address of one of this machine's interfaces (horovodrun's own test)."""
    from horovod.runner.util import network
    address = network.resolve_host_address(name)
    return address is not None and address in network.get_local_host_addresses()
