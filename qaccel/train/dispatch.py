"""dispatch_batches=True: rank 0 alone reads a prepared DataLoader and sends every rank its batch.

Every rank gets the batch it would have read itself: dispatching changes who reads, not what a rank trains on. For
a map-style dataset rank 0's DataLoader loads every rank's batch of a step, in rank order, with its workers
prefetching as usual; the other ranks still walk their own shard's indices (cheap: no data is read), which gives
them their steps and the padding marks. For a stream, rank 0 reads it and deals the batches out a round at a time;
an incomplete last round is dropped, as when every rank reads the stream.

The batches travel point to point, not through a collective: in a step only some ranks take (even_batches=False)
the others are not there to join one.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from qaccel.comm.session import RankContext

if TYPE_CHECKING:
    from qaccel.train.shards import BatchShard


class AllRanks:
    """Rank 0's batch sampler: every rank's batch of each step of its shard's epoch, in rank order."""

    def __init__(self, shard: BatchShard) -> None:
        self.shard = shard
        self.takers: collections.deque[list[int]] = collections.deque()  # per step drawn: the ranks with a batch

    def __iter__(self) -> Iterator[list]:
        self.takers.clear()
        for batches in self.shard.rounds():
            takers = [rank for rank, batch in enumerate(batches) if batch is not None]
            self.takers.append(takers)
            for rank in takers:
                yield cast(list, batches[rank])  # a taker's batch is not None

    def __len__(self) -> int:
        return sum(self.shard.steps(rank) for rank in range(self.shard.world_size))


def deal(loaded: Iterator[Any], sampler: AllRanks) -> Iterator[Any]:
    """On rank 0: each step's loaded batches sent to their ranks; rank 0's own yielded (it takes every step)."""
    for item in loaded:
        takers = sampler.takers.popleft()  # drawn before the step's first batch was loaded
        batches = [item] + [next(loaded) for _ in takers[1:]]
        for rank, batch in zip(takers[1:], batches[1:]):
            _send((batch,), rank)
        yield batches[0]


def receive(indices: Iterator[list]) -> Iterator[Any]:
    """On the other ranks: rank 0's batch for each step of this rank's own shard."""
    for _ in indices:
        yield _receive()[0]


def deal_stream(loaded: Iterator[Any], ctx: RankContext) -> Iterator[Any]:
    """On rank 0: batch r of each round of N to rank r; then the end, to all (not when the loop is left early:
    every rank leaves it at the same step, having taken the same batches)."""
    round_: list = []
    for item in loaded:
        round_.append(item)
        if len(round_) < ctx.world_size:
            continue
        for rank in range(1, ctx.world_size):
            _send((round_[rank],), rank)
        yield round_[0]
        round_ = []
    for rank in range(1, ctx.world_size):
        _send((), rank)


def receive_stream() -> Iterator[Any]:
    """On the other ranks: rank 0's batches until it sends the end."""
    while message := _receive():
        yield message[0]


def _send(message: tuple[Any, ...], rank: int) -> None:
    dist.send_object_list([message], dst=rank)


def _receive() -> tuple:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=0)
    return box[0]
