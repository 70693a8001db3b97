"""DataLoader sharding: each rank gets a disjoint share of the user's batches, reshuffled in step every epoch.

Sharding is per batch, as in Accelerate. The user's own batch sampler (their sampler, batch size and drop_last)
yields global batches B0, B1, ...; rank r takes B[r], B[r+N], B[r+2N], ... One step of N ranks therefore covers
the samples one step of a single process with batch N·b would, in the same global order: that is what makes
training equivalent and gather_for_metrics exact. When the batches do not divide by N, the last round is
completed with batches from the start of the epoch (drop_last=False) or dropped (drop_last=True), so every rank
takes the same number of batches, as DDP requires.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from qaccel.comm.session import RankContext
from qaccel.options import count

if TYPE_CHECKING:
    from qaccel.train.registry import Registry
from qaccel.train import batch, dispatch, loaders, seeding, stopping, uneven
from qaccel.train.shards import BatchShard

# DataLoader arguments carried over as they are; batch_size, shuffle, sampler and drop_last live in the batch sampler.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)

_END = object()  # marks an exhausted iterator (a batch may be None)


class PreparedDataLoader(DataLoader):
    """The user's DataLoader rebuilt with the same arguments, yielding this rank's share on its device.

    Every ``iter()`` is a new epoch: a shuffled order changes each epoch, the same on every rank, without
    ``set_epoch``. A user DistributedSampler is kept (its epoch advanced unless the user sets it); an
    IterableDataset is sharded by batch: each rank reads the stream and keeps every N-th batch.
    """

    def __init__(
        self,
        loader: DataLoader,
        ctx: RankContext,
        seed: int,
        registry: Registry,
        split_batches: bool = False,
        even_batches: bool = True,
        dispatch_batches: bool = False,
        seedable: bool = False,
        rng_types: tuple[str, ...] = ("generator",),
        place: bool = True,
    ) -> None:
        kwargs = {name: getattr(loader, name) for name in _CARRIED}
        dataset = loader.dataset
        self._registry = registry  # the session's: loop marks, optimizer updates, the stopper
        self._marks = registry.marks
        # The step boundaries and epoch starts of a loop that trains (an optimizer stepped in it) are the check points
        # where a signal may stop the run: the updates count seen at the last one, and whether this loader's loop
        # trains (evaluation loops don't, and may run on rank 0 alone, so they are no check points).
        self._seen = [0, False]
        self._device = ctx.device if place else None  # None: batches stay where the loader made them
        self._ctx = ctx
        self._rank, self._world = ctx.rank, ctx.world_size
        self._epoch = 0
        self._seed = seed
        # The order's source. Accelerate's default: the sampler's own generator (one seeded with ``seed`` for a
        # sampler without), given rank 0's state as each epoch starts (rng_types) and advanced by the draw, so that
        # re-seeding it re-orders. With use_seedable_sampler: a generator of our own, seeded with seed + epoch.
        ordering = _sampler_generator(loader)
        self._seedable = seedable
        self._generator = torch.Generator() if seedable or ordering is None else ordering
        if not seedable and ordering is None:
            self._generator.manual_seed(seed)
        self._follows = not seedable and _shuffles(loader)
        self._rng_types = tuple(t for t in rng_types if t != "generator" or self._follows)
        self._epoch_state: torch.Tensor | None = None  # the generator's state as the current epoch began
        self._shard: BatchShard | None = None
        self._user_sampler: DistributedSampler | None = None
        self._auto_epoch = 0
        # the user's batches (all ranks' together) the next epoch passes over: a position any world continues
        self._start = 0
        # [epoch, batches done] while an epoch is in progress; a list updated in place, since every attribute
        # assignment on a DataLoader goes through its Python __setattr__ (~0.4 us per batch)
        self._position: list[int] | None = None
        self._with_workers: weakref.WeakSet = weakref.WeakSet()  # iterators that started worker processes
        self._split = split_batches
        # dispatch.py: rank 0 reads for every rank (a world of one reads for itself)
        self._dispatch = dispatch_batches and ctx.world_size > 1
        self._all_ranks: dispatch.AllRanks | None = None
        if self._dispatch and isinstance(loader.sampler, DistributedSampler):
            raise ValueError(
                "dispatch_batches=True shares batches out itself; this DataLoader has a "
                "DistributedSampler of yours: leave the sampler out, or dispatch_batches off"
            )
        if split_batches and (isinstance(dataset, IterableDataset) or isinstance(loader.sampler, DistributedSampler)):
            what = "an IterableDataset" if isinstance(dataset, IterableDataset) else "a DistributedSampler of yours"
            raise ValueError(
                f"split_batches=True slices the batches of a map-style dataset; this DataLoader has "
                f"{what}: leave split_batches off for it"
            )
        if isinstance(dataset, IterableDataset):
            if isinstance(dataset, loaders.InfiniteTensorDataset):  # its order from the generator every rank shares
                dataset = copy.copy(dataset)
                dataset.generator = self._generator
            super().__init__(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
            self._iterable = True
            return
        self._iterable = False
        if loader.batch_sampler is None:
            raise ValueError("prepare() needs a DataLoader with batches (batch_size=None is not supported)")
        if isinstance(loader.sampler, DistributedSampler):
            self._user_sampler = loader.sampler
            self._auto_epoch = loader.sampler.epoch
            super().__init__(dataset, batch_sampler=loader.batch_sampler, **kwargs)
            return
        batch_sampler = _with_generator(loader.batch_sampler, self._generator)
        drop_last = bool(getattr(batch_sampler, "drop_last", loader.drop_last))
        self._shard = BatchShard(batch_sampler, ctx.rank, ctx.world_size, drop_last, split_batches, even_batches)
        if self._dispatch and ctx.rank == 0:
            self._all_ranks = dispatch.AllRanks(self._shard)
            kwargs["in_order"] = True  # each step's batches are dealt out in the order they were drawn
        super().__init__(dataset, batch_sampler=self._all_ranks or self._shard, **kwargs)
        # Report the user's settings, not the placeholders DataLoader sets when given a batch_sampler.
        object.__setattr__(self, "batch_size", loader.batch_size)
        object.__setattr__(self, "drop_last", drop_last)
        object.__setattr__(self, "sampler", getattr(batch_sampler, "sampler", loader.sampler))

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or outside a loop the one the next loop runs (after load_state(), the saved
        one): ``for epoch in range(loader.epoch, epochs)`` resumes where a run stopped."""
        return self._position[0] if self._position is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch ``epoch``; with use_seedable_sampler that also gives it epoch ``epoch``'s
        order (otherwise the order follows the generator, which load_state_dict() restores)."""
        self._epoch = epoch

    def skip_first_batches(self, num_batches: int) -> None:
        """Pass over this rank's first ``num_batches`` of the next epoch (every rank's, as all ranks call it) without
        loading them (or, for a stream or a user DistributedSampler, loading and dropping them)."""
        count("num_batches", num_batches, 0)
        self._start = num_batches * self._unit

    @property
    def _unit(self) -> int:
        """The user's batches one step of all ranks takes (a DistributedSampler of the user's: this rank's own)."""
        if self._shard is not None:
            return self._shard.unit
        return 1 if self._user_sampler is not None else self._world

    @property
    def batches_to_skip(self) -> int:
        """This rank's batches the next epoch passes over (skip_first_batches, load_state_dict); ``len()`` still
        counts them, so a progress bar starts there."""
        return self._start // self._unit

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: its shuffling seed, the epoch, and the batches done to resume at: this rank's
        (``batches``) and, world-independent, the user's batches every rank's steps took together (``done``); when
        the order follows the sampler's generator, that generator's state as the epoch began (or the next will)."""
        shape = {"world_size": self._world, "batch_size": self.batch_size, "split_batches": self._split}
        if self._follows:
            started = self._epoch_state if self._position is not None else None  # an epoch is running
            state = started if started is not None else self._generator.get_state()
            shape["generator"] = state.numpy().tobytes()  # bytes: a state_dict stays comparable with ==
        if self._position is None:
            return {"seed": self._seed, "epoch": self._epoch, "batches": 0, "done": 0, **shape}
        epoch, start, steps = self._position
        done = start + steps * self._unit
        if self._shard is not None:
            done = min(done, len(self._shard.batch_sampler))  # a padded last step takes fewer
        return {"seed": self._seed, "epoch": epoch, "batches": start // self._unit + steps, "done": done, **shape}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a state_dict(): same seed, same epoch, the batches done passed over; one saved by another
        number of ranks continues where they stopped together (not with a DistributedSampler of yours, which
        shards for the world it was made for)."""
        self.check_state_dict(state)
        self._seed = int(state["seed"])
        if self._follows and state.get("generator") is not None:
            self._generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        self.set_epoch(int(state["epoch"]))
        if "done" not in state:  # written before positions were recorded for any world
            self._start = int(state["batches"]) * self._unit
            return
        self._start = int(state["done"])

    def check_state_dict(self, state: dict[str, int]) -> None:
        """ValueError if this loader cannot continue where ``state`` stopped (checked before anything loads)."""
        saved_world = int(state.get("world_size", self._world))
        if saved_world != self._world and self._user_sampler is not None:
            raise ValueError(
                f"this DataLoader's DistributedSampler of yours shards for {self._world} ranks, and its "
                f"checkpoint was written by {saved_world}: it cannot continue the interrupted epoch; "
                "leave the sampler to prepare() to resume on another number of ranks"
            )

    @property
    def shard(self) -> BatchShard | None:
        """This rank's share of the user's batch sampler (None for a stream or a DistributedSampler of the user's)."""
        return self._shard

    def __len__(self) -> int:
        if self._iterable:
            return super().__len__() // self._world
        return super().__len__() if self._shard is None else len(self._shard)

    def __iter__(  # pyright: ignore[reportIncompatibleMethodOverride] - a generator, not a _BaseDataLoaderIter
        self,
    ) -> Iterator[Any]:
        registry, seen = self._registry, self._seen
        if registry.stopper is not None and seen[1]:
            seen[0] = registry.updates
            registry.stopper.boundary()  # an epoch of a loop that trains starts: may save and raise Preempted
        if not seen[1]:
            seen[0] = registry.updates
        epoch, self._epoch = self._epoch, self._epoch + 1
        if self._seedable:
            self._generator.manual_seed(self._seed + epoch)
        if self._rng_types and self._world > 1:
            seeding.synchronize_rng_states(self._rng_types, self._generator, self._ctx)
        if self._follows:
            self._epoch_state = self._generator.get_state()
        sampler = self._user_sampler
        if sampler is not None and sampler.epoch == self._auto_epoch:
            sampler.set_epoch(epoch)
            self._auto_epoch = epoch
        start, self._start = self._start, 0
        if self._shard is not None:
            self._shard.start = start
        rng = torch.get_rng_state() if start else None
        batches = self._batches(start)
        if rng is not None:
            # Creating the iterator draws a seed from the global RNG. The interrupted run drew it when this epoch
            # began, before the RNG states were saved, so a resumed epoch must not draw again.
            torch.set_rng_state(rng)
        position = self._position = [epoch, start, 0]  # epoch, the user's batches passed over, steps since
        shard, device, marks = self._shard, self._device, self._marks
        ragged = uneven.Epoch.of(shard, registry, self._ctx, start)
        outer = marks.remainder, marks.end_of_epoch, marks.padding, marks.loader, marks.steps  # of an outer loop
        marks.loader, marks.steps = self, None if ragged is None else ragged.steps
        try:
            with contextlib.nullcontext() if ragged is None else ragged.joined():
                upcoming = next(batches, _END)
                step = 0
                while upcoming is not _END:
                    item, upcoming = upcoming, next(batches, _END)  # one batch ahead: which batch ends the epoch
                    marks.remainder = shard.padded.get(step) if shard is not None else None
                    marks.padding = shard.padding.get(step, 0) if shard is not None else 0
                    marks.end_of_epoch = upcoming is _END
                    lone = ragged is not None and ragged.mark(step)
                    step += 1
                    position[2] = step
                    yield item if device is None else batch.prepare_batch(item, device, None)
                    # the step's body is done: a stop agreed by every rank may save and raise Preempted here
                    if registry.stopper is not None and registry.updates != seen[0] and not lone:
                        seen[0], seen[1] = registry.updates, True
                        registry.stopper.boundary()
        finally:
            marks.remainder, marks.end_of_epoch, marks.padding, marks.loader, marks.steps = outer
            self._position = None

    def _batches(self, start: int) -> Iterator[Any]:
        """This rank's batches of the epoch: read here, or received from rank 0 (dispatch_batches)."""
        if self._dispatch and self._rank > 0:
            # what creating a DataLoader iterator draws, so that every rank's RNG goes on as without dispatching
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            if self._iterable:
                return dispatch.receive_stream()
            # a map-style loader dispatching has a shard: dispatch_batches refuses a DistributedSampler
            return dispatch.receive(iter(cast(BatchShard, self._shard)))
        with stopping.held():  # workers start with the armed signals held until they ignore them
            batches = super().__iter__()
        if hasattr(batches, "_shutdown_workers"):
            self._with_workers.add(batches)
        if self._all_ranks is not None:
            return dispatch.deal(batches, self._all_ranks)
        if self._iterable:
            batches = itertools.islice(batches, start, None)
            if self._dispatch:
                return dispatch.deal_stream(batches, self._ctx)
            return _every_nth(batches, self._rank, self._world)
        if self._shard is None and start:  # a DistributedSampler of the user's: this rank's own batches
            batches = itertools.islice(batches, start, None)
        return batches

    @property
    def remainder(self) -> int:
        """Accelerate's ``remainder``: the dataset's length modulo the batch of all ranks together; -1 with
        ``drop_last`` or for a stream."""
        if self._iterable or self.drop_last or self.batch_size is None:
            return -1
        # torch's Dataset declares no __len__ (a dataset without one raises TypeError here)
        return len(cast(Sized, self.dataset)) % (self.batch_size * (1 if self._split else self._world))

    def release(self) -> None:
        """At the session's end: stop the workers this loader still has (persistent ones, or those of an epoch left
        unfinished) and give it back its own ``worker_init_fn``. Its workers ignore the signals resume() armed, so
        past the session nothing would stop them: multiprocessing's exit handler, which ends a process's children
        with SIGTERM, would wait for them forever. A later epoch starts new workers."""
        for iterator in list(self._with_workers):
            iterator._shutdown_workers()  # what the iterator's __del__ does: tell the workers to end, join them
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():  # did not end in time, and ignores the SIGTERM torch sent: kill it
                    worker.kill()
                    worker.join()
        self._with_workers.clear()
        self._iterator = None
        stopping.unshield_workers(self)


def _with_generator(batch_sampler: Any, generator: torch.Generator) -> Any:
    """Copies of the batch sampler and its sampler drawing from ``generator``, so all ranks draw alike.

    The user's own objects are left untouched; samplers without a generator (sequential) are used as they are.
    """
    inner = getattr(batch_sampler, "sampler", None)
    if inner is None or not hasattr(inner, "generator"):
        return batch_sampler
    inner = copy.copy(inner)
    inner.generator = generator
    batch_sampler = copy.copy(batch_sampler)
    batch_sampler.sampler = inner
    return batch_sampler


def _every_nth(batches: Iterator[Any], rank: int, world_size: int) -> Iterator[Any]:
    """Batch rank, rank+N, ... of a stream; an incomplete last round is dropped so all ranks stop together."""
    round_: list = []
    for item in batches:
        round_.append(item)
        if len(round_) == world_size:
            yield round_[rank]
            round_ = []


def shared_seed(loader: DataLoader, seedable: bool = False, data_seed: int | None = None) -> int:
    """This rank's shuffling seed (rank 0's is broadcast), as Accelerate takes it. With ``seedable``, epoch ``e``
    shuffles with seed + e: ``data_seed``, else torch's initial seed. Otherwise the order follows the sampler's
    generator, and the seed seeds one for a random sampler that has none, drawn from torch's global RNG (nothing is
    drawn for an unshuffled loader); it also derives every rank's RNG states when a checkpoint resumes on another
    world."""
    if seedable:
        return data_seed if data_seed is not None else torch.initial_seed()
    generator = _sampler_generator(loader)
    if generator is not None:
        return generator.initial_seed()
    return int(torch.empty((), dtype=torch.int64).random_().item()) if _shuffles(loader) else 0


def _shuffles(loader: DataLoader) -> bool:
    """Whether the loader's order is drawn from a generator: a sampler that has one (RandomSampler, also with
    ``generator=None``), or qaccel's InfiniteTensorDataset."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    return hasattr(sampler, "generator") or isinstance(loader.dataset, loaders.InfiniteTensorDataset)


def _sampler_generator(loader: DataLoader) -> torch.Generator | None:
    """The generator the loader's (random) sampler draws its order from, if it has one of its own."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    return getattr(sampler, "generator", None)
