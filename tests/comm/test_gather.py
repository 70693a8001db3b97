"""gather, pad_across_processes, reduce and gather_for_metrics on a real 2-rank gloo world, and in one process."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(120)

Pair = namedtuple("Pair", ["first", "second"])


def _on_both(acc, fn, *args):
    return acc.distribute(fn, all_results=True)(acc, *args)


def _gather_rows(a):
    """Rows 0.. of rank 0 then rows 100.. of rank 1, for equal (2, 2) and unequal (3, 1) row counts."""
    out = {}
    for dtype in (torch.int64, torch.float64):
        for counts in ((2, 2), (3, 1)):
            rows = counts[a.rank]
            out[dtype, counts] = a.gather(torch.arange(rows * 2, dtype=dtype).reshape(rows, 2) + 100 * a.rank)
    return out


def test_gather_concatenates_in_rank_order_and_trims_the_padding(acc):
    for out in _on_both(acc, _gather_rows):
        for dtype in (torch.int64, torch.float64):
            equal, unequal = out[dtype, (2, 2)], out[dtype, (3, 1)]
            assert torch.equal(equal, torch.tensor([[0, 1], [2, 3], [100, 101], [102, 103]], dtype=dtype))
            assert torch.equal(unequal, torch.tensor([[0, 1], [2, 3], [4, 5], [100, 101]], dtype=dtype))


def _gather_nested(a):
    r = a.rank
    return a.gather(
        {
            "scalar": torch.tensor(1.5 * r),
            "pair": Pair(torch.full((r + 1,), r), (torch.ones(1, 2, dtype=torch.float64) * r,)),
            "ordered": OrderedDict([("mask", torch.tensor([bool(r)]))]),
        }
    )


def test_gather_scalars_and_nested_structures(acc):
    for out in _on_both(acc, _gather_nested):
        assert torch.equal(out["scalar"], torch.tensor([0.0, 1.5]))
        assert type(out["pair"]) is Pair and type(out["pair"].second) is tuple
        assert out["pair"].first.tolist() == [0, 1, 1]
        assert torch.equal(out["pair"].second[0], torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
        assert type(out["ordered"]) is OrderedDict and out["ordered"]["mask"].tolist() == [False, True]


def _errors_then_gather(a):
    messages = []
    mismatched = [
        torch.zeros(2, 3 + a.rank),  # trailing dim differs
        torch.zeros(2, 3) if a.rank == 0 else torch.zeros(2),  # ndim differs
        [torch.zeros(1)] * (a.rank + 1),  # number of tensors differs
        torch.zeros(1, dtype=torch.float32 if a.rank == 0 else torch.float64),
    ]
    for data in mismatched:
        try:
            a.gather(data)
        except ValueError as exc:
            messages.append(str(exc))
    return messages, a.gather(torch.tensor([a.rank])).tolist()


def test_gather_mismatch_raises_on_every_rank_and_the_group_stays_usable(acc):
    for messages, after in _on_both(acc, _errors_then_gather):
        assert len(messages) == 4
        assert "[(2, 3), (2, 4)]" in messages[0] and "every dim but dim 0" in messages[0]
        assert "[(2, 3), (2,)]" in messages[1]
        assert "different numbers of tensors: [1, 2]" in messages[2]
        assert "torch.float32" in messages[3] and "torch.float64" in messages[3]
        assert after == [0, 1]


def _pad(a):
    r = a.rank
    rows = torch.arange(1 + 2 * r).reshape(-1, 1) + 10 * r  # rank 0: 1 row, rank 1: 3 rows
    cols = torch.ones(2, 1 + 2 * r)
    scalar = torch.tensor(float(r))
    return (
        a.pad_across_processes(rows),
        a.pad_across_processes({"cols": cols, "scalar": scalar}, dim=1, pad_index=-1, pad_first=True),
        a.pad_across_processes([rows], dim=-2, pad_index=7),
        scalar,
    )


def test_pad_across_processes(acc):
    (rows0, nested0, listed0, _), (rows1, nested1, _listed1, _scalar1) = _on_both(acc, _pad)
    assert rows0.tolist() == [[0], [0], [0]] and rows1.tolist() == [[10], [11], [12]]
    assert nested0["cols"].tolist() == [[-1, -1, 1], [-1, -1, 1]]
    assert nested1["cols"].shape == (2, 3) and nested1["cols"].eq(1).all()
    assert nested1["scalar"].shape == () and nested1["scalar"].item() == 1.0
    assert type(listed0) is list and listed0[0].tolist() == [[0], [7], [7]]


def _reduce(a):
    r = a.rank
    data = {
        "x": torch.tensor([1.0, 2.0]) * (r + 1),
        "ints": (torch.tensor([[r, 3]]),),
        "flag": torch.tensor([bool(r), True]),
    }
    return data, {op: a.reduce(data, op) for op in ("sum", "mean", "max", "min")}


def test_reduce_each_op(acc):
    expected = {  # op: x, ints, flag
        "sum": ([3.0, 6.0], [[1, 6]], [1, 2]),
        "mean": ([1.5, 3.0], [[0.5, 3.0]], [0.5, 1.0]),
        "max": ([2.0, 4.0], [[1, 3]], [True, True]),
        "min": ([1.0, 2.0], [[0, 3]], [False, True]),
    }
    flag_dtypes = {"sum": torch.int64, "mean": torch.float32, "max": torch.bool, "min": torch.bool}
    for rank, (data, reduced) in enumerate(_on_both(acc, _reduce)):
        assert data["x"].tolist() == [1.0 * (rank + 1), 2.0 * (rank + 1)], "the input must not be modified"
        for op, (x, ints, flag) in expected.items():
            out = reduced[op]
            assert out["x"].tolist() == x and out["x"].dtype == torch.float32
            assert type(out["ints"]) is tuple and out["ints"][0].tolist() == ints
            assert out["ints"][0].dtype == (torch.float32 if op == "mean" else torch.int64)
            assert out["flag"].tolist() == flag and out["flag"].dtype == flag_dtypes[op]


def _gather_for_metrics(a):
    r = a.rank
    data = {"pred": torch.arange(4) + 4 * r, "emb": torch.ones(4, 3) * r}
    everything = a.gather_for_metrics(data)
    a._registry().marks.remainder = 5  # what a prepared loader marks on a padded last step
    try:
        return everything, a.gather_for_metrics(data)
    finally:
        a._registry().marks.remainder = None


def test_gather_for_metrics_drops_the_padded_duplicates(acc):
    for everything, exact in _on_both(acc, _gather_for_metrics):
        for out, rows in ((everything, 8), (exact, 5)):
            assert out["pred"].tolist() == list(range(rows))
            assert out["emb"].shape == (rows, 3) and out["emb"][4:].eq(1).all() and out["emb"][:4].eq(0).all()


def test_single_process_identities():
    single = Accelerator(nprocs=1, compute_setup="cpu")
    x = torch.arange(6).reshape(3, 2)
    assert single.gather(x) is x and single.gather_for_metrics(x) is x
    assert single.gather(torch.tensor(2.0)).tolist() == [2.0]
    nested = single.gather({"p": Pair(x, [x])})
    assert type(nested["p"]) is Pair and nested["p"].second[0] is x
    assert single.pad_across_processes(x, dim=1) is x
    assert single.reduce(x, reduction="mean", scale=0.5).tolist() == (x * 0.5).tolist(), "Accelerate's signature"
    summed = single.reduce(x, "sum")
    assert torch.equal(summed, x) and summed is not x
    summed.add_(1)
    assert x[0, 0].item() == 0, "the result must not alias the input"
    mean = single.reduce((x,), "mean")[0]
    assert mean.dtype.is_floating_point and torch.equal(mean, x.float())


def test_bad_arguments():
    single = Accelerator(nprocs=1, compute_setup="cpu")
    for call in (single.gather, single.gather_for_metrics, single.pad_across_processes):
        with pytest.raises(TypeError, match="got a str; use gather_object"):
            call({"x": torch.ones(1), "name": "x"})
    with pytest.raises(TypeError, match="reduce\\(\\) takes tensors .* got a float"):
        single.reduce([1.0], "sum")
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum', 'max', 'min'; got 'avg'"):
        single.reduce(torch.ones(1), "avg")
    with pytest.raises(IndexError, match=r"dim 2 is out of range for a tensor of shape \(3, 2\)"):
        single.pad_across_processes(torch.ones(3, 2), dim=2)
