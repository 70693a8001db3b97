"""qaccel's own keys in a rendezvous store that others may reach, sealed with a key only the run's ranks hold.

torch's stores have no access control: torchrun's listens on every interface, and any local user can open a
TCPStore on 127.0.0.1 and list, read and write every key (torch says to use them on trusted networks only). So
what qaccel reads there (a stop, a question where a rank is and its answer, a batch-size search's outcomes) is
sealed: a value is ``payload + tag``, the tag an HMAC-SHA256 of the key's full name and the payload under the
launch's key, checked before the value is used. A value that fails the check is ignored and counted, and the
session says so once. The tag binds the name (a value cannot be moved to another key) and is deterministic (a
compare-and-set can expect a sealed value). Values that tell something of the run (where a rank is: its stack
and source lines) are also encrypted, with a keystream of SHAKE-256 over the key and a fresh nonce, before they
are sealed (encrypt-then-MAC, all from hashlib).

The key never goes through the store: a plain launch's caller makes one per launch and hands it to its ranks
through the forkserver's pipe; ranks run in place (torchrun, srun, mpirun, ...) take rank 0's, sent over their
process group as it forms (``from_rank_0``): as private as the group's own traffic, which qaccel already trusts
with pickled objects.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qaccel.comm.stderr import write_stderr

KEY_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 16
POLL_S = 0.001  # the first wait between two looks at keys not all there; it doubles up to MAX_POLL_S
MAX_POLL_S = 0.05


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def from_rank_0(rank: int, device: torch.device) -> bytes:
    """A new key, rank 0's, on every rank of the default group: one broadcast of its bytes."""
    if rank == 0:
        data = torch.frombuffer(bytearray(new_key()), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(KEY_BYTES, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist())


class _Forgeries:
    """The values a session ignored; the first is reported once. Shared by a Sealed's clones and prefixes."""

    def __init__(self, rank: int, where: str) -> None:
        self.rank, self.where = rank, where
        self.count = 0
        self.seen: set[tuple[str, bytes]] = set()
        self.lock = threading.Lock()

    def note(self, name: str, value: bytes) -> None:
        with self.lock:
            if (name, value) in self.seen:
                return
            self.seen.add((name, value))
            self.count += 1
            first = self.count == 1
        if first:
            write_stderr(
                f"qaccel: rank {self.rank} ignored a value of {name!r} in the rendezvous store "
                f"({self.where}) that was not written by this run: someone else who can reach the store "
                "wrote it. qaccel ignores and counts any more (see docs/security.md).\n"
            )


class Sealed:
    """qaccel's keys under ``prefix`` in ``store``, sealed with ``key`` (see the module's doc)."""

    def __init__(
        self, store: dist.Store, key: bytes, rank: int, prefix: str = "", forgeries: _Forgeries | None = None
    ) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self._mac = hmac.new(key, b"qaccel seal", hashlib.sha256).digest()
        self._stream = hmac.new(key, b"qaccel stream", hashlib.sha256).digest()
        self.forgeries = forgeries or _Forgeries(rank, _describe(store))
        self._key = key

    @property
    def ignored(self) -> int:
        """How many values this session ignored because they failed the check."""
        return self.forgeries.count

    def under(self, prefix: str) -> Sealed:
        """The same store and key, for the keys under ``prefix`` (a use of one session)."""
        return Sealed(self.store, self._key, self.rank, self.prefix + prefix, self.forgeries)

    def connection(self, timeout: datetime.timedelta) -> Sealed | None:
        """The same keys through a connection of its own, for a thread: its operations wait neither for the main
        thread's nor for another thread's. None for a store that cannot be cloned."""
        try:
            store = self.store.clone()  # pyright: ignore[reportAttributeAccessIssue] - torch's stubs lack Store.clone
            store.set_timeout(timeout)
        except Exception:  # noqa: BLE001
            return None
        return Sealed(store, self._key, self.rank, self.prefix, self.forgeries)

    def plain(self, name: str) -> dist.Store:
        """The raw store under ``name``, for torch's own use (the rendezvous of a new process group)."""
        return dist.PrefixStore(self.prefix + name, self.store)

    # ---- sealing ----

    def seal(self, name: str, value: bytes | str, secret: bool = False) -> bytes:
        payload = value.encode() if isinstance(value, str) else bytes(value)
        if secret:
            nonce = secrets.token_bytes(NONCE_BYTES)
            payload = nonce + _xor(payload, self._keystream(nonce, len(payload)))
        return payload + self._tag(name, payload)

    def open(self, name: str, sealed: bytes, secret: bool = False) -> bytes | None:
        """The payload of a value sealed for ``name`` by this run, or None (counted) for anything else."""
        payload, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
        short = len(sealed) < TAG_BYTES + (NONCE_BYTES if secret else 0)
        if short or not hmac.compare_digest(tag, self._tag(name, payload)):
            self.forgeries.note(self.prefix + name, sealed)
            return None
        if secret:
            nonce, payload = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
            payload = _xor(payload, self._keystream(nonce, len(payload)))
        return payload

    def _tag(self, name: str, payload: bytes) -> bytes:
        return hmac.new(self._mac, (self.prefix + name).encode() + b"\0" + payload, hashlib.sha256).digest()[:TAG_BYTES]

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        return hashlib.shake_256(self._stream + nonce).digest(size)

    # ---- the store's operations, on sealed values ----

    def set(self, name: str, value: bytes | str, secret: bool = False) -> None:
        # torch's stubs say str; the binding takes bytes too (as get returns them)
        self.store.set(self.prefix + name, self.seal(name, value, secret))  # pyright: ignore[reportArgumentType]

    def get(self, name: str, secret: bool = False) -> bytes | None:
        """The value of ``name``, waiting for it as the store's get does; None when it fails the check."""
        return self.open(name, self.store.get(self.prefix + name), secret)

    def value(self, name: str, secret: bool = False) -> bytes | None:
        """The value of ``name`` now, without waiting; None when it is not there or fails the check."""
        if not self.store.check([self.prefix + name]):
            return None
        return self.get(name, secret)

    def delete(self, name: str) -> None:
        self.store.delete_key(self.prefix + name)

    def set_first(self, name: str, value: bytes | str) -> bytes:
        """Set ``name`` unless this run set it already; its value then (the first writer's). A value someone else
        put there first is overwritten."""
        sealed = self.seal(name, value)
        # torch's stubs say str for the values; the binding takes bytes too
        current = self.store.compare_set(self.prefix + name, b"", sealed)  # pyright: ignore[reportArgumentType]
        kept = self.open(name, current)  # this run's, or None
        if kept is None:
            self.store.set(self.prefix + name, sealed)  # pyright: ignore[reportArgumentType] - bytes, as above
            return sealed[:-TAG_BYTES]
        return kept

    def gather(
        self, names: list[str], timeout: float, stop: Callable[[], bool] | None = None, secret: bool = False
    ) -> dict[str, bytes]:
        """The values of ``names`` this run wrote, once all of them are there; after ``timeout`` seconds, or once
        ``stop()`` says so, those that are there then. Values that fail the check are ignored (and waited past)."""
        full = [self.prefix + name for name in names]
        deadline, poll = time.monotonic() + timeout, POLL_S
        while True:
            done = time.monotonic() >= deadline or (stop is not None and stop())
            if self.store.check(full):
                found = self._opened(names, self.store.multi_get(full), secret)
                if len(found) == len(names) or done:
                    return found
            elif done:
                present = [name for name, key in zip(names, full) if self.store.check([key])]
                return self._opened(present, [self.store.get(self.prefix + name) for name in present], secret)
            time.sleep(poll)
            poll = min(poll * 2, MAX_POLL_S)

    def _opened(self, names: list[str], values: list[bytes], secret: bool) -> dict[str, bytes]:
        opened = {name: self.open(name, value, secret) for name, value in zip(names, values)}
        return {name: value for name, value in opened.items() if value is not None}


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


def _describe(store: Any) -> str:
    """Where the store is, in words, for the one message about forged values."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        return f"{inner.host}:{inner.port}"
    return type(inner).__name__
