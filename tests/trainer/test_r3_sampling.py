"""R3Sampling in a fit: a tiny PINN (u' = cos x on [0, 1], u(0) = 0) whose fitness, the residual's size, releases
some of an R3Dataset's samples at each epoch's start. The training loader holds the same dataset, so it trains on the
new samples; on 2 gloo ranks rank 0 draws them and every rank ends with its features, the features and the trained
model those of one process (full batches: a rank's half-batch mean, averaged, is the whole batch's), and the verbose
line is printed once per call."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import qaccel.perceptrain
from qaccel.perceptrain.callbacks import Callback, R3Sampling
from qaccel.perceptrain.data import R3Dataset

N = 16
EPOCHS = 4  # epochs 0 to 4; the epoch-start callbacks run from epoch 1


class Draws:
    """Uniform points on [0, 1], each call from a generator seeded with ``seed`` + the calls so far: the same draws
    in one process and on rank 0."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def __call__(self, n: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + self.calls)
        self.calls += 1
        return torch.rand(n, 1, generator=generator, dtype=torch.float64)


def residual(x, model):
    x = x.detach().requires_grad_()
    u = model(x)
    (dudx,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    return (dudx - torch.cos(x)).squeeze(-1)


def fitness(x, model):
    return residual(x, model).abs().detach()


def pinn_loss(batch, model):
    return (residual(batch, model) ** 2).mean() + model(torch.zeros(1, 1, dtype=torch.float64)).pow(2).sum(), {}


class SaveFeatures(Callback):
    """At the fit's end each rank saves its dataset's features, to compare the ranks."""

    def __init__(self, dataset: R3Dataset, folder) -> None:
        super().__init__(on="train_end")
        self.dataset, self.folder = dataset, folder

    def run_callback(self, trainer, config, writer) -> None:
        torch.save(self.dataset.features, self.folder / f"features_{trainer.accelerator.rank}.pt")


def _fit(tmp_path, nprocs):
    """A fit on ``nprocs`` ranks; their output comes through this process (rank_prefix), where capfd reads it
    whichever test started the ranks' server."""
    folder = tmp_path / str(nprocs)
    folder.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    dataset = R3Dataset(Draws(1), N, release_threshold=0.35)
    initial = dataset.features.clone()
    config = qaccel.perceptrain.TrainConfig(
        max_iter=EPOCHS,
        log_folder=folder / "log",
        nprocs=nprocs,
        compute_setup="cpu",
        verbose=False,
        rank_prefix=nprocs > 1,
        callbacks=[R3Sampling(dataset, fitness, verbose=True), SaveFeatures(dataset, folder)],
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.002)
    qaccel.perceptrain.Trainer(model, optimizer, config, pinn_loss, DataLoader(dataset, batch_size=N // nprocs)).fit()
    features = [torch.load(folder / f"features_{rank}.pt") for rank in range(nprocs)]
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return initial, features, params


def _released_lines(out):
    return [line.removeprefix("[rank 0] ") for line in out.splitlines() if "num. released:" in line]


def test_r3_sampling_redraws_the_unfit_samples_the_loader_trains_on(tmp_path, capfd):
    initial, (features,), _ = _fit(tmp_path, 1)
    lines = _released_lines(capfd.readouterr().out)
    assert lines[0] == "Epoch 1; num. retained:    12; num. released:     4", "perceptrain's line"
    assert len(lines) == EPOCHS
    changed = int((features != initial).sum())
    assert 0 < changed < N, "some samples released and redrawn, some retained"


@pytest.mark.timeout(180)
def test_r3_sampling_on_two_ranks_gives_every_rank_rank_0s_samples(tmp_path, capfd):
    _, (one,), one_params = _fit(tmp_path, 1)
    one_lines = _released_lines(capfd.readouterr().out)
    initial, features, params = _fit(tmp_path, 2)
    lines = _released_lines(capfd.readouterr().out)
    assert lines == one_lines, "rank 0 alone prints, once per call, the counts of one process"
    assert torch.equal(features[0], features[1]), "every rank holds rank 0's samples"
    assert not torch.equal(features[0], initial)
    torch.testing.assert_close(features[0], one, atol=1e-12, rtol=0)
    torch.testing.assert_close(params, one_params, atol=1e-10, rtol=0)
