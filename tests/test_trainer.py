"""The Trainer: fit() on 2 real gloo ranks from this process (a plain launch) returns what the ranks trained, equal
to one process with the doubled batch, to the same loop written by hand and to FSDP; metrics are tracked per epoch;
a fit continues its folder's checkpoints (after a second fit, a restart, or on fewer ranks); early stopping and a
callback's error end every rank; bad config values fail at construction naming the field.

Each fit is a launch of its own, so a test that needs several outputs of the same kind of fit reads them from one:
the progress bar, the per-batch writes, the curves and plots and a per-batch scheduler come from one fit; the
second fit, the restart and the fit on fewer ranks all end where one uninterrupted 2-rank fit of epochs 0 to 4 ends,
which runs once (``reference``). The MLflow store is read as files: importing mlflow in this process would put its
loggers' formatters (mlflow's classes) in every later launch of the process, and each rank would import mlflow."""

from __future__ import annotations

import csv
import datetime
import functools
import os
from pathlib import Path

import pytest
import torch
from support import component
from support.procs import once_per_session
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, TrainConfig, Trainer
from qaccel.callbacks import Callback, EarlyStopping

pytestmark = pytest.mark.timeout(240)


def _data(n=64):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.3 - 1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _config(tmp_path, **fields):
    values = {
        "max_iter": 3,
        "compute_setup": "cpu",
        "tracking_tool": "csv",
        "log_folder": tmp_path / "run",
        "verbose": False,
    }
    return TrainConfig(**{**values, **fields})


def _trainer(config, batch_size=8, **kwargs):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return Trainer(
        model,
        optimizer,
        config,
        "mse",
        DataLoader(_data(), batch_size=batch_size),
        DataLoader(_data(32), batch_size=batch_size),
        **kwargs,
    )


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _by_hand(acc, model, optimizer, loader, epochs):
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
    return acc.get_state_dict(model)


def _tracked(folder):
    """The CSV tracker's rows, one per step (a step's training and validation metrics may come in two writes)."""
    with open(folder / "tracking" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in rows]
    assert steps == sorted(steps), "steps in order"
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
    return list(merged.values())


def test_two_ranks_return_what_they_trained_equal_to_one_process_to_the_loop_by_hand_and_to_fsdp_from_the_config(
    tmp_path,
):
    """fit() hands back the caller's own model and optimizer, trained; FSDP from the config (every layer sharded)
    trains the same model and gives back the same optimizer state (1e-5 over 3 epochs)."""
    trainer = _trainer(_config(tmp_path, nprocs=2, val_every=1, write_every=1), batch_size=8)
    before = _params(trainer.model).clone()
    model, optimizer = trainer.fit()
    assert model is trainer.model and optimizer is trainer.optimizer, "the caller's own objects come back"
    assert not torch.equal(_params(model), before), "trained, not the untouched copy"
    assert optimizer.state_dict()["state"], "the optimizer's state came back too"

    single = _trainer(_config(tmp_path, log_folder=tmp_path / "one"), batch_size=16)
    single.fit()
    torch.testing.assert_close(_params(model), _params(single.model), atol=1e-5, rtol=0)

    acc = Accelerator(nprocs=2, compute_setup="cpu")
    hand = _model()
    state = acc.distribute(_by_hand)(
        acc, hand, torch.optim.Adam(hand.parameters(), lr=0.05), DataLoader(_data(), batch_size=8), 4
    )  # epochs 0 .. max_iter
    hand.load_state_dict(state)
    torch.testing.assert_close(_params(model), _params(hand), atol=1e-6, rtol=0)

    rows = _tracked(trainer.log_folder)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3], "validation before training, then every epoch"
    assert all(r["val_loss"] for r in rows) and all(r["train_loss"] for r in rows[1:])
    assert [h["step"] for h in trainer.history] == [0, 1, 2, 3]
    assert float(rows[3]["train_loss"]) < float(rows[1]["train_loss"])

    fsdp = _trainer(_config(tmp_path, nprocs=2, strategy="fsdp", fsdp_min_params=1, log_folder=tmp_path / "fsdp"))
    fsdp.fit()
    assert not torch.equal(_params(fsdp.model), before)
    torch.testing.assert_close(_params(fsdp.model), _params(model), atol=1e-5, rtol=0)
    sharded, plain = fsdp.optimizer.state_dict(), optimizer.state_dict()
    assert sharded["param_groups"] == plain["param_groups"] and sorted(sharded["state"]) == sorted(plain["state"])
    for index, moments in plain["state"].items():
        torch.testing.assert_close(sharded["state"][index]["exp_avg"], moments["exp_avg"], atol=1e-5, rtol=0)


def _note_batch(path, trainer, config, tracker):
    """A train_batch_end callback: rank 0 notes (attempt, epoch, batch) of every batch it trains in ``path``."""
    if trainer.accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(f"{trainer.accelerator.restart_count} {trainer.opt_result.iteration} {trainer.global_step}\n")


def _noted(path):
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


def _untouched(folder):
    """Each file under ``folder``: its inode and modification time, which a rewrite would change."""
    return {p.relative_to(folder): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


# the uninterrupted fit the second fit, the restarted fit and the fit on fewer ranks must end as
REFERENCE = {"nprocs": 2, "max_iter": 4, "checkpoint_every": 1, "write_every": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted fit of REFERENCE (epochs 0 to 4 on 2 ranks, a blocking checkpoint after each epoch): its
    parameters and its tracked rows, run once for all pytest-xdist workers."""

    def compute():
        straight = _trainer(_config(tmp_path_factory.mktemp("straight"), **REFERENCE))
        straight.fit()
        return {"params": _params(straight.model).tolist(), "tracked": _tracked(straight.log_folder)}

    result = once_per_session(tmp_path_factory, "test_trainer_straight_fit", compute)
    return torch.tensor(result["params"], dtype=torch.float32), result["tracked"]


def _mlflow_train_losses(store: Path) -> list[list[tuple[int, float]]]:
    """The train_loss of each active run of the MLflow file store ``store``, as (step, value) by step, read from
    its files: <experiment>/<run>/meta.yaml, and metrics/train_loss with a line ``<timestamp> <value> <step>``
    per write."""
    runs = []
    for experiment in sorted(p for p in store.iterdir() if (p / "meta.yaml").is_file()):
        for run in sorted(p for p in experiment.iterdir() if (p / "meta.yaml").is_file()):
            if "lifecycle_stage: active" not in (run / "meta.yaml").read_text():
                continue
            metric = run / "metrics" / "train_loss"
            lines = metric.read_text().splitlines() if metric.is_file() else []
            runs.append(sorted((int(step), float(value)) for _, value, step in (line.split() for line in lines)))
    return runs


def test_a_second_fit_continues_the_folders_background_checkpoints_and_mlflow_run_and_ends_where_one_long_fit_ends(
    tmp_path, capfd, monkeypatch, reference
):
    """The second fit (a new Trainer, a larger max_iter) trains epochs 3 and 4 only, from the first fit's checkpoint,
    which it leaves as it was, and continues the first fit's MLflow run; a fit from scratch would end with the same
    parameters (seeded, no shuffling), so what it trained is what tells. Both fits write their checkpoints in the
    background: the second resumes from one as from a blocking one, and ends bitwise where the uninterrupted fit
    with blocking checkpoints ends."""
    component.installed("mlflow")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    noted = tmp_path / "batches"
    fields = {
        "nprocs": 2,
        "checkpoint_every": 1,
        "checkpoint_in_background": True,
        "write_every": 1,
        "tracking_tool": "mlflow",
        "rank_prefix": True,
        "callbacks": [  # ranks' lines: to capfd
            Callback("train_batch_end", 1, functools.partial(_note_batch, noted))
        ],
    }
    first = _trainer(_config(tmp_path, max_iter=2, **fields))
    first.fit()
    assert _noted(noted) == [(0, epoch, batch) for epoch in (0, 1, 2) for batch in range(4 * epoch + 1, 4 * epoch + 5)]
    kept = _untouched(first.log_folder / "checkpoints")
    noted.unlink()
    capfd.readouterr()
    more = _trainer(_config(tmp_path, max_iter=4, **fields))
    more.fit()  # from the first fit's last checkpoint, written in the background
    assert (
        f"qaccel: resumed {first.log_folder / 'checkpoints' / 'checkpoint_00000012'} after epoch 2 (training "
        "epochs 3-4 next)" in capfd.readouterr().err
    )
    assert _noted(noted) == [(0, epoch, batch) for epoch in (3, 4) for batch in range(4 * epoch + 1, 4 * epoch + 5)], (
        "the second fit trained epochs 3 and 4 only"
    )
    assert {name: kept[name] for name in kept} == {
        name: _untouched(more.log_folder / "checkpoints")[name] for name in kept
    }, "the first fit's checkpoints untouched"
    params, _ = reference
    assert torch.equal(_params(more.model), params), "bitwise the same as one blocking fit of 4 epochs"
    assert [h["step"] for h in more.history] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (more.log_folder / "checkpoints").iterdir()) == [
        f"checkpoint_{steps:08d}" for steps in (4, 8, 12, 16, 20)
    ], "after each epoch, 0 to 4: every one complete, nothing half-written"
    runs = _mlflow_train_losses(more.log_folder / "tracking" / "mlruns")
    assert len(runs) == 1, "the second fit continued the first's run"
    assert [step for step, _ in runs[0]] == [1, 2, 3, 4], "each epoch once; epoch 0 is not written, as in qadence"
    assert [value for _, value in runs[0]] == pytest.approx(
        [h["train_loss"] for h in more.history if h["step"]], rel=1e-6
    )


def test_early_stopping_stops_every_rank_after_the_same_epoch_and_the_best_checkpoint_is_kept(tmp_path):
    stop = EarlyStopping(on="val_epoch_end", called_every=1, monitor="val_loss", patience=1, mode="max")
    config = _config(tmp_path, nprocs=2, max_iter=10, val_every=1, checkpoint_best_only=True, callbacks=[stop])
    trainer = _trainer(config)
    trainer.fit()
    # epoch 1's check sets the best (epoch 0's validation, before training, calls no callback); the first later
    # val_loss not above the best so far is no improvement for mode="max", and patience=1 stops there
    losses = [h["val_loss"] for h in trainer.history]
    stop = next(epoch for epoch in range(2, 11) if losses[epoch] <= max(losses[1:epoch]))
    assert [h["step"] for h in trainer.history] == list(range(stop + 1))
    assert (trainer.log_folder / "best" / "qaccel_state.json").is_file(), "validation improved after epoch 0"
    assert not (trainer.log_folder / "checkpoints").exists() or not list((trainer.log_folder / "checkpoints").iterdir())


def _raise_on_rank_1(trainer, config, tracker):
    if trainer.accelerator.rank == 1 and trainer.opt_result.iteration == 2:
        raise RuntimeError("callback failed on purpose")


def test_a_callback_raising_on_one_rank_ends_the_fit_with_its_error(tmp_path):
    trainer = _trainer(_config(tmp_path, nprocs=2, callbacks=[Callback("train_epoch_end", 1, _raise_on_rank_1)]))
    with pytest.raises(RuntimeError, match="callback failed on purpose") as caught:
        trainer.fit()
    assert "raised on rank 1 of 2" in "\n".join(caught.value.__notes__)


def test_validation_and_test_are_exact_means_over_every_sample_of_an_uneven_set(tmp_path):
    # 34 samples in batches of 4: 9 batches, so in the last step rank 1 gets a repeat of the first batch (padding),
    # and the last real batch holds 2 samples
    config = _config(tmp_path, nprocs=2, val_every=1, all_reduce_metrics=True, checkpoint_every=1, keep_checkpoints=2)
    trainer = _trainer(config)
    trainer.fit(val_dataloader=DataLoader(_data(34), batch_size=4))
    metrics = trainer.test(DataLoader(_data(34), batch_size=4))
    with torch.no_grad():
        x, y = _data(34).tensors
        expected = torch.nn.functional.mse_loss(trainer.model(x), y).item()
    assert set(metrics) == {"test_loss", "test_mse"}
    assert metrics["test_loss"] == pytest.approx(expected, rel=1e-6), "each sample once, weighted by its batch"
    assert trainer.history[-1]["val_loss"] == pytest.approx(expected, rel=1e-6)
    kept = sorted(p.name for p in (trainer.log_folder / "checkpoints").iterdir() if not p.name.startswith("."))
    assert kept == ["checkpoint_00000012", "checkpoint_00000016"], f"the 2 newest of 4 stay: {kept}"


def test_test_with_split_batches_counts_the_real_part_of_a_partly_padded_batch(tmp_path):
    # 34 samples in batches of 8 split over 2 ranks: the last batch holds 2, so rank 0's last slice is 2 real
    # samples and 2 of padding, and rank 1's is all padding
    trainer = _trainer(_config(tmp_path, nprocs=2, split_batches=True))  # test() alone: no fit needed before it
    metrics = trainer.test(DataLoader(_data(34), batch_size=8))
    with torch.no_grad():
        x, y = _data(34).tensors
        expected = torch.nn.functional.mse_loss(trainer.model(x), y).item()
    assert metrics["test_loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "fields, exc, message",
    [
        ({"max_iter": -1}, ValueError, "TrainConfig.max_iter must be a non-negative int; got -1"),
        ({"val_every": -1}, ValueError, "TrainConfig.val_every must be a non-negative int; got -1"),
        (
            {"tracking_tool": "comet_ml"},
            ValueError,
            "TrainConfig.tracking_tool must be one of 'tensorboard', 'mlflow', 'wandb', 'csv'",
        ),
        ({"log_with": "comet_ml"}, ValueError, "TrainConfig.log_with must be one of 'tensorboard', 'wandb', 'mlflow'"),
        ({"lr_scheduler_step": "step"}, ValueError, "TrainConfig.lr_scheduler_step must be one of 'epoch', 'batch'"),
        ({"callbacks": [print]}, TypeError, "TrainConfig.callbacks must be a list of qaccel.callbacks.Callback"),
        ({"nprocs": 0}, ValueError, "TrainConfig.nprocs must be a positive int; got 0"),
        ({"keep_checkpoints": 0}, ValueError, "TrainConfig.keep_checkpoints must be a positive int; got 0"),
        ({"strategy": "zero"}, ValueError, "TrainConfig.strategy must be one of 'ddp', 'fsdp'; got 'zero'"),
        ({"timeout": datetime.timedelta(0)}, ValueError, "TrainConfig.timeout must be a positive number"),
    ],
)
def test_bad_config_values_fail_at_construction_naming_the_field(fields, exc, message):
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields)


def test_checkpoint_best_only_without_validation_warns_that_nothing_will_be_saved():
    with pytest.warns(
        UserWarning,
        match="checkpoint_best_only keeps the best validation, and val_every=0 validates "
        "never: no checkpoint will be saved",
    ) as caught:
        TrainConfig(checkpoint_best_only=True)
    assert caught[0].filename == __file__, "it points at the line that made the config"


def test_the_config_holds_every_accelerator_option_with_its_default():
    from qaccel import options

    config = TrainConfig()
    for option in options.OPTIONS:
        assert getattr(config, option.name) == option.default, option.name


def test_bad_trainer_arguments_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="loss_fn must be one of 'mse', 'cross_entropy'"):
        _trainer(_config(tmp_path)).__class__(
            _model(), torch.optim.SGD(_model().parameters(), lr=1), _config(tmp_path), "l1"
        )
    with pytest.raises(TypeError, match="Trainer\\(config=...\\) takes a qaccel.TrainConfig"):
        Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=1), {"max_iter": 1})


def test_one_fit_draws_its_progress_bar_on_rank_0_writes_per_batch_and_plots_and_steps_a_scheduler_per_batch(
    tmp_path, capfd
):
    """One fit (epochs 0 to 2; 64 samples, 8 per batch, 2 ranks: 4 batches an epoch), each of its outputs:

    - the progress bar is drawn by rank 0 only;
    - per-batch writes go on the batch axis, and WriteMetrics' called_every counts batches; GradientMonitoring
      writes each batch's gradients under qadence's names, which the epochs' rows keep out of;
    - the curves are drawn, and a plotting function's figure logged where training starts, then each epoch;
    - a scheduler stepped per batch steps once per optimizer update: without accumulation, each batch."""
    component.installed("matplotlib")
    from qaccel.callbacks import GradientMonitoring, WriteMetrics

    def weights(model, epoch):
        from matplotlib.figure import Figure

        figure = Figure()
        figure.add_subplot().hist(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())
        return "weights", figure

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = _config(
        tmp_path,
        nprocs=2,
        max_iter=2,
        val_every=1,
        write_every=1,
        plot_every=1,
        plotting_functions=(weights,),
        lr_scheduler_step="batch",
        verbose=True,
        rank_prefix=True,
        callbacks=[GradientMonitoring(), WriteMetrics("train_batch_end", called_every=3)],
    )
    loaders = DataLoader(_data(), batch_size=8), DataLoader(_data(32), batch_size=8)
    trainer = Trainer(model, optimizer, config, "mse", *loaders, lr_scheduler=scheduler)
    trainer.fit()

    err = capfd.readouterr().err
    assert "[rank 0] epochs" in err and "[rank 1] epochs" not in err, err

    with open(trainer.log_folder / "tracking" / "batches.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [
        step for batch in range(1, 13) for step in [batch] * (2 if batch % 3 == 0 else 1)
    ], "each batch, and every third twice"
    grads = [row for row in rows if row["0.weight_max"]]
    assert len(grads) == 12 and all(float(row["0.weight_max"]) > float(row["0.weight_min"]) for row in grads), (
        "each step's gradients, under qadence's names"
    )
    assert {name for name in rows[0] if name.startswith("0.weight")} == {
        f"0.weight_{s}" for s in ("mean", "std", "max", "min")
    }
    losses = [(int(row["step"]), float(row["train_loss"])) for row in rows if row["train_loss"]]
    assert [step for step, _ in losses] == [3, 6, 9, 12] and all(loss > 0 for _, loss in losses)
    epochs = _tracked(trainer.log_folder)
    assert [int(row["step"]) for row in epochs] == [0, 1, 2], "validation before training, then each epoch"
    assert not any("0.weight_max" in row for row in epochs)

    assert (trainer.log_folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plots = sorted(p.name for p in (trainer.log_folder / "tracking" / "plots").iterdir())
    assert plots == [f"weights_{epoch:08d}.png" for epoch in (0, 1, 2)], "where training starts, then each epoch"

    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**12), "12 batches, 12 updates"
    assert scheduler.last_epoch == 12


def test_a_scheduler_stepped_per_batch_steps_once_per_optimizer_update_of_accumulated_gradients(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = _config(tmp_path, nprocs=2, max_iter=1, lr_scheduler_step="batch", gradient_accumulation_steps=2)
    Trainer(model, optimizer, config, "mse", DataLoader(_data(), batch_size=8), lr_scheduler=scheduler).fit()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4), (
        "epochs 0 and 1, each of 64 samples, 16 a round: 8 rounds, 2 to an update"
    )
    assert scheduler.last_epoch == 4


def _fail_once_in_epoch_3(trainer, config, tracker):
    if trainer.accelerator.restart_count == 0 and trainer.opt_result.iteration == 3:
        raise RuntimeError("the first attempt fails in epoch 3")


def test_a_restarted_fit_continues_its_checkpoint_and_tracker_to_the_uninterrupted_result(tmp_path, capfd, reference):
    """Attempt 0 fails at epoch 3's first batch; attempt 1 resumes from the checkpoint after epoch 2 and trains
    epochs 3 and 4 only (one from scratch would end with the same parameters: what it trained is what tells)."""
    noted = tmp_path / "batches"
    failing = Callback("train_batch_end", 1, _fail_once_in_epoch_3)
    note = Callback("train_batch_end", 1, functools.partial(_note_batch, noted))
    restarted = _trainer(_config(tmp_path, max_restarts=1, rank_prefix=True, callbacks=[note, failing], **REFERENCE))
    restarted.fit()
    err = capfd.readouterr().err
    assert "restarting all 2 ranks (restart 1 of 1)" in err
    assert (
        f"qaccel: resumed {restarted.log_folder / 'checkpoints' / 'checkpoint_00000012'} after epoch 2 (training "
        "epochs 3-4 next)" in err
    )
    assert [entry for entry in _noted(noted) if entry[0] == 1] == [
        (1, epoch, batch) for epoch in (3, 4) for batch in range(4 * epoch + 1, 4 * epoch + 5)
    ], "the second attempt trained epochs 3 and 4 only"
    params, tracked = reference
    assert torch.equal(_params(restarted.model), params)
    assert [int(r["step"]) for r in _tracked(restarted.log_folder)] == [1, 2, 3, 4]
    assert _tracked(restarted.log_folder) == tracked


def test_a_requeued_or_restarted_job_finds_its_own_run_folder_again(tmp_path, monkeypatch):
    """With qadence's default log_folder each run gets a new subfolder of root_folder; a SLURM job (or a torchrun
    run) that comes back after a requeue (or a restart) finds the one it made, so it continues its checkpoints."""
    trainer = _trainer(TrainConfig(root_folder=tmp_path / "runs", compute_setup="cpu", verbose=False))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first = trainer._choose_folder()
    first.mkdir(parents=True)
    assert first.parent == tmp_path / "runs" and first.name.startswith("1_") and first.name.endswith("_4242")
    assert trainer._choose_folder() == first, "the requeued job's folder"
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    other = trainer._choose_folder()
    assert other != first and other.name.startswith("2_") and other.name.endswith("_4243"), "another job: its own"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert trainer._choose_folder().name.endswith(f"_{os.getpid():x}"), "no job: the process, as qadence names it"


def test_a_fit_continues_on_fewer_ranks_with_its_global_batch_kept_and_ends_as_a_straight_fit(tmp_path, reference):
    """4 ranks x 4 samples for epochs 0 and 1, then 2 ranks (keep_global_batch: 2 micro-steps per update) for
    epochs 2 to 4: the parameters of the straight fit of epochs 0 to 4 with the same global batch (2 ranks x 8)."""
    options = {"checkpoint_every": 1, "keep_global_batch": True}
    _trainer(_config(tmp_path, nprocs=4, max_iter=1, **options), batch_size=4).fit()
    trainer = _trainer(_config(tmp_path, nprocs=2, max_iter=4, **options), batch_size=4)
    model, _ = trainer.fit()
    params, _ = reference
    torch.testing.assert_close(_params(model), params, atol=1e-5, rtol=1e-5)
    assert [h["step"] for h in trainer.history] == [0, 1, 2, 3, 4], (
        "the first fit's epochs came back with the checkpoint"
    )
