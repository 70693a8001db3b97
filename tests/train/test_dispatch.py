"""dispatch_batches=True on real 2-rank gloo worlds: only rank 0 reads (its DataLoader workers included), and every
rank gets exactly the batches it reads itself without dispatching, so training is the same bitwise."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(180)


class Logged(Dataset):
    """Samples (id, x, y) of a regression; every read is logged in ``reads/rank<r>``, from any process."""

    def __init__(self, size, reads, rank):
        self.size, self.log = size, os.path.join(reads, f"rank{rank}")

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        with open(self.log, "a") as log:
            log.write(f"{i}\n")
        x = torch.tensor([i / self.size, (i % 7) / 7.0])
        return i, x, x.sum(0, keepdim=True) * 2


class LoggedStream(IterableDataset):
    def __init__(self, size, reads, rank):
        self.samples = Logged(size, reads, rank)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


def _train(acc, reads, size, stream=False, epochs=2, workers=2):
    os.makedirs(reads, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    dataset = (LoggedStream if stream else Logged)(size, reads, acc.rank)
    loader = DataLoader(
        dataset,
        batch_size=4,
        shuffle=not stream,
        num_workers=workers,
        generator=None if stream else torch.Generator().manual_seed(2),
    )
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    ids, steps = [], []
    for _ in range(epochs):
        steps.append(len(loader) if not stream else None)
        for i, x, y in loader:
            ids.append(i.tolist())
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return ids, steps, [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _same(a, b):
    assert a[0] == b[0] and a[1] == b[1], "the same batches, in the same order, on every rank"
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2])), "the same training, bitwise"


@pytest.mark.parametrize(
    "options", [{}, {"even_batches": False}, {"split_batches": True}], ids=["padded", "uneven", "split"]
)
def test_dispatched_batches_are_the_ones_each_rank_reads_itself_and_only_rank_0_reads(tmp_path, options):
    own = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, **options)
    dealt = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, dispatch_batches=True, **options)
    expected = own.distribute(_train, all_results=True)(own, str(tmp_path / "own"), 38)
    got = dealt.distribute(_train, all_results=True)(dealt, str(tmp_path / "dealt"), 38)
    for rank in range(2):
        _same(got[rank], expected[rank])
    assert sorted(os.listdir(tmp_path / "dealt")) == ["rank0"], "rank 1 read nothing"
    reads = (tmp_path / "dealt" / "rank0").read_text().split()
    assert len(reads) == len((tmp_path / "own" / "rank0").read_text().split()) + len(
        (tmp_path / "own" / "rank1").read_text().split()
    ), "rank 0 read what both read before, no more"


def test_a_dispatched_stream_deals_each_round_out_and_drops_an_incomplete_last_one(tmp_path):
    own = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    dealt = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, dispatch_batches=True)
    # one reader: with workers, each would yield the whole stream (a stream of one's own shards by worker)
    expected = own.distribute(_train, all_results=True)(own, str(tmp_path / "own"), 18, stream=True, workers=0)
    got = dealt.distribute(_train, all_results=True)(dealt, str(tmp_path / "dealt"), 18, stream=True, workers=0)
    for rank in range(2):
        _same(got[rank], expected[rank])
    assert [ids[:2] for ids, _, _ in got] == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert [len(ids) for ids, _, _ in got] == [4, 4], "5 batches an epoch: 2 rounds of 2, the 5th batch dropped"
    assert sorted(os.listdir(tmp_path / "dealt")) == ["rank0"]


def _resume(acc, folder, stop=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    os.makedirs(folder, exist_ok=True)
    loader = DataLoader(LoggedStream(40, folder, acc.rank), batch_size=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.resume(os.path.join(folder, "ckpt"))
    seen = []
    for epoch in range(loader.epoch, 2):
        for step, (i, x, y) in enumerate(loader):
            seen.append(i.tolist())
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if (epoch, step) == stop:
                acc.save_state()
                return None
    return seen, acc.unwrap_model(model).weight.detach().clone()


def test_a_dispatched_stream_resumes_mid_epoch_where_it_stopped(tmp_path):
    dealt = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, dispatch_batches=True)
    straight = dealt.distribute(_resume, all_results=True)(dealt, str(tmp_path / "a"))
    dealt.distribute(_resume)(dealt, str(tmp_path / "b"), stop=(1, 3))
    resumed = dealt.distribute(_resume, all_results=True)(dealt, str(tmp_path / "b"))
    for rank in range(2):
        assert resumed[rank][0] == straight[rank][0][-6:], "the last 6 of 10 steps of epoch 2"
        assert torch.equal(resumed[rank][1], straight[rank][1])


def test_dispatch_batches_is_a_flag_and_accelerates_configuration_sets_it():
    from types import SimpleNamespace as DataLoaderConfiguration

    assert Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).dispatch_batches
    assert not Accelerator(cpu=True).dispatch_batches
    with pytest.raises(TypeError, match="dispatch_batches must be True or False"):
        Accelerator(cpu=True, dispatch_batches="yes")
