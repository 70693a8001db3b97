"""Callbacks that perceptrain has beside qadence's: LRSchedulerReduceOnPlateau in a real fit (its rates, its
messages, its mode "max", its state carried into a second fit through the checkpoints) and WritePlots, the
name perceptrain gives PlotMetrics."""

from __future__ import annotations

import logging

import pytest
import torch

from qaccel import TrainConfig, Trainer
from qaccel.callbacks import Callback, LivePlotMetrics, LRSchedulerReduceOnPlateau, PlotMetrics, WritePlots

pytestmark = pytest.mark.timeout(120)


def _flat(model, batch):
    """A loss that never improves: 1.0 (the model's parameters take part, with no gradient to follow)."""
    return (model(torch.zeros(1, 1)) * 0).sum() + 1.0, {}


def _rising(model, batch):
    """A loss that grows by 1 per call: an improvement for mode="max"."""
    _rising.calls += 1
    return (model(torch.zeros(1, 1)) * 0).sum() + float(_rising.calls), {}


_rising.calls = 0


def _fit(tmp_path, loss_fn, plateau, max_iter, **fields):
    """A 1-process fit; returns the rate after each epoch (a callback after the plateau's) and the trainer."""
    rates: list[float] = []
    noted = Callback(
        "train_epoch_end", 1, lambda trainer, config, writer: rates.append(trainer.optimizer.param_groups[0]["lr"])
    )
    model = torch.nn.Linear(1, 1)
    config = TrainConfig(
        max_iter=max_iter,
        compute_setup="cpu",
        log_folder=tmp_path / "run",
        verbose=False,
        callbacks=[plateau, noted],
        **fields,
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config, loss_fn)
    trainer.fit()
    return rates, trainer


def test_a_plateau_reduces_the_rate_every_patience_calls_down_to_min_lr_and_says_so(tmp_path, caplog):
    plateau = LRSchedulerReduceOnPlateau("train_epoch_end", patience=2, gamma=0.5, min_lr=0.02)
    with caplog.at_level(logging.INFO, logger="qaccel.trainer.callbacks"):
        rates, _ = _fit(tmp_path, _flat, plateau, max_iter=9)
    # epoch 1 sets the best (1.0); each later epoch is one more call without improvement
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.02, 0.02, 0.02])
    assert plateau.reached_minimum_lr
    said = [r.getMessage() for r in caplog.records if r.name == "qaccel.trainer.callbacks"]
    assert said == [
        "Loss has reached a plateau, reducing learning rate to 0.05",
        "Loss has reached a plateau, reducing learning rate to 0.025",
        "Learning rate has reached the minimum learning rate 0.02",
    ]


def test_mode_max_counts_a_rising_metric_as_improving(tmp_path):
    plateau = LRSchedulerReduceOnPlateau("train_epoch_end", patience=1, mode="max", verbose=False)
    rates, _ = _fit(tmp_path, _rising, plateau, max_iter=5)
    assert rates == [0.1] * 5, "the rate stays while train_loss rises"


def test_the_plateau_count_continues_in_a_second_fit_from_the_checkpoint(tmp_path):
    plateau = LRSchedulerReduceOnPlateau("train_epoch_end", patience=3, gamma=0.5, verbose=False)
    rates, _ = _fit(tmp_path, _flat, plateau, max_iter=3, checkpoint_every=1)
    assert rates == [0.1, 0.1, 0.1] and plateau.counter == 2
    fresh = LRSchedulerReduceOnPlateau("train_epoch_end", patience=3, gamma=0.5, verbose=False)
    more, _ = _fit(tmp_path, _flat, fresh, max_iter=5, checkpoint_every=1)
    assert more == [0.05, 0.05], "epoch 4 is the third call without improvement, counted over both fits"


def test_a_metric_it_cannot_find_is_named_with_those_there(tmp_path):
    plateau = LRSchedulerReduceOnPlateau("train_epoch_end", monitor="val_loss")
    with pytest.raises(ValueError, match=r"monitors 'val_loss', which is not among the metrics at train_epoch_end"):
        _fit(tmp_path, _flat, plateau, max_iter=2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "up"}, "mode must be 'min' or 'max'; got 'up'"),
        ({"gamma": -0.5}, "gamma must be a number >= 0; got -0.5"),
        ({"patience": 0}, "patience"),
    ],
)
def test_bad_arguments_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        LRSchedulerReduceOnPlateau("train_epoch_end", **fields)


def test_write_plots_is_plot_metrics():
    assert WritePlots is PlotMetrics


def test_live_plot_metrics_hands_rank_0s_metrics_to_livelossplot_every_call(tmp_path):
    live = LivePlotMetrics("train_epoch_end", 2, arrange={"losses": ["train_loss"]})
    _fit(tmp_path, _flat, live, max_iter=4)
    history = live.plot.logger.log_history
    assert [entry.step for entry in history["train_loss"]] == [2, 4]
    assert [entry.value for entry in history["train_loss"]] == [1.0, 1.0]
    assert live.plot.logger.groups == {"losses": ["train_loss"]}


def test_live_plot_every_makes_the_live_plot_at_the_training_epochs_end(tmp_path):
    noted = Callback("train_epoch_end", 1, lambda trainer, config, writer: None)
    model = torch.nn.Linear(1, 1)
    config = TrainConfig(
        max_iter=4,
        compute_setup="cpu",
        log_folder=tmp_path / "run",
        verbose=False,
        live_plot_every=2,
        callbacks=[noted],
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config, _flat)
    trainer.fit()
    [live] = [c for c in trainer._callbacks if isinstance(c, LivePlotMetrics)]
    assert (live.on.value, live.called_every) == ("train_epoch_end", 2)
    assert [entry.step for entry in live.plot.logger.log_history["train_loss"]] == [2, 4]
