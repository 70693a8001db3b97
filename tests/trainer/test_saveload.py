"""qaccel.trainer.saveload and qaccel.trainer.parameters against qadence's own functions: the same file names and
contents, a folder either one wrote is read by the other, the same latest file; and where qaccel differs on
purpose, a failed write or read raises naming the file and a failed write leaves no partial file."""

from __future__ import annotations

import copy
import errno
import os

import pytest
import torch
from support import component

from qaccel.errors import CheckpointError
from qaccel.trainer import parameters, saveload

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def qd():
    """qadence's ml_tools (imported once: about 5 s)."""
    return component.module("qadence.ml_tools")


@pytest.fixture(scope="module")
def qadence_saveload(qd):
    return component.module("qadence.ml_tools.callbacks.saveload")


@pytest.fixture
def ddp_group():
    """A 1-rank gloo default group in this process, for DistributedDataParallel models."""
    import torch.distributed as dist

    if not dist.is_available():
        component.unavailable("torch.distributed is not available in this torch")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _trained(seed=0, steps=2):
    """A model and an Adam optimizer with state (moments, step) after ``steps`` steps."""
    model = _model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _fresh():
    model = _model(seed=1)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def _equal(a, b):
    """Nested state (dicts, lists, tensors, numbers) equal, tensors exactly."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _same_model_and_optimizer(model, optimizer, other_model, other_optimizer):
    return _equal(model.state_dict(), other_model.state_dict()) and _equal(
        optimizer.state_dict(), other_optimizer.state_dict()
    )


def _qnn(qadence, seed):
    torch.manual_seed(seed)
    circuit = qadence.QuantumCircuit(2, qadence.chain(qadence.feature_map(2, param="x"), qadence.hea(2, 1)))
    return qadence.QNN(circuit, observable=qadence.Z(0), inputs=["x"])


def test_a_checkpoint_is_loaded_back_with_its_iteration_tensors_and_optimizer_state(tmp_path):
    model, optimizer = _trained()
    saveload.write_checkpoint(tmp_path, model, optimizer, 7)
    assert sorted(os.listdir(tmp_path)) == [
        "model_Sequential_ckpt_007_device_cpu.pt",
        "opt_Adam_ckpt_007_device_cpu.pt",
    ]
    loaded_model, loaded_optimizer = _fresh()
    got_model, got_optimizer, iteration = saveload.load_checkpoint(tmp_path, loaded_model, loaded_optimizer)
    assert iteration == 7 and got_model is loaded_model and got_optimizer is loaded_optimizer
    assert _same_model_and_optimizer(model, optimizer, loaded_model, loaded_optimizer)
    assert saveload.load_model(str(tmp_path), _model(3))[1] == 7, "a str folder too"


def test_the_files_have_qadences_names_and_contents(tmp_path, qd):
    model, optimizer = _trained()
    ours, theirs = tmp_path / "qaccel", tmp_path / "qadence"
    ours.mkdir(), theirs.mkdir()
    for iteration in (3, 1234, "best"):
        saveload.write_checkpoint(ours, model, optimizer, iteration)
        qd.write_checkpoint(theirs, model, optimizer, iteration)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for name in os.listdir(ours):
        mine, qadences = (torch.load(folder / name, weights_only=False) for folder in (ours, theirs))
        assert _equal(mine, qadences), name


def test_a_folder_qadence_wrote_is_loaded_by_qaccel(tmp_path, qd):
    model, optimizer = _trained()
    for iteration in (1, 2):
        qd.write_checkpoint(tmp_path, model, optimizer, iteration)
    loaded_model, loaded_optimizer = _fresh()
    _, _, iteration = saveload.load_checkpoint(tmp_path, loaded_model, loaded_optimizer)
    assert iteration == 2
    assert _same_model_and_optimizer(model, optimizer, loaded_model, loaded_optimizer)


def test_a_folder_qaccel_wrote_is_loaded_by_qadence(tmp_path, qd):
    model, optimizer = _trained()
    for iteration in (1, 2):
        saveload.write_checkpoint(tmp_path, model, optimizer, iteration)
    loaded_model, loaded_optimizer = _fresh()
    _, _, iteration = qd.load_checkpoint(tmp_path, loaded_model, loaded_optimizer)
    assert iteration == 2
    assert _same_model_and_optimizer(model, optimizer, loaded_model, loaded_optimizer)


def test_qnn_and_quantum_model_checkpoints_are_qadences_to_dict_both_ways(tmp_path, qd):
    qadence = component.module("qadence")
    qm = qadence.QuantumModel(qadence.QuantumCircuit(2, qadence.hea(2, 1)), observable=qadence.Z(0))
    for name, make in (("QNN", lambda seed: _qnn(qadence, seed)), ("QuantumModel", lambda seed: qm)):
        model = make(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        ours, theirs = tmp_path / f"{name}-qaccel", tmp_path / f"{name}-qadence"
        ours.mkdir(), theirs.mkdir()
        saveload.write_checkpoint(ours, model, optimizer, 4)
        qd.write_checkpoint(theirs, model, optimizer, 4)
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        iteration, state = torch.load(ours / f"model_{name}_ckpt_004_device_cpu.pt", weights_only=False)
        assert iteration == 4 and set(state) == {name, "param_dict"}
        expected = {k: v.detach() for k, v in model._params.items()}
        for folder, load in ((theirs, saveload.load_checkpoint), (ours, qd.load_checkpoint)):
            other = make(1)
            if other is model:  # QuantumModel: one instance, changed in place
                with torch.no_grad():
                    for p in other.parameters():
                        p.add_(1.0)
            _, _, got = load(folder, other, torch.optim.Adam(other.parameters(), lr=0.1))
            assert got == 4
            assert _equal({k: v.detach() for k, v in other._params.items()}, expected), (name, folder)


def test_the_latest_checkpoint_is_the_highest_number_for_the_device_as_qadence_chooses(tmp_path, qd, qadence_saveload):
    model, optimizer = _trained()
    for iteration in (2, 10, 7, "best"):
        saveload.write_checkpoint(tmp_path, model, optimizer, iteration)
    torch.save((99, model.state_dict()), tmp_path / "model_Sequential_ckpt_099_device_cuda.pt")
    for device in ("cpu", "cuda", "cuda:1"):
        for kind in ("model", "opt"):
            assert saveload.get_latest_checkpoint_name(
                tmp_path, kind, device
            ) == qadence_saveload.get_latest_checkpoint_name(tmp_path, kind, device)
    assert saveload.get_latest_checkpoint_name(tmp_path, "model").name == "model_Sequential_ckpt_010_device_cpu.pt"
    assert saveload.get_latest_checkpoint_name(tmp_path, "model", "cuda:0").name.endswith("_099_device_cuda.pt")
    assert saveload.load_checkpoint(tmp_path, *_fresh())[2] == 10
    torch.save((12, model.state_dict()), tmp_path / "model_Sequential_12.pt")  # qadence's legacy names count too
    assert saveload.get_latest_checkpoint_name(tmp_path, "model").name == "model_Sequential_12.pt"
    assert saveload.load_model(tmp_path, _model())[1] == 12 == qd.load_checkpoint(tmp_path, *_fresh())[2]


def test_a_best_checkpoint_keeps_its_string_iteration(tmp_path, qd):
    model, optimizer = _trained()
    saveload.write_checkpoint(tmp_path, model, optimizer, "best")
    assert sorted(os.listdir(tmp_path)) == [
        "model_Sequential_ckpt_best_device_cpu.pt",
        "opt_Adam_ckpt_best_device_cpu.pt",
    ]
    _, _, iteration = saveload.load_checkpoint(tmp_path, *_fresh())  # alone: it is the latest
    assert iteration == "best"
    saveload.write_checkpoint(tmp_path, _model(5), optimizer, 3)
    loaded_model, loaded_optimizer = _fresh()
    for load in (saveload.load_checkpoint, qd.load_checkpoint):
        _, _, iteration = load(
            tmp_path,
            loaded_model,
            loaded_optimizer,
            model_ckpt_name="model_Sequential_ckpt_best_device_cpu.pt",
            opt_ckpt_name="opt_Adam_ckpt_best_device_cpu.pt",
        )
        assert iteration == "best"
        assert _same_model_and_optimizer(model, optimizer, loaded_model, loaded_optimizer)
    assert saveload.load_checkpoint(tmp_path, *_fresh())[2] == 3, "a number beats best"


def test_a_missing_folder_is_created_and_nothing_is_loaded(tmp_path):
    model, optimizer = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folder = tmp_path / "a" / "b"
    got_model, got_optimizer, iteration = saveload.load_checkpoint(folder, model, optimizer)
    assert (got_model, got_optimizer, iteration) == (model, optimizer, 0) and folder.is_dir()
    assert saveload.load_checkpoint(folder, model, optimizer)[2] == 0, "an empty folder: nothing either"
    assert _equal(model.state_dict(), before) and optimizer.state_dict()["state"] == {}


def test_a_damaged_checkpoint_raises_naming_the_file(tmp_path, qd):
    model, optimizer = _trained()
    saveload.write_checkpoint(tmp_path, model, optimizer, 1)
    path = tmp_path / "model_Sequential_ckpt_001_device_cpu.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
    with pytest.raises(CheckpointError, match="is damaged or not a checkpoint") as raised:
        saveload.load_checkpoint(tmp_path, *_fresh())
    assert str(path) in str(raised.value) and raised.value.file == str(path) and raised.value.damaged
    assert qd.load_checkpoint(tmp_path, *_fresh())[2] == 0, "qadence logs it and goes on"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"{path} is damaged"):
        saveload.load_model(tmp_path, _model())
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "model_Sequential_ckpt_002_device_cpu.pt")):
        saveload.load_model(tmp_path, _model(), "model_Sequential_ckpt_002_device_cpu.pt")


def test_a_checkpoint_for_another_model_or_optimizer_raises_naming_the_file(tmp_path):
    model, optimizer = _trained()
    saveload.write_checkpoint(tmp_path, model, optimizer, 1)
    other = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="model_Sequential_ckpt_001_device_cpu.pt does not fit the Linear"):
        saveload.load_model(tmp_path, other)
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="opt_Adam_ckpt_001_device_cpu.pt was written for a Adam, not this SGD"):
        saveload.load_optimizer(tmp_path, sgd)


def test_a_failed_write_raises_naming_the_file_and_leaves_no_partial_file(tmp_path, monkeypatch):
    model, optimizer = _trained()
    saveload.write_checkpoint(tmp_path, model, optimizer, "best")
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    real_save = torch.save

    def crash_midway(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(10)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(torch, "save", crash_midway)
    path = tmp_path / "model_Sequential_ckpt_best_device_cpu.pt"
    with pytest.raises(OSError, match=f"write_checkpoint\\(\\) could not write {path}: Input/output error"):
        saveload.write_checkpoint(tmp_path, _model(4), optimizer, "best")
    with pytest.raises(OSError, match="could not write .*model_Sequential_ckpt_005_device_cpu.pt"):
        saveload.write_checkpoint(tmp_path, model, optimizer, 5)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before, (
        "no new or partial file; the previous best is intact"
    )
    monkeypatch.undo()
    with pytest.raises(TypeError, match="not object; nothing was written"):
        saveload.write_checkpoint(tmp_path, model, object(), 6)
    assert sorted(os.listdir(tmp_path)) == sorted(before)
    with pytest.raises(FileNotFoundError, match=f"could not write {tmp_path / 'missing'}"):
        saveload.write_checkpoint(tmp_path / "missing", model, optimizer, 1)


def test_a_ddp_model_is_saved_as_its_module_and_a_qadence_ddp_file_loads_into_a_ddp_model(tmp_path, qd, ddp_group):
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = _trained()
    ours, theirs = tmp_path / "qaccel", tmp_path / "qadence"
    ours.mkdir(), theirs.mkdir()
    saveload.write_checkpoint(ours, DistributedDataParallel(model), optimizer, 1)
    assert sorted(os.listdir(ours)) == ["model_Sequential_ckpt_001_device_cpu.pt", "opt_Adam_ckpt_001_device_cpu.pt"]
    plain, plain_optimizer = _fresh()
    assert qd.load_checkpoint(ours, plain, plain_optimizer)[2] == 1
    assert _same_model_and_optimizer(model, optimizer, plain, plain_optimizer), "qadence loads it into a plain model"
    wrapped = DistributedDataParallel(_model(seed=1))
    saveload.load_model(ours, wrapped)
    assert _equal(wrapped.module.state_dict(), model.state_dict()), "and qaccel into a DDP model's module"

    qd.write_checkpoint(theirs, DistributedDataParallel(model), optimizer, 2)
    assert "model_DistributedDataParallel_ckpt_002_device_cpu.pt" in os.listdir(theirs)
    wrapped = DistributedDataParallel(_model(seed=1))
    assert saveload.load_model(theirs, wrapped)[1] == 2
    assert _equal(wrapped.module.state_dict(), model.state_dict())
    with pytest.raises(CheckpointError, match="does not fit the Sequential"):  # qadence: logged, not loaded
        saveload.load_model(theirs, _model())


def test_a_nevergrad_optimizer_is_written_and_loaded_as_qadence_does(tmp_path, qd):
    ng = component.module("nevergrad")
    model = _model()
    optimizer = ng.optimizers.NGOpt(parametrization=3, budget=20)
    optimizer.tell(optimizer.ask(), 1.0)
    ours, theirs = tmp_path / "qaccel", tmp_path / "qadence"
    ours.mkdir(), theirs.mkdir()
    saveload.write_checkpoint(ours, model, optimizer, 1)
    qd.write_checkpoint(theirs, model, optimizer, 1)
    assert (
        sorted(os.listdir(ours))
        == sorted(os.listdir(theirs))
        == ["model_Sequential_ckpt_001_device_cpu.pt", "opt_NGOpt_ckpt_001_device_cpu.pt"]
    )
    for folder, load in ((theirs, saveload.load_checkpoint), (ours, qd.load_checkpoint)):
        fresh = ng.optimizers.NGOpt(parametrization=3, budget=20)
        _, loaded, _ = load(folder, _model(1), fresh)
        assert loaded is not fresh and loaded.name == optimizer.name and loaded.num_tell == 1


def test_get_set_and_num_parameters_are_qadences(qd):
    qadence = component.module("qadence")
    model = _model()
    model[0].bias.requires_grad_(False)  # frozen: left out
    model.scale = torch.nn.Parameter(torch.tensor(2.0))  # 0-dimensional
    for m in (model, _qnn(qadence, 0)):
        assert torch.equal(parameters.get_parameters(m), qd.get_parameters(m))
        assert parameters.num_parameters(m) == qd.num_parameters(m)
        theta = torch.arange(qd.num_parameters(m), dtype=torch.float32) / 10
        ours, theirs = copy.deepcopy(m), copy.deepcopy(m)
        parameters.set_parameters(ours, theta)
        qd.set_parameters(theirs, theta)
        assert _equal(ours.state_dict(), theirs.state_dict())
        assert torch.equal(parameters.get_parameters(ours), theta)
    assert parameters.num_parameters(model) == 4 * 3 + 4 + 1 + 1


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_run_folder_a_fit_checkpointed_loads_its_newest_checkpoint(tmp_path, nprocs):
    """A perceptrain script reads what its fit saved with ``load_checkpoint(config.log_folder, ...)``: from a qaccel
    fit's folder, the newest checkpoint's model and optimizer, at the last epoch done."""
    from qaccel import TrainConfig, Trainer, to_dataloader

    model, optimizer = _trained(steps=0)
    x = torch.randn(8, 3)
    config = TrainConfig(max_iter=3, checkpoint_every=1, nprocs=nprocs, compute_setup="cpu", verbose=False)
    config.log_folder = tmp_path / "run"
    Trainer(model, optimizer, config, "mse", to_dataloader(x, x.sum(1, keepdim=True), batch_size=4)).fit()
    loaded_model, loaded_optimizer = _fresh()
    got_model, got_optimizer, iteration = saveload.load_checkpoint(config.log_folder, loaded_model, loaded_optimizer)
    assert iteration == 3 and got_model is loaded_model and got_optimizer is loaded_optimizer
    assert _equal(model.state_dict(), loaded_model.state_dict()), "the trained weights, as fit() gave them back"
    assert _equal(optimizer.state_dict()["state"], loaded_optimizer.state_dict()["state"])
    assert loaded_optimizer.param_groups[0]["lr"] == 0.1, "the fit's rate, not the fresh optimizer's 0.5"


def test_the_best_checkpoint_of_a_fit_loads_from_its_folder(tmp_path):
    from qaccel import TrainConfig, Trainer, to_dataloader

    model, optimizer = _trained(steps=0)
    x = torch.randn(8, 3)
    loader = to_dataloader(x, x.sum(1, keepdim=True), batch_size=4)
    config = TrainConfig(max_iter=3, val_every=1, checkpoint_best_only=True, compute_setup="cpu", verbose=False)
    config.log_folder = tmp_path / "run"
    trainer = Trainer(model, optimizer, config, "mse", loader, loader)
    trainer.fit()
    loaded_model, loaded_optimizer = _fresh()
    _, _, iteration = saveload.load_checkpoint(config.log_folder / "best", loaded_model, loaded_optimizer)
    assert iteration == "best", "as qadence's and perceptrain's best file"
    assert loaded_optimizer.param_groups[0]["lr"] == 0.1 and loaded_optimizer.state_dict()["state"]
    assert not _equal(loaded_model.state_dict(), _fresh()[0].state_dict()), "the best model's weights"
