"""A script written for qadence's Trainer runs on qaccel's with its imports changed and gives qadence's results:
each test runs qadence's own Trainer (one process, as its multi-process mode is not deterministic) and qaccel's
on the same seeded float64 problem in the same test, and compares the loss curves, the optimizer steps and the
trained parameters; qaccel's is run again on 2 real gloo ranks with each rank's batch halved (or no data), which
gives the same numbers. Also: infinite loaders resume mid-epoch on the stream they stopped in, a second fit trains
max_iter + 1 more epochs, a folder of qadence checkpoints is continued, and every training name of
qadence.ml_tools exists in qaccel."""

from __future__ import annotations

import copy
import functools
import math
import os

import pytest
import torch
from support import component
from torch.utils.data import DataLoader, TensorDataset

import qaccel
import qaccel.data
from qaccel import TrainConfig, Trainer
from qaccel.callbacks import Callback, SaveCheckpoint

pytestmark = pytest.mark.timeout(240)

EPOCHS = 4  # max_iter: epochs 0 to 4
TOL = {"atol": 1e-10, "rtol": 0}  # float64 throughout


@pytest.fixture(autouse=True)
def _environment_kept():
    """qadence's fit sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK (``'None'`` in one process) in
    os.environ: put back after each test, so that the later tests of this worker, and the processes they start (a
    script importing torchmetrics, which parses LOCAL_RANK), see none of them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def qadence():
    """qadence.ml_tools, imported once (about 5 s)."""
    component.module("qadence")
    import qadence.ml_tools
    import qadence.ml_tools.callbacks

    return qadence.ml_tools


def _points(n=32):
    x = torch.linspace(-1, 1, n, dtype=torch.float64).reshape(-1, 1)
    return x, torch.sin(3 * x)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _mse(model, batch):
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    return loss, {"mse": loss}


def _residual(model, batch):
    """A loss that makes its own points (qadence's train_dataloader=None): the same on every rank."""
    assert batch is None
    x, y = _points(16)
    loss = ((model(x) - y) ** 2).mean()
    return loss, {}


def _two_sets(model, batch):
    (x, y), (z,) = batch["fit"], batch["zero"]
    loss = ((model(x) - y) ** 2).mean() + 0.1 * (model(z) ** 2).mean()
    return loss, {}


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _steps(optimizer):
    """Adam's count of updates."""
    return int(next(iter(optimizer.state_dict()["state"].values()))["step"])


NOTED: list[float] = []  # qadence deep-copies its callbacks: they note into this module's list


def _note_loss(trainer, config, writer):
    NOTED.append(float(trainer.opt_result.loss))


def _run_qadence(ml_tools, tmp_path, loss_fn, train, optimizer="adam", epochs=EPOCHS, model=None, **fields):
    """qadence's own Trainer: (its per-epoch training losses at epochs 1..max_iter, the model, the optimizer)."""
    model = model or _model()
    opt = _optimizer(model, optimizer)
    NOTED.clear()
    note = ml_tools.callbacks.Callback("train_epoch_end", 1, _note_loss)
    config = ml_tools.TrainConfig(max_iter=epochs, log_folder=tmp_path / "qadence", callbacks=[note], **fields)
    ml_tools.Trainer(model, opt, config, loss_fn, train).fit()
    return list(NOTED), model, opt


def _run_qaccel(tmp_path, loss_fn, train, optimizer="adam", epochs=EPOCHS, name="qaccel", model=None, **fields):
    """qaccel's Trainer, as the qadence script would call it: (losses at epochs 1..max_iter, model, optimizer)."""
    model = model or _model()
    opt = _optimizer(model, optimizer)
    config = TrainConfig(
        max_iter=epochs,
        log_folder=tmp_path / name,
        compute_setup="cpu",
        tracking_tool="csv",
        verbose=False,
        all_reduce_metrics=True,
        **fields,
    )
    trainer = Trainer(model, opt, config, loss_fn, train)
    trainer.fit()
    return [h["train_loss"] for h in trainer.history if h["step"] > 0], model, opt


def _optimizer(model, kind):
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.02)
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)


def _agree(reference, *runs):
    losses, model, optimizer = reference
    for other_losses, other_model, other_optimizer in runs:
        assert len(other_losses) == len(losses) == EPOCHS
        torch.testing.assert_close(torch.tensor(other_losses), torch.tensor(losses), **TOL)
        torch.testing.assert_close(_params(other_model), _params(model), **TOL)
        if isinstance(optimizer, torch.optim.Adam):
            assert _steps(other_optimizer) == _steps(optimizer)


def test_a_finite_loader_gives_qadences_curve_and_steps_on_one_and_two_ranks(qadence, tmp_path):
    x, y = _points()
    reference = _run_qadence(qadence, tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=8))
    assert _steps(reference[2]) == (EPOCHS + 1) * 4, "qadence: max_iter + 1 epochs of 4 batches"
    one = _run_qaccel(tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=8))
    two = _run_qaccel(tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=4), nprocs=2, name="two")
    _agree(reference, one, two)


def test_no_training_data_calls_the_loss_with_none_once_per_epoch_as_qadence(qadence, tmp_path):
    reference = _run_qadence(qadence, tmp_path, _residual, None)
    assert _steps(reference[2]) == EPOCHS + 1
    _agree(
        reference, _run_qaccel(tmp_path, _residual, None), _run_qaccel(tmp_path, _residual, None, nprocs=2, name="two")
    )


def test_a_dict_of_loaders_gives_qadences_curve_on_one_and_two_ranks(qadence, tmp_path):
    x, y = _points()
    z = torch.linspace(-2, 2, 16, dtype=torch.float64).reshape(-1, 1)

    def loaders(dict_loader, halve):
        return dict_loader(
            {
                "fit": DataLoader(TensorDataset(x, y), batch_size=8 // halve),
                "zero": DataLoader(TensorDataset(z), batch_size=4 // halve),
            }
        )

    reference = _run_qadence(qadence, tmp_path, _two_sets, loaders(qadence.DictDataLoader, 1))
    one = _run_qaccel(tmp_path, _two_sets, loaders(qaccel.DictDataLoader, 1))
    two = _run_qaccel(tmp_path, _two_sets, loaders(qaccel.DictDataLoader, 2), nprocs=2, name="two")
    _agree(reference, one, two)


def test_lbfgs_takes_its_closure_as_in_qadence(qadence, tmp_path):
    x, y = _points()
    reference = _run_qadence(qadence, tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=32), "lbfgs")
    _agree(reference, _run_qaccel(tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=32), "lbfgs"))


def test_an_infinite_loader_takes_one_batch_an_epoch_or_max_batches(qadence, tmp_path):
    x, y = _points()
    qadence_model = _model()
    qadence_optimizer = _optimizer(qadence_model, "adam")
    config = qadence.TrainConfig(max_iter=EPOCHS, log_folder=tmp_path / "qadence")
    qadence.Trainer(
        qadence_model, qadence_optimizer, config, _mse, qadence.to_dataloader(x, y, batch_size=8, infinite=True)
    ).fit()
    assert _steps(qadence_optimizer) == EPOCHS + 1
    _, _, one = _run_qaccel(tmp_path, _mse, qaccel.to_dataloader(x, y, batch_size=8, infinite=True))
    assert _steps(one) == EPOCHS + 1, "one batch an epoch, as qadence"
    capped = Trainer(
        _model(),
        torch.optim.Adam(_model().parameters()),
        TrainConfig(
            max_iter=EPOCHS, log_folder=tmp_path / "capped", compute_setup="cpu", tracking_tool="csv", verbose=False
        ),
        "mse",
        qaccel.to_dataloader(x, y, batch_size=8, infinite=True),
        max_batches=3,
    )
    capped.fit()
    assert capped.global_step == 3 * (EPOCHS + 1)


def test_an_infinite_loader_on_two_ranks_reads_one_stream_as_one_rank_with_their_batch(tmp_path):
    """The ranks read one stream, each taking every other batch: 2 x 4 samples a step are 1 x 8."""
    x, y = _points()
    runs = [
        _run_qaccel(
            tmp_path, _mse, qaccel.to_dataloader(x, y, batch_size=8 // n, infinite=True), nprocs=n, seed=7, name=f"n{n}"
        )
        for n in (1, 2)
    ]
    (one, one_model, _), (two, two_model, _) = runs
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), **TOL)
    torch.testing.assert_close(_params(two_model), _params(one_model), **TOL)


def _note_batch(path, trainer, config, tracker):
    """Rank 0 notes (attempt, global step, the batch's first input) of each training batch."""
    if trainer.accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(f"{trainer.accelerator.restart_count} {trainer.global_step}\n")


def _fail_once_at_step_5(trainer, config, tracker):
    if trainer.accelerator.restart_count == 0 and trainer.global_step == 5:
        raise RuntimeError("the first attempt fails after step 5")


def _loader(kind):
    if kind == "infinite":
        return qaccel.to_dataloader(*_points(), batch_size=4, infinite=True)
    x, y = _points(24)
    z = torch.linspace(-2, 2, 32, dtype=torch.float64).reshape(-1, 1)
    return qaccel.DictDataLoader(
        {
            "fit": DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
            "zero": DataLoader(TensorDataset(z), batch_size=2, shuffle=True),
        }
    )


@pytest.mark.parametrize("kind", ["infinite", "dict"])
def test_a_loader_resumed_mid_epoch_continues_where_it_stopped(tmp_path, kind):
    """3 batches an epoch (an infinite loader with max_batches=3; a DictDataLoader whose shorter loader gives 3 a
    rank, both shuffled), a checkpoint after every batch; the first attempt fails after step 5 (epoch 1's second batch) before
    saving it: the second resumes after step 4, trains steps 5 to 15 only and ends bitwise where the uninterrupted
    fit ends (a fresh start would end there too: what it trained tells)."""
    noted = tmp_path / "batches"
    save = SaveCheckpoint("train_batch_end", 1)
    runs = {}
    for name, callbacks, restarts in [
        ("straight", [save], 0),
        (
            "restarted",
            [
                Callback("train_batch_end", 1, functools.partial(_note_batch, noted)),
                Callback("train_batch_end", 1, _fail_once_at_step_5),
                save,
            ],
            1,
        ),
    ]:
        model = _model()
        config = TrainConfig(
            max_iter=EPOCHS,
            log_folder=tmp_path / name,
            compute_setup="cpu",
            tracking_tool="csv",
            verbose=False,
            nprocs=2,
            seed=3,
            max_restarts=restarts,
            callbacks=callbacks,
        )
        Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=0.02),
            config,
            _mse if kind == "infinite" else _two_sets,
            _loader(kind),
            max_batches=3 if kind == "infinite" else None,
        ).fit()
        runs[name] = model
    lines = [tuple(map(int, line.split())) for line in noted.read_text().splitlines()]
    assert [step for attempt, step in lines if attempt == 1] == list(range(5, 16)), lines
    assert torch.equal(_params(runs["restarted"]), _params(runs["straight"]))


def test_a_second_fit_of_the_same_trainer_trains_max_iter_plus_one_more_epochs_as_qadence(qadence, tmp_path):
    x, y = _points()
    fields = {"checkpoint_every": 1}
    qadence_model = _model()
    qadence_optimizer = _optimizer(qadence_model, "adam")
    q_trainer = qadence.Trainer(
        qadence_model,
        qadence_optimizer,
        qadence.TrainConfig(max_iter=EPOCHS, log_folder=tmp_path / "qadence", **fields),
        _mse,
        DataLoader(TensorDataset(x, y), batch_size=8),
    )
    q_trainer.fit()
    q_trainer.fit()
    model = _model()
    optimizer = _optimizer(model, "adam")
    trainer = Trainer(
        model,
        optimizer,
        TrainConfig(
            max_iter=EPOCHS,
            log_folder=tmp_path / "qaccel",
            compute_setup="cpu",
            tracking_tool="csv",
            verbose=False,
            nprocs=2,
            **fields,
        ),
        _mse,
        DataLoader(TensorDataset(x, y), batch_size=4),
    )
    trainer.fit()
    assert trainer.config.log_folder == trainer.log_folder, "the run's folder, as qadence sets it"
    trainer.fit()
    assert _steps(optimizer) == _steps(qadence_optimizer) == 2 * (EPOCHS + 1) * 4
    torch.testing.assert_close(_params(model), _params(qadence_model), **TOL)
    assert trainer.current_epoch == 2 * EPOCHS + 1 and [h["step"] for h in trainer.history] == list(
        range(2 * EPOCHS + 2)
    )


def test_a_folder_of_qadence_checkpoints_is_continued_on_every_rank(qadence, tmp_path, capfd):
    """qadence trains epochs 0 to 2 and checkpoints them its way; qaccel's Trainer, given that folder and
    max_iter 4, loads the newest on both ranks and trains epochs 3 and 4: qadence's straight fit of 0 to 4."""
    x, y = _points()
    folder = tmp_path / "switched"
    first = _model()
    qadence.Trainer(
        first,
        _optimizer(first, "adam"),
        qadence.TrainConfig(max_iter=2, log_folder=folder, checkpoint_every=1),
        _mse,
        DataLoader(TensorDataset(x, y), batch_size=8),
    ).fit()
    straight = _run_qadence(qadence, tmp_path, _mse, DataLoader(TensorDataset(x, y), batch_size=8))
    model = _model()
    optimizer = _optimizer(model, "adam")
    capfd.readouterr()
    trainer = Trainer(
        model,
        optimizer,
        TrainConfig(
            max_iter=EPOCHS,
            log_folder=folder,
            compute_setup="cpu",
            tracking_tool="csv",
            verbose=False,
            nprocs=2,
            rank_prefix=True,
        ),
        _mse,
        DataLoader(TensorDataset(x, y), batch_size=4),
    )
    trainer.fit()
    assert "qaccel: resumed " + str(folder / "model_Sequential_ckpt_002_device_cpu.pt") in capfd.readouterr().err
    assert [h["step"] for h in trainer.history] == [3, 4]
    assert _steps(optimizer) == _steps(straight[2]) == (EPOCHS + 1) * 4
    torch.testing.assert_close(_params(model), _params(straight[1]), **TOL)


EVENTS: list[tuple] = []  # what the hooks and the loss saw, in order


def _counted(model, batch):
    EVENTS.append(("loss",))
    return _mse(model, batch)


def _hooked(trainer_class):
    """A subclass of ``trainer_class`` (qadence's or qaccel's) whose every hook notes its name, the epoch and how
    many batch results it got."""

    def note(name):
        def hook(self, *args):
            got = [len(a) for a in args if isinstance(a, list) and all(isinstance(r, tuple) for r in a)]
            EVENTS.append((name, self.current_epoch, *got))

        return hook

    names = [
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_val_epoch_start",
        "on_val_epoch_end",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_val_batch_start",
        "on_val_batch_end",
    ]
    return type("Hooked", (trainer_class,), {name: note(name) for name in names})


def test_a_subclass_hooks_run_where_qadences_do_with_the_same_loss_calls(qadence, tmp_path):
    x, y = _points(16)
    seen = {}
    for name, library in (("qadence", qadence), ("qaccel", None)):
        EVENTS.clear()
        model = _model()
        config = (
            library.TrainConfig
            if library
            else functools.partial(TrainConfig, compute_setup="cpu", tracking_tool="csv", verbose=False)
        )(max_iter=2, val_every=1, log_folder=tmp_path / name)
        _hooked(library.Trainer if library else Trainer)(
            model,
            _optimizer(model, "adam"),
            config,
            _counted,
            DataLoader(TensorDataset(x, y), batch_size=8),
            DataLoader(TensorDataset(x, y), batch_size=16),
        ).fit()
        seen[name] = list(EVENTS)
    assert seen["qaccel"] == seen["qadence"]
    assert seen["qaccel"].count(("loss",)) == 3 * 2 + 4 * 1, "3 epochs of 2 batches, 4 validations of one"


def _write_everywhere(trainer, config, writer):
    """A qadence callback: writes through the writer on every rank, with no rank check."""
    writer.write(trainer.opt_result.iteration, {"doubled": 2 * float(trainer.opt_result.loss)})


def test_callbacks_get_qadences_writer_and_gradient_statistics_on_every_rank(qadence, tmp_path):
    component.module("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _points()
    runs = {}
    for name, library in (("qadence", qadence), ("qaccel", None)):
        model = _model()
        callbacks_module = qadence.callbacks if library else qaccel.callbacks
        config_class = (
            library.TrainConfig
            if library
            else functools.partial(TrainConfig, compute_setup="cpu", verbose=False, nprocs=2, all_reduce_metrics=True)
        )
        config = config_class(
            max_iter=EPOCHS,
            log_folder=tmp_path / name,
            callbacks=[
                callbacks_module.Callback("train_epoch_end", 1, _write_everywhere),
                callbacks_module.GradientMonitoring("train_epoch_end", 1),
            ],
        )
        trainer_class = library.Trainer if library else Trainer
        trainer_class(
            model,
            _optimizer(model, "adam"),
            config,
            _mse,
            DataLoader(TensorDataset(x, y), batch_size=8 if library else 4),
        ).fit()
        runs[name] = config.log_folder if library else tmp_path / name / "tracking"
    read = {}
    for name, folder in runs.items():
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        read[name] = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert (
        set(read["qaccel"])
        == set(read["qadence"])
        >= {"doubled", "0.weight_mean", "0.weight_std", "0.weight_max", "0.weight_min"}
    )
    for tag, values in read["qadence"].items():
        assert [step for step, _ in read["qaccel"][tag]] == [step for step, _ in values] == list(range(1, EPOCHS + 1))
        assert [v for _, v in read["qaccel"][tag]] == pytest.approx(
            [v for _, v in values], rel=1e-5, abs=1e-7, nan_ok=True
        ), tag  # one value: std is nan


def test_gradient_free_training_with_nevergrad_follows_qadence(qadence, tmp_path):
    component.module("nevergrad")
    import nevergrad

    torch.manual_seed(0)
    reference_model = torch.nn.Linear(1, 1).double()
    ng_optimizer = nevergrad.optimizers.NGOpt(parametrization=qaccel.num_parameters(reference_model), budget=EPOCHS)
    ng_optimizer.parametrization.random_state.seed(0)
    model, initial = copy.deepcopy(reference_model), copy.deepcopy(reference_model)
    twin, ng_initial = copy.deepcopy(ng_optimizer), copy.deepcopy(ng_optimizer)
    qadence.Trainer.set_use_grad(False)
    try:
        NOTED.clear()
        note = qadence.callbacks.Callback("train_epoch_end", 1, _note_loss)
        qadence.Trainer(
            reference_model,
            ng_optimizer,
            qadence.TrainConfig(max_iter=EPOCHS, log_folder=tmp_path / "qadence", callbacks=[note]),
            _residual_linear,
            None,
        ).fit()
        losses = list(NOTED)
    finally:
        qadence.Trainer.set_use_grad(True)
    config = TrainConfig(
        max_iter=EPOCHS, log_folder=tmp_path / "qaccel", compute_setup="cpu", tracking_tool="csv", verbose=False
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config, _residual_linear)
    with trainer.disable_grad_opt(twin):  # one way: a block
        trainer.fit()
    assert [h["train_loss"] for h in trainer.history if h["step"]] == pytest.approx(losses, rel=1e-12)
    torch.testing.assert_close(_params(model), _params(reference_model), **TOL)
    Trainer.set_use_grad(False)  # the other: every Trainer made from now on
    try:
        again = copy.deepcopy(initial)
        other = Trainer(
            again,
            copy.deepcopy(ng_initial),
            config.__class__(**{**vars(config), "log_folder": tmp_path / "set"}),
            _residual_linear,
        )
        other.fit()
    finally:
        Trainer.set_use_grad(True)
    torch.testing.assert_close(_params(again), _params(reference_model), **TOL)


def _residual_linear(model, batch):
    x = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(-1, 1)
    return ((model(x) - (2 * x - 0.5)) ** 2).mean(), {}


def test_every_training_name_of_qadence_ml_tools_is_in_qaccel(qadence):
    import qadence.ml_tools.callbacks as q_callbacks
    import qadence.ml_tools.data as q_data

    models = {
        "AnsatzConfig",
        "FeatureMapConfig",
        "QNN",
        "QCNN",
        "create_ansatz",
        "create_fm_blocks",
        "create_observable",
        "InformationContent",
        "numpy_to_tensor",
        "promote_to",
        "promote_to_tensor",
    }
    training = {
        name
        for name in dir(qadence)
        if not name.startswith("_")
        and name[0] != name[0].lower()
        or name
        in (
            "load_checkpoint",
            "write_checkpoint",
            "load_model",
            "to_dataloader",
            "get_parameters",
            "set_parameters",
            "num_parameters",
            "default_optimize_step",
        )
    }
    training = {
        name for name in training if hasattr(qadence, name) and not isinstance(getattr(qadence, name), type(math))
    } - models
    assert training and not [name for name in training if not hasattr(qaccel, name)]
    callbacks = set(q_callbacks.__all__) - {"CallbacksManager", "get_writer"}
    assert not [name for name in callbacks if not hasattr(qaccel.callbacks, name)]
    assert not [
        name
        for name in ("DictDataLoader", "InfiniteTensorDataset", "OptimizeResult", "to_dataloader")
        if not hasattr(qaccel.data, name) or not hasattr(q_data, name)
    ]
    fields = {f for f in qadence.OptimizeResult.__dataclass_fields__}
    assert list(qaccel.OptimizeResult.__dataclass_fields__)[: len(fields)] == list(
        qadence.OptimizeResult.__dataclass_fields__
    ), "qadence's fields, in its order (positional arguments)"
    trainer_names = {
        "fit",
        "test",
        "current_epoch",
        "global_step",
        "opt_result",
        "use_grad",
        "set_use_grad",
        "enable_grad_opt",
        "disable_grad_opt",
        "optimize_step",
        "num_training_batches",
        "num_validation_batches",
        "num_test_batches",
        "accelerator",
        "config",
        "model",
        "optimizer",
    }
    model = _model()
    trainer = Trainer(model, torch.optim.Adam(model.parameters()), TrainConfig(compute_setup="cpu"))
    assert not [name for name in trainer_names if not hasattr(trainer, name)]
    config_fields = set(qadence.TrainConfig.__dataclass_fields__) - {"_subfolders"}
    assert not sorted(config_fields - set(TrainConfig.__dataclass_fields__))


def test_gradient_free_training_on_two_ranks_takes_one_path(tmp_path):
    """Each rank tells its nevergrad optimizer the loss's mean over the ranks: with the same candidates asked for
    (the optimizer's copies start alike), 2 ranks with half the batch each train what one process trains (each
    rank's own half-batch loss would send the ranks, and the result, another way)."""
    component.module("nevergrad")
    import nevergrad

    runs = []
    for nprocs in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1).double()
        ng_optimizer = nevergrad.optimizers.NGOpt(parametrization=qaccel.num_parameters(model), budget=EPOCHS)
        ng_optimizer.parametrization.random_state.seed(0)
        x = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(-1, 1)
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TrainConfig(
                max_iter=EPOCHS,
                log_folder=tmp_path / f"n{nprocs}",
                compute_setup="cpu",
                tracking_tool="csv",
                verbose=False,
                nprocs=nprocs,
                all_reduce_metrics=True,
            ),
            _mse,
            DataLoader(TensorDataset(x, 2 * x - 0.5), batch_size=8 // nprocs),
        )
        with trainer.disable_grad_opt(ng_optimizer):
            trainer.fit()
        runs.append(([h["train_loss"] for h in trainer.history], _params(model)))
    (one, one_params), (two, two_params) = runs
    assert len(one) == EPOCHS + 1 and two == pytest.approx(one, rel=1e-12)
    torch.testing.assert_close(two_params, one_params, **TOL)
    assert not torch.equal(one_params, _params(_initial_linear())), "trained"


def _initial_linear():
    torch.manual_seed(0)
    return torch.nn.Linear(1, 1).double()
