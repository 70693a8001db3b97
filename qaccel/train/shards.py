"""A rank's share of the user's batches: which of the user's batch sampler's batches (or which slice of each) this
rank takes, padded so that every rank takes the same number. Its own module because the loader (data.py), the
dispatch of batches from rank 0 (dispatch.py) and uneven epochs (uneven.py) all read it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler


class BatchShard:
    """A batch sampler: this rank's share of the user's batch sampler, the same number of batches on every rank.

    By default rank r takes the user's batches r, r+N, ...; with ``split`` each of the user's batches is the step's
    batch of all ranks together, and rank r takes its r-th slice (Accelerate's ``split_batches``). A short last
    step is padded with the epoch's first samples, so that every rank takes the same number of full batches;
    with ``even=False`` it is not: ranks past its end take one step fewer (Accelerate's ``even_batches``).
    """

    def __init__(
        self, batch_sampler: Any, rank: int, world_size: int, drop_last: bool, split: bool = False, even: bool = True
    ) -> None:
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.split = split
        self.even = even
        if split:
            size = getattr(batch_sampler, "batch_size", None)
            if not isinstance(size, int) or size % world_size:
                raise ValueError(
                    f"split_batches=True takes a DataLoader whose batch_size (the batch of all ranks "
                    f"together) divides by the world size {world_size}; got batch_size={size!r}"
                )
        self.padded: dict[int, int] = {}  # step -> real samples in that gathered step (padded steps only)
        self.padding: dict[int, int] = {}  # step -> samples at the end of this rank's batch that are padding
        # the user's batches the next epoch passes over (resuming mid-epoch: the position in the epoch's global
        # stream of batches, which any world continues)
        self.start = 0

    @property
    def even_batches(self) -> bool:
        """Accelerate's name for ``even``."""
        return self.even

    def __len__(self) -> int:
        return self.steps(self.rank)

    def steps(self, rank: int, start: int = 0) -> int:
        """How many batches rank ``rank`` takes in an epoch, or in its rest from the user's batch ``start`` on."""
        batches = max(len(self.batch_sampler) - start, 0)
        if self.split:
            return batches - (
                not self.even and self._last_size() <= rank * self.batch_sampler.batch_size // self.world_size
            )
        if self.drop_last:
            return batches // self.world_size
        if self.even:
            return math.ceil(batches / self.world_size)
        return batches // self.world_size + (rank < batches % self.world_size)

    def _last_size(self) -> int:
        """Samples in the user's last batch when it is short (split mode), else the full batch size."""
        size = self.batch_sampler.batch_size
        sampler = getattr(self.batch_sampler, "sampler", None)
        if self.drop_last or sampler is None or not hasattr(sampler, "__len__"):
            return size
        return len(sampler) % size or size

    def __iter__(self) -> Iterator[list]:
        for batches in self.rounds():
            mine = batches[self.rank]
            if mine is not None:
                yield mine

    def rounds(self) -> Iterator[list[list | None]]:
        """Every rank's batch for each step of the epoch from ``start`` on (None for a rank that takes none),
        marking the padded steps (``padded``) and this rank's padding in them (``padding``), counted from there."""
        self.padded, self.padding = {}, {}
        start, self.start = self.start, 0
        source = self._slices(start) if self.split else self._batches(start)
        for step, (batches, real, padding) in enumerate(source):
            if real is not None:
                self.padded[step] = real
                if padding is not None and padding[self.rank]:  # given with ``real`` (_completed, _slices)
                    self.padding[step] = padding[self.rank]
            yield batches

    @property
    def unit(self) -> int:
        """The user's batches one step of all ranks takes."""
        return 1 if self.split else self.world_size

    def _batches(self, start: int = 0) -> Iterator[tuple[list, int | None, list[int] | None]]:
        """Rank r's batch is the user's batch r of each round of N, from batch ``start`` on. An incomplete last
        round, or one ending in a short batch, is completed (Accelerate's way) with the epoch's first samples, or
        left as it is."""
        n = self.world_size
        first: list = []
        round_: list = []
        held = None  # a complete round, yielded once a later batch shows it is not the epoch's last
        # batches passed over are drawn too, so that the later ones stay the same
        for index, global_batch in enumerate(self._global_batches()):
            if len(first) < n:
                first.append(global_batch)
            if index < start:
                continue
            if held is not None:
                yield held, None, None
                held = None
            round_.append(global_batch)
            if len(round_) == n:
                held, round_ = round_, []
        last = held if held is not None else round_
        if not last:
            return
        size = getattr(self.batch_sampler, "batch_size", None)
        complete = len(last) == n and (size is None or len(last[-1]) >= size or n == 1)  # one process: nothing to even
        if self.drop_last or not self.even or complete:
            if held is not None:
                yield held, None, None
            elif not self.drop_last and not self.even:
                yield last + [None] * (n - len(last)), None, None
            return
        yield self._completed(last, first, size)

    def _completed(self, last: list, first: list, size: int | None) -> tuple[list, int, list[int]]:
        """The last round filled up: a short last batch first, then whole batches for the ranks without one, from
        the epoch's first samples repeated (whole first batches when batches have no fixed size)."""
        n = self.world_size
        real = sum(len(b) for b in last)
        if size is None:
            filler = [first[i % len(first)] for i in range(n - len(last))]
            return last + filler, real, [0] * len(last) + [len(b) for b in filler]
        initial = [i for b in first for i in b]
        while len(initial) < n * size:
            initial += initial
        batches, padding = list(last), [0] * n
        used = size - len(last[-1])
        batches[-1] = list(last[-1]) + initial[:used]
        padding[len(last) - 1] = used
        for rank in range(len(last), n):
            batches.append(initial[used : used + size])
            padding[rank] = size
            used += size
        return batches, real, padding

    def _slices(self, start: int = 0) -> Iterator[tuple[list, int | None, list[int] | None]]:
        """Rank r's batch is the r-th slice of each of the user's batches from batch ``start`` on; a short last
        batch is filled up with the epoch's first samples, or its slices left short (and none for ranks past its
        end)."""
        size = self.batch_sampler.batch_size
        share = size // self.world_size
        starts = range(0, size, share)
        first: list = []
        for index, whole in enumerate(self._global_batches()):
            if not first:
                first = list(whole)
            if index < start:
                continue
            if len(whole) == size:
                yield [whole[start : start + share] for start in starts], None, None
            elif not self.even:
                yield [list(whole[start : start + share]) or None for start in starts], None, None
            else:
                real = len(whole)
                whole = list(whole) + [first[i % len(first)] for i in range(size - real)]
                padding = [share - min(max(real - start, 0), share) for start in starts]
                yield [whole[start : start + share] for start in starts], real, padding

    def _global_batches(self) -> Iterable[list]:
        """The user's batch sampler's batches, in its order.

        torch's own BatchSampler over a RandomSampler (what ``shuffle=True`` builds) yields consecutive slices of
        one random permutation. Slicing that permutation here gives the same batches without RandomSampler's
        index-by-index generator, which costs ~5 us a step, since every rank draws every rank's indices.
        """
        batch_sampler = self.batch_sampler
        sampler = getattr(batch_sampler, "sampler", None)
        if not (
            type(batch_sampler) is BatchSampler
            and type(sampler) is RandomSampler
            and not sampler.replacement
            and sampler.num_samples == len(sampler.data_source)
            and sampler.generator is not None
        ):
            return batch_sampler
        return _sliced(sampler.num_samples, batch_sampler.batch_size, batch_sampler.drop_last, sampler.generator)


def _sliced(samples: int, size: int, drop_last: bool, generator: torch.Generator) -> Iterator[list[int]]:
    """The batches BatchSampler(RandomSampler(...)) yields, drawing from ``generator`` as they do: one permutation,
    and, once asked for a batch past the last, the permutation RandomSampler starts for a remainder of none (so
    that the generator goes on as under torch's samplers: a script that re-seeds it sees the same orders)."""
    order = torch.randperm(samples, generator=generator).tolist()
    end = len(order) - len(order) % size if drop_last else len(order)
    yield from (order[start : start + size] for start in range(0, end, size))
    torch.randperm(samples, generator=generator)
