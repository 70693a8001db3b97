"""set_seed: Python, NumPy and torch draws reproduced, per-rank seeds, bad seeds rejected; on real 2-rank gloo
worlds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(120)


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
