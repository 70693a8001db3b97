"""qadence's data helpers: a DictDataLoader prepared loader by loader on 2 real gloo ranks gives each rank its share
of every loader, each sample once an epoch; an InfiniteTensorDataset's ranks read one stream, its order drawn
from the prepared loader's generator (every rank's, seeded per epoch); a GenerativeIterableDataset's loader trains
``max_batches`` batches a rank each epoch, on one process and on 2 ranks; ``to_dataloader`` batches with a
``collate_fn``; the rule for batches per epoch; bad input fails naming what is allowed."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import qaccel
from qaccel import Accelerator, DictDataLoader, InfiniteTensorDataset, to_dataloader
from qaccel.callbacks import Callback
from qaccel.data import GenerativeIterableDataset
from qaccel.train.loaders import batches_per_epoch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def acc():
    return Accelerator(nprocs=2, compute_setup="cpu")


def _dict_epochs(acc, epochs):
    loader = DictDataLoader(
        {
            "a": DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2, shuffle=True),
            "b": DataLoader(TensorDataset(torch.arange(100.0, 108.0)), batch_size=1),
        }
    )
    loader = acc.prepare(loader)
    seen = []
    for _ in range(epochs):
        assert loader.epoch == len(seen)
        seen.append([(batch["a"][0].tolist(), batch["b"][0].tolist()) for batch in loader])
    return seen, len(loader), loader.epoch


def test_a_dict_of_loaders_gives_each_rank_its_share_of_every_loader_each_epoch(acc):
    per_rank = acc.distribute(_dict_epochs, all_results=True)(acc, 2)
    for seen, length, epoch in per_rank:
        assert length == 4 and epoch == 2, "the shorter loader's 4 steps a rank (8 batches of b over 2 ranks)"
        assert [len(steps) for steps in seen] == [4, 4]
    for epoch in range(2):
        a = sorted(x for seen, _, _ in per_rank for step in seen[epoch] for x in step[0])
        b = sorted(x for seen, _, _ in per_rank for step in seen[epoch] for x in step[1])
        assert a == [float(i) for i in range(16)], "each sample of a once"
        assert b == [100.0 + i for i in range(8)]
    assert per_rank[0][0][0] != per_rank[0][0][1], "a reshuffled each epoch"


def _stream(acc, epochs, batches):
    loader = acc.prepare(to_dataloader(torch.arange(12.0), batch_size=2, infinite=True))
    drawn = []
    for _ in range(epochs):
        drawn.append([batch[0].tolist() for batch in itertools.islice(loader, batches)])
    return drawn


def test_the_ranks_of_an_infinite_loader_read_one_stream_reshuffled_at_every_pass(acc):
    torch.manual_seed(1)  # the caller's RNG: the shared seed is drawn from rank 0's
    first, second = acc.distribute(_stream, all_results=True)(acc, 2, 6)
    for epoch in range(2):
        samples = [x for step in zip(first[epoch], second[epoch]) for batch in step for x in batch]
        assert sorted(samples[:12]) == sorted(samples[12:]) == [float(i) for i in range(12)], (
            "two whole passes in the ranks' steps together, no sample twice within one"
        )
    assert first[0] != first[1], "each epoch its own order"
    torch.manual_seed(1)
    assert acc.distribute(_stream, all_results=True)(acc, 2, 6) == [first, second], "the same seed, the same stream"


def _normal() -> torch.Tensor:
    return torch.randn(1)


def _mean_square(model, batch):
    return (model(batch) ** 2).mean(), {}


class _CountBatches(Callback):
    """Each rank counts its training batches in a file of its own."""

    def __init__(self, folder) -> None:
        super().__init__(on="train_batch_end")
        self.folder, self.batches = folder, 0

    def run_callback(self, trainer, config, writer) -> None:
        self.batches += 1
        (self.folder / f"rank{trainer.accelerator.rank}").write_text(str(self.batches))


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_generative_dataset_trains_max_batches_a_rank_each_epoch(tmp_path, nprocs):
    model = torch.nn.Linear(1, 1)
    config = qaccel.TrainConfig(
        max_iter=2, log_folder=tmp_path / "log", nprocs=nprocs, compute_setup="cpu", callbacks=[_CountBatches(tmp_path)]
    )
    loader = DataLoader(GenerativeIterableDataset(_normal), batch_size=4)
    trainer = qaccel.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), config, _mean_square, loader, max_batches=3
    )
    trainer.fit()
    assert [int((tmp_path / f"rank{rank}").read_text()) for rank in range(nprocs)] == [3 * 3] * nprocs, (
        "epochs 0 to 2, 3 batches each"
    )
    assert len(trainer.history) == 3


def test_to_dataloader_batches_with_its_collate_fn():
    loader = to_dataloader(torch.arange(5.0), batch_size=2, collate_fn=lambda samples: [x for (x,) in samples])
    assert [[float(x) for x in batch] for batch in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


def test_batches_per_epoch_follows_qadence():
    finite = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3)
    infinite = to_dataloader(torch.arange(10.0), batch_size=3, infinite=True)
    assert batches_per_epoch(finite, None) == 4 and batches_per_epoch(finite, 2) == 2
    assert batches_per_epoch(finite, 9) == 4
    assert batches_per_epoch(infinite, None) == 1 and batches_per_epoch(infinite, 5) == 5


def test_bad_input_fails_naming_what_is_allowed():
    with pytest.raises(TypeError, match="DictDataLoader\\(dataloaders=...\\) takes a non-empty dict"):
        DictDataLoader([])
    with pytest.raises(TypeError, match="InfiniteTensorDataset\\(\\*tensors\\) takes one or more tensors"):
        InfiniteTensorDataset([1, 2])
    with pytest.raises(ValueError, match="differ in their first dimension: \\[2, 3\\]"):
        next(iter(InfiniteTensorDataset(torch.zeros(2), torch.zeros(3))))
