"""save (once, from the main process, atomically), get_state_dict and save_model, on real 2-rank gloo worlds."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(120)


def _save_from_every_rank(a, directory):
    a.save({"from": a.rank}, directory / "shared.pt")
    a.save({"from": a.rank}, directory / f"rank{a.rank}.pt")
    a.wait_for_everyone()
    return torch.load(directory / "shared.pt", weights_only=True)


def test_save_writes_once_from_the_main_process(acc, tmp_path):
    read_back = acc.distribute(_save_from_every_rank, all_results=True)(acc, tmp_path)
    assert read_back == [{"from": 0}, {"from": 0}]
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "shared.pt"]


def _failing_save(obj, f, *args, **kwargs):
    f.write(b"half a checkpoint")
    raise OSError("disk full")


def test_interrupted_save_keeps_the_previous_file(single, tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    single.save({"step": 1}, path)
    monkeypatch.setattr(torch, "save", _failing_save)
    with pytest.raises(OSError, match="disk full"):
        single.save({"step": 2}, path)
    with pytest.raises(OSError, match="disk full"):
        single.save({"step": 2}, tmp_path / "new.pt")
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert os.listdir(tmp_path) == ["state.pt"]


def test_save_accepts_a_bare_file_name(single, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    single.save([1, 2], "here.pt")
    assert torch.load(tmp_path / "here.pt", weights_only=True) == [1, 2]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _prepared_state_dict(a, directory):
    torch.manual_seed(0)
    model = a.prepare(_model())
    assert isinstance(model, DistributedDataParallel)
    state = a.get_state_dict(model)
    _model().load_state_dict(state, strict=True)
    a.save_model(model, directory)
    return state


def test_get_state_dict_and_save_model_of_a_ddp_model(acc, tmp_path):
    directory = tmp_path / "checkpoints" / "final"
    states = acc.distribute(_prepared_state_dict, all_results=True)(acc, directory)
    assert list(states[0]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert os.listdir(directory) == ["model.pt"]
    loaded = torch.load(directory / "model.pt", weights_only=True)
    plain = _model()
    plain.load_state_dict(loaded, strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, states[0][key]) and torch.equal(value, states[1][key])


def test_get_state_dict_strips_torch_compile(single):
    model = _model()
    compiled = torch.compile(model)
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    state = single.get_state_dict(compiled)
    assert list(state) == list(model.state_dict())
    _model().load_state_dict(state, strict=True)


def test_a_compiled_models_checkpoint_loads_into_a_compiled_model(single, tmp_path):
    """save_state writes the state without torch.compile's ``_orig_mod.`` prefix; load_state strips the same
    wrappers, so the checkpoint loads back (and into the plain model, and vice versa)."""
    saved = single.prepare(torch.compile(_model()))
    single.save_state(tmp_path / "ckpt")
    for model in (torch.compile(_model()), _model()):
        fresh = Accelerator(nprocs=1, compute_setup="cpu")
        fresh.prepare(model)
        plain = getattr(model, "_orig_mod", model)
        torch.nn.init.zeros_(plain[0].weight)
        fresh.load_state(tmp_path / "ckpt")
        assert torch.equal(plain[0].weight, saved._orig_mod[0].weight)


def test_save_model_round_trip_in_one_process(single, tmp_path):
    model = _model()
    single.save_model(model, tmp_path)
    single.save_model(model, tmp_path)  # the directory may exist
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
