"""prepare(): models, optimizers and DataLoaders on real 2-rank gloo worlds, checked against one process."""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
from support.component import module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from qaccel import Accelerator
from qaccel.train.shards import BatchShard

pytestmark = pytest.mark.timeout(180)


# ---- the equivalence contract: N ranks x batch b == 1 process x batch N*b ----


def _regression_data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1)


def _fit(accelerator, batch_size, epochs=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(_regression_data(), batch_size=batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def test_two_ranks_batch_8_equal_one_process_batch_16(acc):
    single = _fit(Accelerator(nprocs=1, compute_setup="cpu"), batch_size=16)
    ranks = acc.distribute(_fit, all_results=True)(acc, 8)
    for params in ranks:
        for got, want in zip(params, single):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not torch.equal(single[0], _fit(Accelerator(nprocs=1, compute_setup="cpu"), batch_size=8)[0]), (
        "batch 8 in one process must differ, or the comparison above proves nothing"
    )


# ---- data coverage, reshuffling, argument preservation ----


def _epochs_seen(a, epochs, **loader_kwargs):
    loader = a.prepare(DataLoader(TensorDataset(torch.arange(64)), **loader_kwargs))
    seen = []
    for _ in range(epochs):
        seen.append([int(i) for (ids,) in loader for i in ids])
    return seen, len(loader)


def test_shuffled_epochs_cover_every_sample_once_and_change(acc):
    out = acc.distribute(_epochs_seen, all_results=True)(acc, 3, batch_size=8, shuffle=True)
    (rank0, len0), (rank1, len1) = out
    assert len0 == len1 == 4
    for e in range(3):
        assert sorted(rank0[e] + rank1[e]) == list(range(64)), "every sample exactly once per epoch"
        assert not set(rank0[e]) & set(rank1[e])
    assert rank0[0] != rank0[1] != rank0[2], "a new permutation every epoch, without set_epoch"
    assert rank0[0] != list(range(32)), "shuffled"


def test_unshuffled_shards_are_interleaved_global_batches(acc):
    (r0, _), (r1, _) = acc.distribute(_epochs_seen, all_results=True)(acc, 1, batch_size=4)
    assert r0[0][:8] == [0, 1, 2, 3, 8, 9, 10, 11] and r1[0][:8] == [4, 5, 6, 7, 12, 13, 14, 15]


class _OtherBatchSampler(BatchSampler):
    """Not torch's own BatchSampler, so a BatchShard iterates it as it is."""


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_shards_are_the_batches_random_sampler_yields(drop_last):
    # BatchShard cuts a shuffled loader's batches from the permutation itself: they must be RandomSampler's own.
    gen = torch.Generator()
    own = BatchSampler(RandomSampler(range(103), generator=gen), 8, drop_last)
    other = _OtherBatchSampler(RandomSampler(range(103), generator=gen), 8, drop_last)
    gen.manual_seed(5)
    expected = list(own)
    gen.manual_seed(5)
    assert list(BatchShard(own, 0, 1, drop_last)) == expected
    for rank in range(3):
        shards = []
        for batch_sampler in (own, other):
            gen.manual_seed(5)
            shard = BatchShard(batch_sampler, rank, 3, drop_last)
            shards.append((list(shard), shard.padded))
        assert shards[0] == shards[1]


def _collate_tagged(samples):
    return {"ids": torch.stack([s[0] for s in samples]), "tag": "mine"}


def _mark_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.marked = True


def _loader_arguments(a):
    g = torch.Generator().manual_seed(3)
    user = DataLoader(
        TensorDataset(torch.arange(103)),
        batch_size=5,
        shuffle=True,
        drop_last=True,
        collate_fn=_collate_tagged,
        num_workers=1,
        pin_memory=False,
        worker_init_fn=_mark_worker,
        generator=g,
        persistent_workers=True,
        prefetch_factor=3,
        timeout=30,
    )
    loader = a.prepare(user)
    batches = list(loader)
    return {
        "type": type(loader.sampler).__name__,
        "attrs": [
            getattr(loader, k) == getattr(user, k)
            for k in (
                "batch_size",
                "drop_last",
                "collate_fn",
                "num_workers",
                "pin_memory",
                "worker_init_fn",
                "generator",
                "persistent_workers",
                "prefetch_factor",
                "timeout",
            )
        ],
        "sizes": {len(b["ids"]) for b in batches},
        "tags": {b["tag"] for b in batches},
        "len": (len(loader), len(batches)),
        "user_untouched": user.sampler.generator is g and len(user) == 20,
    }


def test_every_loader_argument_is_kept(acc):
    for out in acc.distribute(_loader_arguments, all_results=True)(acc):
        assert out["type"] == "RandomSampler"
        assert all(out["attrs"]), out["attrs"]
        assert out["sizes"] == {5} and out["tags"] == {"mine"}
        assert out["len"] == (10, 10)  # 103 // 5 = 20 full batches over 2 ranks
        assert out["user_untouched"]


def _weighted(a):
    weights = torch.ones(40)
    weights[:20] = 0.0  # only samples 20..39 may be drawn
    sampler = WeightedRandomSampler(weights, num_samples=40, replacement=True)
    loader = a.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=4, sampler=sampler))
    return type(loader.sampler).__name__, [int(i) for (ids,) in loader for i in ids]


def test_custom_sampler_type_kept_and_drawn_alike_on_every_rank(acc):
    (t0, ids0), (t1, ids1) = acc.distribute(_weighted, all_results=True)(acc)
    assert t0 == t1 == "WeightedRandomSampler"
    assert len(ids0) == len(ids1) == 20 and min(ids0 + ids1) >= 20


def _user_distributed_sampler(a):
    ds = TensorDataset(torch.arange(32))
    sampler = DistributedSampler(ds, num_replicas=a.world_size, rank=a.rank, shuffle=True, seed=7)
    loader = a.prepare(DataLoader(ds, batch_size=4, sampler=sampler))
    return [[int(i) for (ids,) in loader for i in ids] for _ in range(2)], len(loader)


def test_user_distributed_sampler_is_not_sharded_twice(acc):
    (e0, n0), (e1, n1) = acc.distribute(_user_distributed_sampler, all_results=True)(acc)
    assert n0 == n1 == 4
    for epoch in range(2):
        assert sorted(e0[epoch] + e1[epoch]) == list(range(32))
    assert e0[0] != e0[1], "its epoch advances without set_epoch"


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _iterable(a, n):
    loader = a.prepare(DataLoader(Stream(n), batch_size=2))
    return [int(i) for ids in loader for i in ids]


def test_iterable_dataset_is_sharded_by_batch(acc):
    r0, r1 = acc.distribute(_iterable, all_results=True)(acc, 20)
    assert sorted(r0 + r1) == list(range(20)) and r0[:2] == [0, 1] and r1[:2] == [2, 3]
    r0, r1 = acc.distribute(_iterable, all_results=True)(acc, 22)  # 11 batches: the 11th is dropped
    assert len(r0) == len(r1) == 10


def _eval_counts(a, size):
    loader = a.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=16))
    seen, own = [], []
    for (ids,) in loader:
        seen.append(a.gather_for_metrics(ids))
        own += ids[: len(ids) - a.padding_in_batch].tolist()
    return torch.cat(seen).tolist(), len(loader), own


@pytest.mark.parametrize("size", [82, 99, 512, 7])
def test_gather_for_metrics_counts_are_exact_and_padding_batches_are_marked(acc, size):
    (everything, steps, own0), (_, _, own1) = acc.distribute(_eval_counts, all_results=True)(acc, size)
    assert sorted(everything) == list(range(size))
    assert steps == math.ceil(math.ceil(size / 16) / 2)
    assert sorted(own0 + own1) == list(range(size)), "the batches not marked as padding hold every sample once"


# Accelerate's expected shards for split_batches=True (tests/test_data_loader.py): BatchSampler(range(N),
# batch_size=4, drop_last), 2 ranks; rank 0's batches, then rank 1's.
SPLIT_SHARDS = {
    (24, False): (
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [22, 23]],
    ),
    (24, True): (
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [22, 23]],
    ),
    (22, False): (
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [0, 1]],
    ),
    (22, True): ([[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]], [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]),
    (21, True): ([[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]], [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]),
    (21, False): (
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 0]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [1, 2]],
    ),
    (20, False): ([[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]], [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]),
    (2, False): ([[0, 1]], [[0, 1]]),
    (2, True): ([], []),
}


@pytest.mark.parametrize("size, drop_last", list(SPLIT_SHARDS))
def test_split_batches_shards_as_accelerate_does(size, drop_last):
    batches = BatchSampler(range(size), batch_size=4, drop_last=drop_last)
    shards = tuple(BatchShard(batches, rank, 2, drop_last, split=True) for rank in range(2))
    assert tuple(list(shard) for shard in shards) == SPLIT_SHARDS[size, drop_last]
    assert [len(shard) for shard in shards] == [len(SPLIT_SHARDS[size, drop_last][0])] * 2


# Accelerate's expected shards by default (tests/test_data_loader.py): BatchSampler(range(N), batch_size=3, drop_last),
# 2 ranks; an incomplete last round, or a short last batch, is filled up with the epoch's first samples.
_FIRST_3_ROUNDS = ([[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]])
PADDED_SHARDS = {
    (24, False): (
        [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]],
    ),
    (21, False): (_FIRST_3_ROUNDS[0] + [[18, 19, 20]], _FIRST_3_ROUNDS[1] + [[0, 1, 2]]),
    (22, False): (_FIRST_3_ROUNDS[0] + [[18, 19, 20]], _FIRST_3_ROUNDS[1] + [[21, 0, 1]]),
    (20, False): (_FIRST_3_ROUNDS[0] + [[18, 19, 0]], _FIRST_3_ROUNDS[1] + [[1, 2, 3]]),
    (21, True): _FIRST_3_ROUNDS,
    (22, True): _FIRST_3_ROUNDS,
    (20, True): _FIRST_3_ROUNDS,
    (2, False): ([[0, 1, 0]], [[1, 0, 1]]),
    (2, True): ([], []),
}


@pytest.mark.parametrize("size, drop_last", list(PADDED_SHARDS))
def test_padded_shards_are_accelerates_and_mark_the_padding(size, drop_last):
    batches = BatchSampler(range(size), batch_size=3, drop_last=drop_last)
    shards = [BatchShard(batches, rank, 2, drop_last) for rank in range(2)]
    got = [list(shard) for shard in shards]
    assert got == list(PADDED_SHARDS[size, drop_last])
    if shards[0].padded:  # the padded step's real samples come first, each once, and the marks count the rest
        step = len(got[0]) - 1
        last = got[0][step] + got[1][step]
        assert sorted(last[: shards[0].padded[step]]) == list(range(size - size % 6, size))
        assert sum(shard.padding.get(step, 0) for shard in shards) == 6 - shards[0].padded[step]


# Accelerate's expected shards for even_batches=False (tests/test_data_loader.py), 2 ranks: BatchSampler(range(N),
# batch_size=3, drop_last) by batch, and batch_size=4 with split_batches; rank 0's batches, then rank 1's.
_FULL_3 = ([[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]], [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]])
_THREE_ROUNDS = ([[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]])
UNEVEN_SHARDS = {
    (24, False): _FULL_3,
    (24, True): _FULL_3,
    (21, False): (_FULL_3[0], _THREE_ROUNDS[1]),
    (22, False): (_FULL_3[0], _THREE_ROUNDS[1] + [[21]]),
    (20, False): (_THREE_ROUNDS[0] + [[18, 19]], _THREE_ROUNDS[1]),
    (21, True): _THREE_ROUNDS,
    (22, True): _THREE_ROUNDS,
    (20, True): _THREE_ROUNDS,
    (2, False): ([[0, 1]], []),
    (2, True): ([], []),
}
_FIVE_SLICES = ([[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]], [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]])
UNEVEN_SPLIT_SHARDS = {
    (24, False): SPLIT_SHARDS[24, False],
    (24, True): SPLIT_SHARDS[24, True],
    (22, False): (_FIVE_SLICES[0] + [[20, 21]], _FIVE_SLICES[1]),
    (22, True): _FIVE_SLICES,
    (21, True): _FIVE_SLICES,
    (21, False): (_FIVE_SLICES[0] + [[20]], _FIVE_SLICES[1]),
    (2, False): ([[0, 1]], []),
    (2, True): ([], []),
}


@pytest.mark.parametrize("split", [False, True])
def test_uneven_batches_shard_as_accelerate_does_and_each_rank_knows_every_ranks_length(split):
    table = UNEVEN_SPLIT_SHARDS if split else UNEVEN_SHARDS
    for (size, drop_last), expected in table.items():
        batches = BatchSampler(range(size), batch_size=4 if split else 3, drop_last=drop_last)
        shards = [BatchShard(batches, rank, 2, drop_last, split=split, even=False) for rank in range(2)]
        assert [list(shard) for shard in shards] == list(expected), (size, drop_last)
        assert [len(shard) for shard in shards] == [len(e) for e in expected], (size, drop_last)
        assert [shards[0].steps(rank) for rank in range(2)] == [len(e) for e in expected], (size, drop_last)


def test_split_batches_needs_a_batch_size_that_divides_by_the_world():
    with pytest.raises(ValueError, match="batch_size .* divides by the world size 2; got batch_size=3"):
        BatchShard(BatchSampler(range(8), batch_size=3, drop_last=False), 0, 2, False, split=True)


def _object_counts(a, size):
    loader = a.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=16))
    names = [a.gather_for_metrics([f"sample {i}" for i in ids.tolist()]) for (ids,) in loader]
    objects = [a.gather_for_metrics(ids.tolist(), use_gather_object=True) for (ids,) in loader]
    return [name for step in names for name in step], [i for step in objects for i in step]


def test_gather_for_metrics_of_other_objects_goes_through_gather_object_with_exact_counts(acc):
    for names, ids in acc.distribute(_object_counts, all_results=True)(acc, 99):  # 7 batches: the last step padded
        assert sorted(ids) == list(range(99)) and sorted(names) == sorted(f"sample {i}" for i in range(99))


def _split_counts(a, size):
    loader = a.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=16))
    seen, own = [], []
    for (ids,) in loader:
        seen.append(a.gather_for_metrics(ids))
        own += ids[: len(ids) - a.padding_in_batch].tolist()
    return torch.cat(seen).tolist(), len(loader), own, loader.batch_size


@pytest.mark.parametrize("size", [82, 99, 7])
def test_split_batches_gathers_every_sample_once_and_marks_the_padding(size):
    split = Accelerator(nprocs=2, compute_setup="cpu", split_batches=True)
    (everything, steps, own0, batch_size), (_, _, own1, _) = split.distribute(_split_counts, all_results=True)(
        split, size
    )
    assert everything == list(range(size)), "each step's gathered rows are the loader's batch, in order"
    assert steps == math.ceil(size / 16) and batch_size == 16
    assert sorted(own0 + own1) == list(range(size))


def _labels(a):
    loader = a.prepare(
        DataLoader(TensorDataset(torch.randn(8, 3), torch.arange(8), torch.ones(8, dtype=torch.bool)), batch_size=4)
    )
    x, y, mask = a.prepare_batch(next(iter(loader)))
    return x.dtype, y.dtype, mask.dtype


def test_labels_keep_their_dtype_with_a_float64_accelerator():
    acc64 = Accelerator(nprocs=2, compute_setup="cpu", dtype=torch.float64)
    for dtypes in acc64.distribute(_labels, all_results=True)(acc64):
        assert dtypes == (torch.float64, torch.int64, torch.bool)


# ---- models and optimizers ----


def _model_facts(a):
    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    prepared, _, same_scheduler = a.prepare(model, optimizer, scheduler)
    again = a.prepare(prepared)
    return {
        "scheduler": same_scheduler is scheduler and optimizer.param_groups[0]["lr"] == 0.5,
        "ddp": isinstance(prepared, DistributedDataParallel),
        "twice": again is prepared,
        "unwrap": a.unwrap_model(prepared) is model,
        "frozen": type(a.prepare(frozen)).__name__,
        "passthrough": a.prepare(None, "x", 3) == (None, "x", 3),
    }


def test_model_wrapping_rules(acc):
    for facts in acc.distribute(_model_facts, all_results=True)(acc):
        assert facts == {
            "scheduler": True,
            "ddp": True,
            "twice": True,
            "unwrap": True,
            "frozen": "Linear",
            "passthrough": True,
        }


def test_single_process_model_is_not_wrapped():
    single = Accelerator(nprocs=1, compute_setup="cpu")
    model = torch.nn.Linear(2, 2)
    assert single.prepare(model) is model


class ComplexModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 1, dtype=torch.complex64))

    def forward(self, x):
        return (x.to(self.w.dtype) @ self.w).abs()


def _train_dtype(a, complex_model):
    torch.manual_seed(0)
    model = ComplexModel() if complex_model else torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # Adam state exists before prepare and must follow the dtype
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    model, optimizer, loader = a.prepare(model, optimizer, loader)
    for x, y in loader:
        x, y = a.prepare_batch((x, y))
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    param = next(a.unwrap_model(model).parameters())
    state = optimizer.state[param]["exp_avg"]
    return str(param.dtype), str(state.dtype), str(x.dtype), param.detach().clone()


@pytest.mark.parametrize("dtype, complex_model", [(torch.float64, False), (torch.complex128, True)])
def test_float64_and_complex128_models_train_on_two_ranks(dtype, complex_model):
    acc_dtype = Accelerator(nprocs=2, compute_setup="cpu", dtype=dtype)
    out = acc_dtype.distribute(_train_dtype, all_results=True)(acc_dtype, complex_model)
    real = "torch.float64"
    for param_dtype, state_dtype, x_dtype, _ in out:
        assert (param_dtype, state_dtype, x_dtype) == (str(dtype), str(dtype), real)
    torch.testing.assert_close(out[0][3], out[1][3], atol=0, rtol=0)  # DDP keeps ranks identical


class MixedModel(torch.nn.Module):
    """A complex parameter and buffer next to a real parameter and an integer buffer."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.z = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, generator=g))
        self.w = torch.nn.Parameter(torch.randn(3, generator=g))
        self.register_buffer("phase", torch.randn(3, dtype=torch.complex128, generator=g))
        self.register_buffer("count", torch.arange(3))

    def forward(self, x):
        return ((x.to(self.z.dtype) * self.z * self.phase).abs() * self.w).sum()


DISCARDS = "discards the imaginary part"


@contextlib.contextmanager
def _caught_warnings():
    """Every warning, torch's included: torch warns of a discarded imaginary part once per process otherwise."""
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.set_warn_always(was)


def _whole(tensor):
    """A sharded (fsdp) tensor in full; any other as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _wide(tensor):
    """Complex tensors as complex128, to compare them: torch compares no complex32."""
    return tensor.to(torch.complex128) if tensor.is_complex() else tensor


def _prepare_mixed(a):
    model = MixedModel()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    with _caught_warnings() as caught:
        model, optimizer = a.prepare(model, optimizer)
    after = {name: _whole(t) for name, t in model.state_dict().items()}
    return {
        "dtypes": {name: t.dtype for name, t in after.items()},
        "values_kept": all(
            torch.equal(_wide(after[name]), _wide(t.to(after[name].dtype))) for name, t in before.items()
        ),
        "imaginary": [bool(_wide(after[name]).imag.abs().sum() > 0) for name in ("z", "phase")],
        "same_parameters": all(p is q for p, q in zip(model.parameters(), params)),
        "optimizer_points_at_them": all(
            p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters())
        ),
        "discard_warnings": [str(w.message) for w in caught if DISCARDS in str(w.message)],
    }


@pytest.mark.parametrize(
    "dtype, real, complex_",
    [
        (torch.float64, torch.float64, torch.complex128),
        (torch.float32, torch.float32, torch.complex64),
        (torch.float16, torch.float16, torch.complex32),
        (torch.complex128, torch.float64, torch.complex128),
        (torch.complex64, torch.float32, torch.complex64),
    ],
)
def test_dtype_keeps_complex_tensors_complex_at_its_precision(dtype, real, complex_):
    with _caught_warnings() as caught:  # what Module.to does, and prepare() must not
        MixedModel().to(dtype=torch.float64)
    assert any(DISCARDS in str(w.message) for w in caught), "the check below would see the warning"
    a = Accelerator(nprocs=1, compute_setup="cpu", dtype=dtype)
    out = a.distribute(_prepare_mixed)(a)
    assert out["dtypes"] == {"z": complex_, "w": real, "phase": complex_, "count": torch.int64}
    assert out["values_kept"] and out["imaginary"] == [True, True]
    assert out["same_parameters"] and out["optimizer_points_at_them"], (
        "optimizers point at the Parameter objects: prepare() must keep them"
    )
    assert out["discard_warnings"] == []


@pytest.mark.parametrize(
    "dtype, real, complex_",
    [(torch.float64, torch.float64, torch.complex128), (torch.complex64, torch.float32, torch.complex64)],
)
def test_dtype_keeps_complex_tensors_complex_under_fsdp(dtype, real, complex_):
    a = Accelerator(nprocs=1, compute_setup="cpu", dtype=dtype, strategy="fsdp")
    out = a.distribute(_prepare_mixed)(a)
    assert out["dtypes"] == {"z": complex_, "w": real, "phase": complex_, "count": torch.int64}
    assert out["values_kept"] and out["imaginary"] == [True, True]
    assert out["optimizer_points_at_them"]  # at the sharded Parameters fully_shard put in place of the cast ones
    assert out["discard_warnings"] == []


def test_a_dtype_without_a_complex_match_is_refused_naming_the_tensor():
    bf16 = Accelerator(nprocs=1, compute_setup="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"MixedModel\.z \(torch\.complex64\).*use dtype=torch\.float32"):
        bf16.distribute(lambda a: a.prepare(MixedModel()))(bf16)


def _qcl_qnn(qd):
    """qadence's QCL tutorial model (docs/tutorials/qml/qcl.md), on 2 qubits with a depth-1 ansatz."""
    feature_map = qd.tag(qd.kron(qd.RX(i, qd.FeatureParameter("phi")) for i in range(2)), "feature_map")
    ansatz = qd.tag(qd.hea(2, depth=1), "ansatz")
    circuit = qd.QuantumCircuit(2, feature_map, ansatz)
    return qd.QNN(circuit, [qd.hamiltonian_factory(2, detuning=qd.Z)])


def _qcl_steps(model, optimizer, batches, prepare_batch=lambda batch: batch):
    losses = []
    for batch in batches:
        x, y = prepare_batch(batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(values=x).squeeze(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, x.dtype


def _qcl_prepared(a, model, batches):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.25)
    model, optimizer = a.prepare(model, optimizer)
    return _qcl_steps(model, optimizer, batches, a.prepare_batch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
def test_qadence_qcl_qnn_trains_with_dtype_as_by_hand(dtype):
    qd = module("qadence")
    torch.manual_seed(0)
    model = _qcl_qnn(qd)
    by_hand = copy.deepcopy(model)
    x = torch.rand(2, 8) * 2 * math.pi  # float32 data: prepare_batch casts it
    batches = [(x[i], torch.sin(x[i])) for i in range(2)]
    a = Accelerator(nprocs=1, compute_setup="cpu", dtype=dtype)
    losses, x_dtype = a.distribute(_qcl_prepared)(a, model, batches)
    # by hand, as qadence casts: the model to the complex dtype (QuantumModel.to keeps its parameters real), the
    # data to the real one (qadence's data_dtype)
    real = dtype.to_real() if dtype.is_complex else dtype
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Complex modules are a new feature", UserWarning)
        by_hand.to(dtype={torch.float64: torch.complex128, torch.float32: torch.complex64}[real])
    optimizer = torch.optim.Adam(by_hand.parameters(), lr=0.25)
    want, _ = _qcl_steps(by_hand, optimizer, [(x.to(real), y.to(real)) for x, y in batches])
    assert x_dtype == real
    assert all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(want, abs=1e-12, rel=0)
    assert {p.dtype for p in model.parameters()} == {real}
    assert {b.dtype for b in model.buffers()} == {real.to_complex()}


def test_prepare_in_the_caller_of_a_multi_rank_launch_is_refused():
    caller = Accelerator(nprocs=2, compute_setup="cpu")
    with pytest.raises(RuntimeError, match="prepare\\(\\) must run inside the function you distribute"):
        caller.prepare(torch.nn.Linear(1, 1))


def _meta_batches(items):
    return torch.stack([x for (x,) in items]).to("meta")


def test_device_placement_false_leaves_models_and_batches_where_they_are(single):
    """Meta tensors cannot be copied to the CPU: placing one raises, which shows what is placed and what is not."""
    with pytest.raises(NotImplementedError, match="meta tensor"):
        single.prepare(torch.nn.Linear(2, 2, device="meta"))
    loader = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2, collate_fn=_meta_batches)
    with pytest.raises(NotImplementedError, match="meta tensor"):
        next(iter(single.prepare(loader)))
    kept = Accelerator(compute_setup="cpu", device_placement=False)
    model, batches = kept.prepare(torch.nn.Linear(2, 2, device="meta"), loader)
    assert model.weight.is_meta and next(iter(batches)).is_meta
    model, batches = single.prepare(torch.nn.Linear(2, 2, device="meta"), loader, device_placement=[False, False])
    assert model.weight.is_meta and next(iter(batches)).is_meta
    with pytest.raises(ValueError, match=r"prepare\(device_placement=...\) must be a list of 2 bools"):
        single.prepare(torch.nn.Linear(2, 2), loader, device_placement=[False])
