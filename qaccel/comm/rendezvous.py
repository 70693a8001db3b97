"""Fail within seconds on a rendezvous address that cannot work, instead of every rank retrying it for the whole
timeout while torch prints ``gai error`` warnings: a host that does not resolve (on every rank), and on the rank that
hosts the store (rank 0, unless the launcher's agent hosts it), a host that is not this machine.

A rank whose connections are refused keeps trying, as torch does, since rank 0 may simply not be up yet; but it says
so after a few seconds, and at the timeout raises naming the host, the port and where they came from.
"""

from __future__ import annotations

import errno
import functools
import socket
import sys
import time
from typing import cast

from qaccel.environment import node_name
from qaccel.errors import RendezvousError

_FIX = (
    "set MASTER_ADDR (and MASTER_PORT) to a name or address of rank 0's node that every node resolves, e.g. its "
    "IP address: export MASTER_ADDR=$(hostname -I | cut -d' ' -f1) on rank 0's node"
)


SAY_AFTER_S = 10.0  # refused this long, a rank says so (rank 0 is late, or the address is not rank 0's machine)
RETRY_S = 0.25


@functools.cache
def check(host: str, port: int, source: str, rank: int, hosts_store: bool, timeout: float) -> None:
    """Raise RendezvousError when ``host`` does not resolve here, when this rank hosts the store at ``host`` (rank
    0) and it is not an address of this machine, or when nothing answers there within ``timeout`` seconds;
    ``source`` says where the address came from. Once per process."""
    here = node_name()
    try:
        # an IPv4 or IPv6 address: a string (the stubs also allow the (int, bytes) of a family not asked for here)
        addresses = {cast(str, info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise RendezvousError(
            f"rank {rank} on {here}: the rendezvous host {host!r} (port {port}, from {source}) does "
            f"not resolve here ({reason}); {_FIX}"
        ) from None
    if hosts_store and not any(_is_here(address) for address in addresses):
        resolved = "" if addresses == {host} else f" ({', '.join(sorted(addresses))})"
        raise RendezvousError(
            f"rank {rank} on {here} hosts the rendezvous at {host}:{port} (from {source}), but {host}{resolved} is "
            f"not an address of this machine: the other ranks would wait there for the whole timeout; {_FIX}"
        )
    if not hosts_store:
        _wait_for_answer(host, port, source, f"rank {rank} on {here}", timeout)


def _wait_for_answer(host: str, port: int, source: str, who: str, timeout: float) -> None:
    """Until something listens at host:port (rank 0's store): said once after SAY_AFTER_S, raised at ``timeout``."""
    started = time.monotonic()
    said = False
    while True:
        waited = time.monotonic() - started
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, timeout - waited))).close()
            return
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            if waited >= timeout:
                raise RendezvousError(
                    f"{who}: nothing answered at the rendezvous {host}:{port} (from {source}) for "
                    f"{timeout:.0f} s ({reason}): rank 0 never hosted it there; {_FIX}"
                ) from None
            if not said and waited >= SAY_AFTER_S:
                said = True
                sys.stderr.write(
                    f"qaccel: {who} has waited {waited:.0f} s for the rendezvous at {host}:{port} (from "
                    f"{source}; {reason}): rank 0 is not up yet, or {host} is not its machine\n"
                )
                sys.stderr.flush()
        time.sleep(RETRY_S)


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
