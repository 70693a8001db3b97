"""Seeds, main-process-first, split_between_processes and checkpoint saving, on real 2-rank gloo worlds."""

from __future__ import annotations

import dataclasses
import os
import random
import time

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel import Accelerator, group, ranks

pytestmark = pytest.mark.timeout(120)


# ---- seeds ----


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def _seeded_draws(seed):
    Accelerator(nprocs=1, compute_setup="cpu").set_seed(seed)
    return _draws()


def _assert_same_draws(got, want):
    assert got[:2] == want[:2]
    assert torch.equal(got[2], want[2])


def test_set_seed_reproduces_python_numpy_and_torch_draws():
    first, second = _seeded_draws(3), _seeded_draws(3)
    _assert_same_draws(first, second)
    other = _seeded_draws(4)
    assert first[0] != other[0] and first[1] != other[1] and not torch.equal(first[2], other[2])


def _rank_draws(a, device_specific):
    a.set_seed(7, device_specific=device_specific)
    return _draws()


def test_device_specific_seed_differs_by_rank(acc):
    shared = acc.distribute(_rank_draws, all_results=True)(acc, False)
    _assert_same_draws(shared[0], _seeded_draws(7))
    _assert_same_draws(shared[1], _seeded_draws(7))
    specific = acc.distribute(_rank_draws, all_results=True)(acc, True)
    _assert_same_draws(specific[0], _seeded_draws(7))
    _assert_same_draws(specific[1], _seeded_draws(8))


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "3", None, True])
def test_bad_seed_raises(single, seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32 - 1\]; got"):
        single.set_seed(seed)


def test_largest_seed_is_accepted(single):
    single.set_seed(2**32 - 1)
    single.set_seed(np.int64(5))


# ---- main_process_first ----


def _append(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def _read_lines(path):
    with open(path) as f:
        return f.read().split()


def _main_first(a, path, local):
    with (a.local_main_process_first() if local else a.main_process_first()):
        if a.is_main_process:
            time.sleep(0.5)  # without the barrier, rank 1 would write first
        _append(path, str(a.rank))
    return _read_lines(path)  # the second barrier: every rank's entry is there once the block is left


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_main_process_runs_the_block_first(acc, tmp_path, local):
    path = tmp_path / "order.txt"
    seen = acc.distribute(_main_first, all_results=True)(acc, path, local)
    assert seen == [["0", "1"], ["0", "1"]]


def _two_nodes_local_first(path):
    ctx = group.current()
    one_rank_per_node = dataclasses.replace(ctx, local_rank=0, local_world_size=1, node_rank=ctx.rank)
    with ranks.main_process_first(one_rank_per_node, local=True):
        _append(path, str(ctx.rank))
        deadline = time.monotonic() + 20
        while len(_read_lines(path)) < 2:  # both local mains run the block at once
            if time.monotonic() > deadline:
                raise TimeoutError("the other node's local main did not enter the block alongside this one")
            time.sleep(0.01)
    return sorted(_read_lines(path))


def test_local_main_process_first_lets_every_nodes_main_in_together(acc, tmp_path):
    path = tmp_path / "order.txt"
    path.touch()
    assert acc.distribute(_two_nodes_local_first, all_results=True)(path) == [["0", "1"], ["0", "1"]]


def _main_raises(a):
    with a.main_process_first():
        if a.is_main_process:
            raise ValueError("main failed in the block")
        time.sleep(60)  # blocked forever, unless the launcher stops this rank


def test_exception_on_main_is_reported_without_hanging(acc):
    start = time.monotonic()
    with pytest.raises(ValueError, match="main failed in the block") as info:
        acc.distribute(_main_raises)(acc)
    assert time.monotonic() - start < 10
    assert any(note.startswith("[qaccel] raised on rank 0 of 2") for note in info.value.__notes__)


def _main_raises_and_recovers(a, path):
    try:
        with a.main_process_first():
            if a.is_main_process:
                raise ValueError("main failed in the block")
            _append(path, "rank 1 ran the block")
    except ValueError:
        a.wait_for_everyone()  # the barrier the others wait on after the block
        return "raised"
    return "ran"


def test_exception_on_main_still_releases_the_others(acc, tmp_path):
    path = tmp_path / "log.txt"
    assert acc.distribute(_main_raises_and_recovers, all_results=True)(acc, path) == ["raised", "ran"]
    assert path.read_text() == "rank 1 ran the block\n"


def test_main_process_first_is_an_identity_in_one_process(single):
    with single.main_process_first():
        pass
    with single.local_main_process_first():
        pass


# ---- split_between_processes ----


def _split(a, obj, apply_padding=False):
    with a.split_between_processes(obj, apply_padding=apply_padding) as share:
        return share


def _all_splits(a):
    rows = torch.arange(10).reshape(5, 2)
    return {
        "list": _split(a, [0, 1, 2, 3, 4]),
        "tuple": _split(a, ("a", "b", "c")),
        "dict": _split(a, {"e": 0, "d": 1, "c": 2, "b": 3, "a": 4}),
        "tensor": _split(a, rows),
        "even": _split(a, [0, 1, 2, 3]),
        "short": _split(a, ["only"]),
        "empty": _split(a, []),
        "padded list": _split(a, [0, 1, 2, 3, 4], apply_padding=True),
        "padded tuple": _split(a, (0, 1, 2), apply_padding=True),
        "padded tensor": _split(a, rows, apply_padding=True),
        "padded short": _split(a, ["only"], apply_padding=True),
        "padded even": _split(a, [0, 1, 2, 3], apply_padding=True),
    }


@pytest.fixture(scope="module")
def shares(acc):
    return acc.distribute(_all_splits, all_results=True)(acc)


def _by_rank(shares, case):
    return [s[case] for s in shares]


def test_split_gives_the_first_ranks_one_item_more(shares):
    assert _by_rank(shares, "list") == [[0, 1, 2], [3, 4]]
    assert _by_rank(shares, "tuple") == [("a", "b"), ("c",)]
    assert _by_rank(shares, "even") == [[0, 1], [2, 3]]
    assert _by_rank(shares, "short") == [["only"], []]
    assert _by_rank(shares, "empty") == [[], []]


def test_split_dict_by_keys_in_insertion_order(shares):
    first, second = _by_rank(shares, "dict")
    assert type(first) is dict and list(first.items()) == [("e", 0), ("d", 1), ("c", 2)]
    assert list(second.items()) == [("b", 3), ("a", 4)]


def test_split_tensor_on_dim_0(shares):
    first, second = _by_rank(shares, "tensor")
    assert torch.equal(first, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert torch.equal(second, torch.tensor([[6, 7], [8, 9]]))


def test_split_padding_repeats_the_last_item(shares):
    assert _by_rank(shares, "padded list") == [[0, 1, 2], [3, 4, 4]]
    assert _by_rank(shares, "padded tuple") == [(0, 1), (2, 2)]
    assert _by_rank(shares, "padded short") == [["only"], ["only"]]
    assert _by_rank(shares, "padded even") == [[0, 1], [2, 3]]
    first, second = _by_rank(shares, "padded tensor")
    assert torch.equal(first, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert torch.equal(second, torch.tensor([[6, 7], [8, 9], [8, 9]]))


def test_split_yields_the_whole_object_in_one_process(single, acc):
    for obj in ([1, 2, 3], (1, 2), {"a": 1}, torch.arange(3)):
        with single.split_between_processes(obj) as share:
            assert share is obj
    with single.split_between_processes([1, 2, 3], apply_padding=True) as share:
        assert share == [1, 2, 3]
    with acc.split_between_processes([1, 2, 3]) as share:  # the caller, outside any rank
        assert share == [1, 2, 3]


def test_split_rejects_what_it_cannot_split(single):
    with pytest.raises(TypeError, match="takes a list, tuple, dict, Tensor; got a set"):
        with single.split_between_processes({1, 2}):
            pass
    with pytest.raises(ValueError, match="a dict cannot be padded"):
        with single.split_between_processes({"a": 1}, apply_padding=True):
            pass
    with pytest.raises(ValueError, match="a 0-dim tensor has no dim 0 to split"):
        with single.split_between_processes(torch.tensor(1.0)):
            pass


# ---- saving ----


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


def test_save_model_round_trip_in_one_process(single, tmp_path):
    model = _model()
    single.save_model(model, tmp_path)
    single.save_model(model, tmp_path)  # the directory may exist
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
