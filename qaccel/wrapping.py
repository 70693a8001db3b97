"""What a prepared model is around the user's module: a DDP wrapper, or the module itself sharded in place by FSDP2.

Asked by preparing, checkpoints and trackers alike, so it sits below them all; torch's FSDP module is looked up, not
imported (it costs ~1 s, and nothing is sharded before it is imported)."""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) sharded ``model``: it holds only this rank's shards."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_wrapped(model: torch.nn.Module) -> bool:
    """Whether ``model`` was prepared for several ranks: wrapped in DDP or sharded."""
    return isinstance(model, DistributedDataParallel) or is_sharded(model)


def inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper, or the module itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model
