"""qadence's data helpers: ``DictDataLoader`` (several named loaders, one batch of each per step),
``InfiniteTensorDataset`` (samples drawn without end, reshuffled at every pass) and ``to_dataloader``; perceptrain's
``R3Dataset`` (samples that a fitness releases and redraws, for the ``R3Sampling`` callback) and
``GenerativeIterableDataset`` (a sample drawn from a distribution at every step).

They keep qadence's meaning, so a qadence script runs with its imports changed, and prepare() knows them: it
prepares each loader of a DictDataLoader, and an InfiniteTensorDataset draws its order from the prepared loader's
generator, shared by every rank and seeded per epoch, so the ranks read one stream (each keeps every N-th batch)
and a resumed epoch reads the stream it stopped in. A GenerativeIterableDataset is a stream too: each rank draws
from its own RNG and keeps every N-th batch, and an epoch takes ``max_batches`` batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import singledispatch
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset


@dataclass
class DictDataLoader:
    """A dict of DataLoaders iterated together: each step gives ``{name: batch of that loader}``; an epoch ends
    with the shortest loader (qadence's ``DictDataLoader``)."""

    dataloaders: dict[str, Any]
    iters: dict[str, Iterator[Any]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.dataloaders, dict) or not self.dataloaders:
            raise TypeError(
                f"DictDataLoader(dataloaders=...) takes a non-empty dict name -> DataLoader; got {self.dataloaders!r}"
            )

    def __iter__(self) -> DictDataLoader:
        self.close()
        self.iters = {name: iter(loader) for name, loader in self.dataloaders.items()}
        return self

    def __next__(self) -> dict[str, Any]:
        try:
            return {name: next(batches) for name, batches in self.iters.items()}
        except StopIteration:
            self.close()  # the longer loaders' epochs end here too (a prepared loader records where it is)
            raise

    def __len__(self) -> int:
        """Steps in an epoch: the shortest loader's length (TypeError when a loader has none, as a stream)."""
        return min(len(loader) for loader in self.dataloaders.values())

    @property
    def epoch(self) -> int:
        """The epoch of the first loader (prepared loaders all count alike)."""
        return next(iter(self.dataloaders.values())).epoch

    def close(self) -> None:
        """End the epoch under way of every loader (a generator's close; a plain DataLoader iterator is dropped)."""
        for batches in self.iters.values():
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        self.iters = {}


class InfiniteTensorDataset(IterableDataset):
    """Samples of ``tensors`` (indexed along their first dimension) without end: each iterator draws a random order
    and goes through it again and again (qadence's ``InfiniteTensorDataset``). The order is drawn from
    ``generator``, or from torch's global RNG; prepare() gives it the prepared loader's, the same on every rank and
    seeded per epoch, so each epoch has an order of its own."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("InfiniteTensorDataset(*tensors) takes one or more tensors")
        self.tensors = tensors
        self.indices = list(range(tensors[0].size(0)))
        self.generator: torch.Generator | None = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        sizes = {t.size(0) for t in self.tensors}
        if len(sizes) != 1:
            raise ValueError(f"InfiniteTensorDataset's tensors differ in their first dimension: {sorted(sizes)}")
        order = [self.indices[i] for i in torch.randperm(len(self.indices), generator=self.generator).tolist()]
        while True:
            for index in order:
                yield tuple(t[index] for t in self.tensors)


class R3Dataset(Dataset):
    """``n_samples`` features drawn by ``proba_dist(n)``, evolving as training goes (R3 sampling,
    https://arxiv.org/abs/2207.02338): ``update(fitness_values)`` releases the samples whose fitness is below
    ``release_threshold`` and puts new draws in their place (perceptrain's ``R3Dataset``). The ``R3Sampling``
    callback updates it at each training epoch's start."""

    def __init__(
        self, proba_dist: Callable[[int], torch.Tensor], n_samples: int, release_threshold: float = 0.1
    ) -> None:
        if release_threshold < 0.0:
            raise ValueError("Release threshold must be non-negative.")
        self.proba_dist = proba_dist
        self.n_samples = n_samples
        self.release_threshold = release_threshold
        self.features = proba_dist(n_samples)
        self._released: torch.Tensor | None = None
        self._released_indices: torch.Tensor | None = None
        self._resampled: torch.Tensor | None = None
        self.n_released: int = 0
        self.n_retained: int = 0

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.features[index]

    def _release(self, fitness_values: torch.Tensor) -> None:
        """Mark the samples whose fitness is below the threshold as released."""
        if len(fitness_values) != self.n_samples:
            raise ValueError("fitness_values must have the same length as the dataset")
        release_mask = fitness_values < self.release_threshold
        self._released_indices = torch.nonzero(release_mask).squeeze()  # can be empty
        self._released = self.features[self._released_indices]
        self.n_released = torch.numel(self._released_indices)
        self.n_retained = self.n_samples - self.n_released

    def _resample(self) -> torch.Tensor:
        """New draws for the released samples."""
        self._resampled = self.proba_dist(self.n_released)
        return self._resampled

    def update(self, fitness_values: torch.Tensor) -> None:
        """Release the samples whose fitness is below the threshold and replace them with new draws, in place."""
        self._release(fitness_values)
        if self.n_released > 0:
            new_samples = self._resample()
            with torch.no_grad():
                self.features[self._released_indices] = new_samples


class GenerativeIterableDataset(IterableDataset):
    """Samples without end, one ``proba_dist()`` per item (perceptrain's ``GenerativeIterableDataset``)."""

    def __init__(self, proba_dist: Callable[[], torch.Tensor]) -> None:
        self.proba_dist = proba_dist

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.proba_dist()


def to_dataloader(
    *tensors: torch.Tensor,
    batch_size: int = 1,
    infinite: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A DataLoader of ``tensors`` in batches of ``batch_size``: once through, in order (a TensorDataset), or,
    with ``infinite``, without end in random order (an InfiniteTensorDataset); ``collate_fn`` makes the batches
    (torch's ``default_collate`` when None)."""
    dataset = InfiniteTensorDataset(*tensors) if infinite else TensorDataset(*tensors)
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn)


def batches_per_epoch(loader: Any, max_batches: int | None) -> int:
    """The batches a Trainer's epoch takes from ``loader`` (qadence's rule): all of a loader with a length, at most
    ``max_batches``; from a stream (no length, e.g. an infinite loader) ``max_batches``, by default one."""
    try:
        length = len(loader)
    except TypeError:
        return max_batches or 1
    return length if max_batches is None else min(length, max_batches)


def data_to_device(xs: Any, *args: Any, **kwargs: Any) -> Any:
    """``xs`` (a tensor, list, dict, None, or a DataLoader, DictDataLoader or tensor dataset of them) with its tensors
    moved by ``.to(*args, **kwargs)`` (qadence's ``data_to_device``); a loader comes back rebuilt on its moved
    dataset, as qadence rebuilds it (default batching)."""
    return _to_device(xs, *args, **kwargs)


@singledispatch
def _to_device(xs: Any, *args: Any, **kwargs: Any) -> Any:
    raise ValueError(
        f"data_to_device cannot move a {type(xs).__name__} (a tensor, list, dict, None, DataLoader, "
        f"DictDataLoader or tensor dataset); got it with {args} {kwargs}"
    )


@_to_device.register(type(None))
def _(xs: None, *args: Any, **kwargs: Any) -> None:
    return None


@_to_device.register(torch.Tensor)
def _(xs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return xs.to(*args, **kwargs)


@_to_device.register(list)
def _(xs: list, *args: Any, **kwargs: Any) -> list:
    return [_to_device(x, *args, **kwargs) for x in xs]


@_to_device.register(dict)
def _(xs: dict[str, Any], *args: Any, **kwargs: Any) -> dict:
    return {key: _to_device(value, *args, **kwargs) for key, value in xs.items()}


@_to_device.register(DataLoader)
def _(xs: DataLoader, *args: Any, **kwargs: Any) -> DataLoader:
    return DataLoader(_to_device(xs.dataset, *args, **kwargs))


@_to_device.register(DictDataLoader)
def _(xs: DictDataLoader, *args: Any, **kwargs: Any) -> DictDataLoader:
    return DictDataLoader({key: _to_device(value, *args, **kwargs) for key, value in xs.dataloaders.items()})


@_to_device.register(InfiniteTensorDataset)
def _(xs: InfiniteTensorDataset, *args: Any, **kwargs: Any) -> InfiniteTensorDataset:
    return InfiniteTensorDataset(*[t.to(*args, **kwargs) for t in xs.tensors])


@_to_device.register(TensorDataset)
def _(xs: TensorDataset, *args: Any, **kwargs: Any) -> TensorDataset:
    return TensorDataset(*[t.to(*args, **kwargs) for t in xs.tensors])
