"""What a prepared model is around the user's module. A real DDP wrapper and FSDP2 sharding are made on real ranks
in tests/train/test_prepare.py and tests/train/test_fsdp.py; here, what holds of any module."""

import torch

from qaccel.wrapping import inner_module, is_sharded, is_wrapped


def test_a_plain_module_is_its_own_inner_module_and_neither_wrapped_nor_sharded():
    model = torch.nn.Linear(2, 1)
    assert inner_module(model) is model
    assert not is_wrapped(model) and not is_sharded(model)


def test_a_module_that_holds_another_as_module_is_not_taken_for_ddp():
    """Only DDP's ``module`` is looked through: a user's module with a ``module`` attribute stays itself."""
    outer = torch.nn.Module()
    outer.module = torch.nn.Linear(2, 1)
    assert inner_module(outer) is outer and not is_wrapped(outer)
