"""Collectives on a real 2-rank gloo world, and as identities in one process."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(120)


def _metrics(rank):
    return {
        "loss": 1.0 + rank,  # float
        "count": 3 + rank,  # int
        "vec": torch.tensor([1.0, 2.0]) * (rank + 1),  # float32 tensor
        "ints": torch.tensor([[rank, 10]]),  # int64 2-D tensor
        "flag": torch.tensor(bool(rank)),  # bool tensor
    }


def _reduce_all_ops(a):
    return {op: a.all_reduce_dict(_metrics(a.rank), op=op) for op in ("mean", "sum", "max", "min")}


def test_all_reduce_dict_values_and_kinds(acc):
    out = acc.distribute(_reduce_all_ops, all_results=True)(acc)
    assert out[0].keys() == out[1].keys()
    for op in ("mean", "sum", "max", "min"):
        assert out[0][op]["vec"].equal(out[1][op]["vec"])
    mean, total, high, low = (out[0][k] for k in ("mean", "sum", "max", "min"))
    assert mean["loss"] == 1.5 and type(mean["loss"]) is float
    assert mean["count"] == 3.5 and type(mean["count"]) is float
    assert total["count"] == 7 and type(total["count"]) is int
    assert total["loss"] == 3.0 and type(total["loss"]) is float
    assert high["count"] == 4 and low["count"] == 3 and type(high["count"]) is int
    assert torch.equal(mean["vec"], torch.tensor([1.5, 3.0])) and mean["vec"].dtype == torch.float32
    assert torch.equal(total["ints"], torch.tensor([[1, 20]])) and total["ints"].shape == (1, 2)
    assert total["ints"].dtype == torch.int64
    assert mean["ints"].dtype.is_floating_point and torch.allclose(mean["ints"], torch.tensor([[0.5, 10.0]]))
    assert high["flag"].dtype == torch.bool and high["flag"].item() is True and low["flag"].item() is False
    assert total["flag"].item() == 1


def _count_collectives(a, n_float_keys):
    calls = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        values = {f"f{i}": float(i) for i in range(n_float_keys)}
        values.update({"n": 1, "m": 2, "t": torch.ones(3)})
        out = a.all_reduce_dict(values, op="sum")
    finally:
        dist.all_reduce = real
    return calls, out


def test_one_collective_per_dtype_not_per_key(acc):
    calls, out = acc.distribute(_count_collectives)(acc, 32)
    assert sorted(map(str, calls)) == ["torch.float32", "torch.float64", "torch.int64"]
    assert out["f31"] == 62.0 and out["n"] == 2 and out["t"].tolist() == [2.0, 2.0, 2.0]


def _broadcast_and_gather(a):
    payload = {"from": a.rank, "data": list(range(a.rank + 2))}
    got = a.broadcast(payload, src=1)
    gathered = a.gather_object([a.rank * 10]), a.gather_object((a.rank, "x"))
    a.wait_for_everyone()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        a.print("hello from", a.rank)
    return got, gathered, buffer.getvalue()


def test_broadcast_gather_barrier_print(acc):
    out = acc.distribute(_broadcast_and_gather, all_results=True)(acc)
    for got, gathered, _ in out:
        assert got == {"from": 1, "data": [0, 1, 2]}
        assert gathered == ([0, 10], [0, "x", 1, "x"]), "the ranks' lists concatenated, as in Accelerate"
    assert [printed for *_, printed in out] == ["hello from 0\n", ""]


def test_identity_in_a_single_process():
    acc = Accelerator(nprocs=1, compute_setup="cpu")
    vec = torch.tensor([1, 2])
    out = acc.all_reduce_dict({"loss": 2.0, "n": 3, "vec": vec}, op="mean")
    assert out["loss"] == 2.0 and out["n"] == 3.0 and type(out["n"]) is float
    assert torch.equal(out["vec"], torch.tensor([1.0, 2.0]))
    summed = acc.all_reduce_dict({"n": 3, "vec": vec}, op="sum")
    assert summed["n"] == 3 and type(summed["n"]) is int
    summed["vec"].add_(1)
    assert vec.tolist() == [1, 2], "the result must not alias the input"
    assert acc.broadcast("x") == "x" and acc.gather_object([5]) == [5]
    with pytest.raises(TypeError, match=r"got a int: gather_object\(\[obj\]\) gives one entry per rank"):
        acc.gather_object(5)
    acc.wait_for_everyone()


def test_bad_collective_arguments():
    acc = Accelerator(nprocs=1, compute_setup="cpu")
    with pytest.raises(ValueError, match="op must be one of 'mean', 'sum', 'max', 'min'; got 'avg'"):
        acc.all_reduce_dict({"a": 1.0}, op="avg")
    with pytest.raises(TypeError, match="value of 'name' is str; expected a tensor, int or float"):
        acc.all_reduce_dict({"name": "x"})
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 0\]; got 1"):
        acc.broadcast(1, src=1)
