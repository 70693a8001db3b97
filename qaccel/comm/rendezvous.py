"""Fail within seconds on a rendezvous address that cannot work, instead of every rank retrying it for the whole
timeout while torch prints ``gai error`` warnings: a host that does not resolve (on every rank), and on the rank that
hosts the store (rank 0, unless the launcher's agent hosts it), a host that is not this machine.

A rank whose connections are refused keeps trying, as torch does: rank 0 may simply not be up yet.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

from qaccel.errors import RendezvousError

_FIX = ("set MASTER_ADDR (and MASTER_PORT) to a name or address of rank 0's node that every node resolves, e.g. its "
        "IP address: export MASTER_ADDR=$(hostname -I | cut -d' ' -f1) on rank 0's node")


@functools.cache
def check(host: str, port: int, source: str, rank: int, hosts_store: bool) -> None:
    """Raise RendezvousError when ``host`` does not resolve here, or when this rank hosts the store at ``host`` (rank
    0) and it is not an address of this machine; ``source`` says where the address came from. Once per process."""
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise RendezvousError(f"rank {rank} on {here}: the rendezvous host {host!r} (port {port}, from {source}) does "
                              f"not resolve here ({reason}); {_FIX}") from None
    if hosts_store and not any(_is_here(address) for address in addresses):
        resolved = "" if addresses == {host} else f" ({', '.join(sorted(addresses))})"
        raise RendezvousError(
            f"rank {rank} on {here} hosts the rendezvous at {host}:{port} (from {source}), but {host}{resolved} is "
            f"not an address of this machine: the other ranks would wait there for the whole timeout; {_FIX}")


def _is_here(address: str) -> bool:
    """Whether ``address`` is one of this machine's (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True
