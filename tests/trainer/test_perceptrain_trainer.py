"""A script written for perceptrain runs on ``qaccel.perceptrain`` with its imports changed: its Trainer calls
``loss_fn(batch, model)`` everywhere (training, validation, test, gradient-free steps, the steps by hand) and trains
what ``qaccel.Trainer`` trains with the same function in qadence's order, on one process and on 2 real gloo ranks;
a function whose parameter names say the other order is refused naming the Trainer that calls it so. Also what
perceptrain's scripts lean on: an optimizer that steps with an optional closure (perceptrain's AdamLBFGS, switching
to L-BFGS inside the fit), ``Trainer(model, None)`` with a nevergrad optimizer given to ``disable_grad_opt``, and a
gradient-free loss that takes gradients itself."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from support import component
from torch.optim import LBFGS, Adam, Optimizer
from torch.utils.data import DataLoader, TensorDataset

import qaccel
import qaccel.callbacks
import qaccel.data
import qaccel.perceptrain
import qaccel.perceptrain.callbacks
import qaccel.perceptrain.callbacks.saveload
import qaccel.perceptrain.config
import qaccel.perceptrain.data
import qaccel.perceptrain.optimize_step
import qaccel.perceptrain.parameters
import qaccel.perceptrain.train_utils
import qaccel.perceptrain.trainer

pytestmark = pytest.mark.timeout(240)

EPOCHS = 4  # max_iter: epochs 0 to 4
TOL = {"atol": 1e-10, "rtol": 0}  # float64 throughout


def _points(n=32):
    x = torch.linspace(-1, 1, n, dtype=torch.float64).reshape(-1, 1)
    return x, torch.sin(3 * x)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _loader(x, y, batch_size=8):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _config(tmp_path, name, **fields):
    values = {
        "max_iter": EPOCHS,
        "log_folder": tmp_path / name,
        "compute_setup": "cpu",
        "tracking_tool": "csv",
        "verbose": False,
        "all_reduce_metrics": True,
    }
    return qaccel.TrainConfig(**{**values, **fields})


def perceptrain_loss(batch, model):
    """A perceptrain script's loss: the batch first."""
    x, y = batch
    error = model(x) - y
    return (error**2).mean(), {"mae": error.abs().mean()}


def qadence_loss(model, batch):
    """The same loss in qadence's order."""
    x, y = batch
    error = model(x) - y
    return (error**2).mean(), {"mae": error.abs().mean()}


def _fit_and_test(trainer_class, loss_fn, tmp_path, name, nprocs=1, data=None, model=None, **fields):
    """Train with validation, then test: (history, test() means, trained parameters)."""
    model = model or _model()
    x, y = data or _points()
    trainer = trainer_class(
        model,
        Adam(model.parameters(), lr=0.02),
        _config(tmp_path, name, nprocs=nprocs, val_every=1, **fields),
        loss_fn,
        qaccel.perceptrain.data.to_dataloader(x, y, batch_size=8),
        DataLoader(TensorDataset(x[::2], y[::2]), batch_size=8),
        DataLoader(TensorDataset(x[1::2], y[1::2]), batch_size=8),
    )
    trainer.fit()
    return trainer.history, trainer.test(), _params(model)


def _agree(one, other, metrics):
    (history, tested, params), (other_history, other_tested, other_params) = one, other
    assert len(history) == EPOCHS + 1 and {f"{p}_{m}" for p in ("train", "val") for m in metrics} <= set(history[-1])
    for entry, other_entry in zip(history, other_history, strict=True):
        assert other_entry == pytest.approx(entry, rel=1e-12, abs=1e-12)
    assert set(tested) == {f"test_{m}" for m in metrics}
    assert other_tested == pytest.approx(tested, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(other_params, params, **TOL)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_perceptrain_script_trains_validates_and_tests_as_the_qadence_order_script(tmp_path, nprocs):
    perceptrain = _fit_and_test(qaccel.perceptrain.Trainer, perceptrain_loss, tmp_path, "perceptrain", nprocs)
    qadence = _fit_and_test(qaccel.Trainer, qadence_loss, tmp_path, "qadence", nprocs)
    _agree(qadence, perceptrain, ("loss", "mae"))
    assert not torch.equal(perceptrain[2], _params(_model())), "trained"


def _classes(n=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _classifier():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 3).double()


@pytest.mark.parametrize(
    "name, data, make, metrics",
    [
        ("mse", _points, _model, ("loss", "mse")),
        ("cross_entropy", _classes, _classifier, ("loss", "cross_entropy", "accuracy")),
    ],
)
def test_a_loss_by_name_is_the_same_loss_under_both_trainers(tmp_path, name, data, make, metrics):
    batch_first = qaccel.perceptrain.Trainer(make(), None, _config(tmp_path, "made"), name).loss_fn
    assert batch_first(data(), make())[0].dim() == 0, "perceptrain's order: (batch, model)"
    runs = [
        _fit_and_test(trainer_class, name, tmp_path, trainer_class.__module__, data=data(), model=make())
        for trainer_class in (qaccel.Trainer, qaccel.perceptrain.Trainer)
    ]
    _agree(*runs, metrics)


def test_each_trainer_refuses_a_loss_whose_parameter_names_say_the_other_order(tmp_path):
    config = _config(tmp_path, "run")
    with pytest.raises(TypeError) as caught:
        qaccel.Trainer(_model(), None, config, perceptrain_loss)
    assert str(caught.value) == (
        "loss_fn perceptrain_loss(batch, model) takes the batch first, but qaccel.Trainer calls "
        "loss_fn(model, batch): use qaccel.perceptrain.Trainer, which calls loss_fn(batch, model), or swap the "
        "function's parameters"
    )
    with pytest.raises(TypeError) as caught:
        qaccel.perceptrain.Trainer(_model(), None, config, qadence_loss)
    assert str(caught.value) == (
        "loss_fn qadence_loss(model, batch) takes the model first, but qaccel.perceptrain.Trainer calls "
        "loss_fn(batch, model): use qaccel.Trainer, which calls loss_fn(model, batch), or swap the function's "
        "parameters"
    )
    for name in ("batch", "data", "xs", "x", "inputs"):
        batch_first, model_first = eval(f"lambda {name}, model: None"), eval(f"lambda model, {name}: None")
        with pytest.raises(TypeError, match="use qaccel.perceptrain.Trainer"):
            qaccel.Trainer(_model(), None, config, batch_first)
        with pytest.raises(TypeError, match="use qaccel.Trainer"):
            qaccel.perceptrain.Trainer(_model(), None, config, model_first)
        qaccel.Trainer(_model(), None, config, model_first)
        qaccel.perceptrain.Trainer(_model(), None, config, batch_first)


@pytest.mark.parametrize("trainer_class, model_at", [(qaccel.Trainer, 0), (qaccel.perceptrain.Trainer, 1)])
def test_parameter_names_that_say_nothing_are_called_in_the_trainers_order(tmp_path, trainer_class, model_at):
    seen = []

    def loss(a, b):
        seen.append(isinstance((a, b)[model_at], torch.nn.Module))
        model, (x, y) = (a, b) if model_at == 0 else (b, a)
        return ((model(x) - y) ** 2).mean(), {}

    model = _model()
    x, y = _points()
    trainer = trainer_class(model, Adam(model.parameters()), _config(tmp_path, "run", max_iter=0), loss, _loader(x, y))
    trainer.fit()
    assert seen == [True] * 4


def test_a_step_of_your_own_is_handed_your_loss_and_perceptrains_default_step_selects_the_trainers(tmp_path):
    handed = []

    def own_step(model, optimizer, loss_fn, xs, device=None, dtype=None):
        handed.append(loss_fn)
        optimizer.zero_grad()
        loss, metrics = loss_fn(xs, model)  # the step calls the function in its own order
        loss.backward()
        optimizer.step()
        return loss, metrics

    x, y = _points()
    trained = []
    for name, step in (("own", own_step), ("default", qaccel.perceptrain.optimize_step.optimize_step)):
        model = _model()
        trainer = qaccel.perceptrain.Trainer(
            model,
            Adam(model.parameters(), lr=0.02),
            _config(tmp_path, name),
            perceptrain_loss,
            _loader(x, y),
            optimize_step=step,
        )
        trainer.fit()
        trained.append(_params(model))
    assert len(handed) == 4 * (EPOCHS + 1) and {id(fn) for fn in handed} == {id(perceptrain_loss)}
    assert trainer.optimize_step is None, "perceptrain's default step selects the Trainer's own"
    torch.testing.assert_close(trained[0], trained[1], **TOL)


def test_perceptrains_steps_by_hand_call_the_loss_with_the_batch_first():
    component.module("nevergrad")
    import nevergrad

    model = _model()
    optimizer = Adam(model.parameters(), lr=0.02)
    before = _params(model)
    loss, metrics = qaccel.perceptrain.optimize_step.optimize_step(model, optimizer, perceptrain_loss, _points())
    assert loss.dim() == 0 and set(metrics) == {"mae"} and not torch.equal(_params(model), before)
    ng_optimizer = nevergrad.optimizers.NGOpt(parametrization=qaccel.num_parameters(model), budget=2)
    candidate = nevergrad.p.Array(init=qaccel.get_parameters(model).detach().numpy())
    loss, metrics, candidate = qaccel.perceptrain.optimize_step.update_ng_parameters(
        model, ng_optimizer, perceptrain_loss, _points(), candidate
    )
    assert set(metrics) == {"mae"}
    torch.testing.assert_close(qaccel.get_parameters(model).detach(), torch.as_tensor(candidate.value))


class AdamLBFGS(Optimizer):
    """perceptrain 0.1.0's ``perceptrain.optimizers.AdamLBFGS`` (its logging left out): Adam, then L-BFGS from the
    ``switch_epoch``-th step on; its step takes an optional closure, which L-BFGS needs."""

    def __init__(self, params, switch_epoch=10_000, adam_kwargs=None, lbfgs_kwargs=None):
        self.params = list(params)
        self.switch_epoch = switch_epoch
        self._adam = Adam(self.params, **(adam_kwargs or {"lr": 1e-2, "betas": (0.9, 0.999)}))
        self._lbfgs = LBFGS(self.params, **(lbfgs_kwargs or {"lr": 1, "max_iter": 20}))
        super().__init__(self.params, defaults={})
        self.current_epoch = 0
        self._switched = False

    def state_dict(self):
        return {
            "current_epoch": self.current_epoch,
            "switched": self._switched,
            "adam_state": self._adam.state_dict(),
            "lbfgs_state": self._lbfgs.state_dict() if self._switched else {},
        }

    def load_state_dict(self, state_dict):
        self.current_epoch = state_dict["current_epoch"]
        self._switched = state_dict["switched"]
        self._adam.load_state_dict(state_dict["adam_state"])
        if self._switched:
            self._lbfgs.load_state_dict(state_dict["lbfgs_state"])

    def step(self, closure: Callable | None = None):
        self.current_epoch += 1
        if self.current_epoch < self.switch_epoch:
            self._adam.step(closure)
        else:
            if closure is None:
                raise ValueError("LBFGS optimizer requires a closure function")
            self._lbfgs.step(closure)
            if self.current_epoch == self.switch_epoch:
                self._switched = True

    def zero_grad(self, set_to_none=False):
        if not self._switched:
            self._adam.zero_grad(set_to_none=set_to_none)
        else:
            self._lbfgs.zero_grad(set_to_none=set_to_none)


def _full_batch_fit(trainer_class, optimizer_class, loss_fn, tmp_path, name, nprocs, **options):
    """Each update on the whole set of 32 points (on 2 ranks, 16 each): (trained model, optimizer, history)."""
    model = _model()
    optimizer = optimizer_class(model.parameters(), **options)
    x, y = _points()
    trainer = trainer_class(
        model, optimizer, _config(tmp_path, name, nprocs=nprocs), loss_fn, _loader(x, y, 32 // nprocs)
    )
    trainer.fit()
    return model, optimizer, [h["train_loss"] for h in trainer.history]


def test_perceptrains_adam_lbfgs_switches_to_lbfgs_inside_the_fit_on_one_and_two_ranks(tmp_path):
    """5 updates, the switch at the 3rd. L-BFGS's tolerance on the loss is off: it compares the loss its closure
    returns, each rank's own, and ranks that stopped after different evaluations would part ways."""
    options = {
        "switch_epoch": 3,
        "adam_kwargs": {"lr": 0.02},
        "lbfgs_kwargs": {"lr": 1, "max_iter": 4, "tolerance_change": 0},
    }
    runs = [
        _full_batch_fit(qaccel.perceptrain.Trainer, AdamLBFGS, perceptrain_loss, tmp_path, str(n), n, **options)
        for n in (1, 2)
    ]
    for model, optimizer, losses in runs:
        assert optimizer._switched and optimizer.current_epoch == EPOCHS + 1, "one step per update"
        lbfgs = next(iter(optimizer._lbfgs.state_dict()["state"].values()))
        assert lbfgs["n_iter"] == 3 * 4 and lbfgs["func_evals"] > 3, "3 L-BFGS steps of 4 iterations"
        assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 2
    (one, _, one_losses), (two, _, two_losses) = runs
    assert two_losses == pytest.approx(one_losses, rel=1e-12)
    torch.testing.assert_close(_params(two), _params(one), **TOL)


def test_torchs_lbfgs_trains_on_two_ranks_what_it_trains_on_one(tmp_path):
    """Its own attributes (``_params``) reach the ranks, which torch's pickling of an optimizer leaves out."""
    runs = [
        _full_batch_fit(qaccel.Trainer, LBFGS, qadence_loss, tmp_path, str(n), n, lr=1, max_iter=4, tolerance_change=0)
        for n in (1, 2)
    ]
    (one, _, one_losses), (two, _, two_losses) = runs
    assert two_losses == pytest.approx(one_losses, rel=1e-12) and one_losses[-1] < one_losses[0] / 2
    torch.testing.assert_close(_params(two), _params(one), **TOL)


class _Noting(Adam):
    """Adam noting whether each step was given a closure."""

    def step(self, closure=None):
        self.closures.append(closure is not None)
        return super().step(closure)


def test_an_optimizer_whose_step_takes_a_closure_gets_one_except_under_fp16s_grad_scaler(tmp_path, monkeypatch):
    x, y = _points()

    def fit(optimizer_class, name, **fields):
        model = _model()
        optimizer = optimizer_class(model.parameters(), lr=0.02)
        optimizer.closures = []
        config = _config(tmp_path, name, max_iter=1, **fields)
        qaccel.Trainer(model, optimizer, config, qadence_loss, _loader(x, y)).fit()
        return optimizer.closures

    assert fit(_Noting, "closure") == [True] * 8
    assert fit(_Noting, "accumulated", gradient_accumulation_steps=2) == [True] * 4, "no step on a micro-batch"
    # fp16's scaler exists on CUDA only: here the Trainer is told one steps its optimizers
    monkeypatch.setattr(qaccel.Accelerator, "scaler", property(lambda self: torch.amp.GradScaler("cpu")))
    assert fit(_Noting, "scaled") == [False] * 8, "the loss first, then a step without a closure"
    with pytest.raises(ValueError) as caught:
        fit(LBFGS, "lbfgs")
    assert str(caught.value) == (
        "LBFGS.step() requires a closure, which torch's GradScaler cannot pass: mixed_precision='fp16' steps every "
        "optimizer through it. Train with mixed_precision='bf16' or 'no', or with an optimizer that steps without a "
        "closure"
    )


def slope_residual(batch, model):
    """A physics-informed loss that makes its own points: the model's derivative, which autograd takes inside the
    loss, should be 2, and its value at 0 should be -0.5."""
    assert batch is None
    x = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(-1, 1).requires_grad_()
    (slope,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    at_zero = model(torch.zeros(1, 1, dtype=torch.float64))
    return ((slope - 2) ** 2).mean() + ((at_zero + 0.5) ** 2).sum(), {}


def slope_residual_model_first(model, batch):
    return slope_residual(batch, model)


def test_a_trainer_made_without_optimizer_trains_gradient_free_with_gradients_inside_its_loss(tmp_path):
    """``Trainer(model, None, ...)``, then ``disable_grad_opt(ng_optimizer)``: the same path under both Trainers, on
    one process and on 2 ranks (each rank's loss the same, as the loss makes its own points)."""
    component.module("nevergrad")
    import nevergrad

    torch.manual_seed(0)
    initial = torch.nn.Linear(1, 1).double()
    seeded = nevergrad.optimizers.OnePlusOne(parametrization=qaccel.num_parameters(initial), budget=1)
    seeded.parametrization.random_state.seed(0)
    runs = []
    for trainer_class, loss_fn, nprocs in (
        (qaccel.Trainer, slope_residual_model_first, 1),
        (qaccel.perceptrain.Trainer, slope_residual, 1),
        (qaccel.perceptrain.Trainer, slope_residual, 2),
    ):
        model = copy.deepcopy(initial)
        config = _config(tmp_path, f"{trainer_class.__module__}-{nprocs}", nprocs=nprocs, max_iter=20)
        trainer = trainer_class(model, None, config, loss_fn)
        with pytest.raises(ValueError, match="needs a torch optimizer, and this Trainer has none"):
            trainer.fit()
        with trainer.disable_grad_opt(copy.deepcopy(seeded)):
            trainer.fit()
        assert trainer.optimizer is None and trainer.use_grad
        runs.append(([h["train_loss"] for h in trainer.history], _params(model)))
    (losses, params), *others = runs
    for other_losses, other_params in others:
        assert other_losses == pytest.approx(losses, rel=1e-12)
        torch.testing.assert_close(other_params, params, **TOL)
    assert len(losses) == 21 and min(losses) < losses[0] and not torch.equal(params, _params(initial))


def test_perceptrains_modules_hold_qaccels_objects():
    p = qaccel.perceptrain
    assert issubclass(p.Trainer, qaccel.Trainer) and p.trainer.Trainer is p.Trainer
    assert p.TrainConfig is p.config.TrainConfig is qaccel.TrainConfig
    assert p.train_utils.Accelerator is qaccel.Accelerator
    assert p.default_optimize_step is p.optimize_step.optimize_step
    for name in p.__all__:
        if name not in ("Trainer", "default_optimize_step"):
            assert getattr(p, name) is getattr(qaccel, name), name
    for name in ("DictDataLoader", "InfiniteTensorDataset", "OptimizeResult", "to_dataloader", "data_to_device"):
        assert getattr(p.data, name) is getattr(qaccel.data, name), name
    for name in ("get_parameters", "set_parameters", "num_parameters"):
        assert getattr(p.parameters, name) is getattr(qaccel, name), name
    for name in ("write_checkpoint", "load_checkpoint", "load_model"):
        assert getattr(p.callbacks.saveload, name) is getattr(qaccel, name), name
    assert p.callbacks.__all__ == qaccel.callbacks.__all__
    assert all(getattr(p.callbacks, name) is getattr(qaccel.callbacks, name) for name in p.callbacks.__all__)
