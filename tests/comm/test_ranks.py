"""main_process_first, local_main_process_first and split_between_processes (qaccel/comm/ranks.py), on real 2-rank gloo
worlds."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from support import component
from support.procs import wait_for

from qaccel import Accelerator
from qaccel.comm import ranks, session

pytestmark = pytest.mark.timeout(120)


# ---- main_process_first ----


def _append(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def _read_lines(path):
    with open(path) as f:
        return f.read().split()


def _main_first(a, path, local):
    with a.local_main_process_first() if local else a.main_process_first():
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
    ctx = session.current()
    one_rank_per_node = dataclasses.replace(ctx, local_rank=0, local_world_size=1, node_rank=ctx.rank)
    with ranks.main_process_first(one_rank_per_node, local=True):
        _append(path, str(ctx.rank))
        wait_for(
            lambda: len(_read_lines(path)) >= 2,
            20,  # both local mains run the block at once
            "the other node's local main to enter the block alongside this one",
            interval=0.01,
        )
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
        "dict": _split(a, {"ids": [0, 1, 2, 3, 4], "rows": rows, "names": ("a", "b", "c", "d", "e")}),
        "padded dict": _split(a, {"ids": [0, 1, 2], "rows": rows[:3]}, apply_padding=True),
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


def test_split_dict_splits_every_value_as_accelerate_does(shares):
    first, second = _by_rank(shares, "dict")
    assert list(first) == ["ids", "rows", "names"] and first["ids"] == [0, 1, 2] and first["names"] == ("a", "b", "c")
    assert torch.equal(first["rows"], torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert second["ids"] == [3, 4] and second["names"] == ("d", "e")
    assert torch.equal(second["rows"], torch.tensor([[6, 7], [8, 9]]))
    first, second = _by_rank(shares, "padded dict")
    assert first["ids"] == [0, 1] and second["ids"] == [2, 2]
    assert torch.equal(second["rows"], torch.tensor([[4, 5], [4, 5]]))


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
    for obj in ([1, 2, 3], (1, 2), {"a": [1]}, torch.arange(3)):
        with single.split_between_processes(obj) as share:
            assert share is obj
    with single.split_between_processes([1, 2, 3], apply_padding=True) as share:
        assert share == [1, 2, 3]
    with acc.split_between_processes([1, 2, 3]) as share:  # the caller, outside any rank
        assert share == [1, 2, 3]


def test_split_rejects_what_it_cannot_split(single):
    with (
        pytest.raises(TypeError, match="takes a list, tuple, Tensor, a dict of those, or a dataset with select"),
        single.split_between_processes({1, 2}),
    ):
        pass
    with pytest.raises(TypeError, match="got a int"), single.split_between_processes({"a": 1}):
        pass
    with (
        pytest.raises(ValueError, match="they need one length; got {'a': 2, 'b': 3}"),
        single.split_between_processes({"a": [1, 2], "b": [1, 2, 3]}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="a 0-dim tensor has no dim 0 to split"),
        single.split_between_processes(torch.tensor(1.0)),
    ):
        pass


class _Selectable:
    """A dataset with select(), as Hugging Face datasets' Dataset has."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def select(self, indices):
        return _Selectable([self.rows[i] for i in indices])


def _split_dataset(a):
    return _split(a, _Selectable(["a", "b", "c"])).rows, _split(a, _Selectable(["a", "b", "c"]), True).rows


def test_split_a_dataset_through_its_select(acc):
    assert acc.distribute(_split_dataset, all_results=True)(acc) == [(["a", "b"], ["a", "b"]), (["c"], ["c", "c"])]


# ---- Accelerate's names: which rank runs what, triggers, RNG states ----


def _names(a):
    ran = []
    for name, decorate in [
        ("main", a.on_main_process),
        ("local main", a.on_local_main_process),
        ("last", a.on_last_process),
        ("rank 1", a.on_process(process_index=1)),
        ("local 0", a.on_local_process(local_process_index=0)),
    ]:
        result = decorate(lambda name=name: ran.append(name) or name)()
        assert result == (name if name in ran else None)
    called_as_function = a.on_process(lambda: "yes", 0)()
    aliases = (a.num_processes, a.process_index, a.local_process_index, a.is_last_process)
    return ran, called_as_function, aliases


def test_on_process_decorators_and_accelerates_aliases(acc):
    (ran0, direct0, aliases0), (ran1, direct1, aliases1) = acc.distribute(_names, all_results=True)(acc)
    assert ran0 == ["main", "local main", "local 0"] and ran1 == ["last", "rank 1"]
    assert (direct0, direct1) == ("yes", None)
    assert (aliases0, aliases1) == ((2, 0, 0, False), (2, 1, 1, True))


def _state(a):
    state = a.state
    return (
        state.distributed_type,
        state.num_processes,
        state.process_index,
        state.is_main_process,
        state.is_last_process,
        state.use_distributed,
        a.distributed_type,
        str(state.device),
    )


def test_accelerates_state_and_distributed_type_tell_where_each_rank_runs(acc, single, tmp_path):
    accelerate_type = component.module("accelerate.utils").DistributedType  # what a script compares with
    first, last = acc.distribute(_state, all_results=True)(acc)
    assert first == ("MULTI_CPU", 2, 0, True, False, True, "MULTI_CPU", "cpu")
    assert last == ("MULTI_CPU", 2, 1, False, True, True, "MULTI_CPU", "cpu")
    assert acc.distribute(lambda: acc.distributed_type == accelerate_type.MULTI_CPU)()
    assert _state(single)[:6] == ("NO", 1, 0, True, True, False) and not single.use_distributed
    assert single.project_dir is None
    assert Accelerator(compute_setup="cpu", project_dir=tmp_path / "p").project_dir == str(tmp_path / "p")


def test_on_process_runs_everything_in_one_process_and_checks_the_index(single):
    assert single.on_process(lambda: 1, process_index=5)() == 1 and single.on_last_process(lambda: 2)() == 2
    with pytest.raises(ValueError, match="process_index must be a non-negative int \\(a rank\\); got None"):
        single.on_process(lambda: 1)


def _triggers(a):
    seen = [a.check_trigger()]
    if a.rank == 1:
        a.set_trigger()
    seen += [a.check_trigger(), a.check_trigger()]  # seen by every rank once, then lowered
    return seen


def test_a_trigger_set_on_one_rank_is_seen_by_every_rank_at_the_next_check(acc):
    assert acc.distribute(_triggers, all_results=True)(acc) == [[False, True, False]] * 2


def _rng(a):
    torch.manual_seed(a.rank)
    generator = torch.Generator().manual_seed(10 + a.rank)
    a.synchronize_rng_states(["torch", "cuda", "generator"], generator)
    return torch.rand(3).tolist(), torch.rand(3, generator=generator).tolist()


def test_synchronize_rng_states_gives_every_rank_rank_0s_states(acc):
    first, second = acc.distribute(_rng, all_results=True)(acc)
    assert first == second
    torch.manual_seed(0)
    assert first[0] == torch.rand(3).tolist()
    assert first[1] == torch.rand(3, generator=torch.Generator().manual_seed(10)).tolist()


def test_synchronize_rng_states_names_what_it_takes(single):
    with pytest.raises(ValueError, match="rng_types holds 'torch', 'cuda', 'generator'; got 'numpy'"):
        single.synchronize_rng_states(["numpy"])
    with pytest.raises(ValueError, match="rng_types 'generator' needs generator="):
        single.synchronize_rng_states(["generator"])
