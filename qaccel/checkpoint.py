"""Writing checkpoints: once per world, atomically, and loadable into the user's plain model."""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

from qaccel import prepare
from qaccel.group import RankContext

MODEL_FILE = "model.pt"


def save(obj: Any, path: str | os.PathLike, ctx: RankContext) -> None:
    """``torch.save`` on rank 0 only, atomically: a crash mid-save leaves any previous file intact.

    The object is written to a temporary file beside ``path``, flushed to disk, and renamed onto it. The
    temporary file is removed if writing fails. Other ranks return at once, without a barrier: ranks that
    read the file afterwards should call ``wait_for_everyone()`` first.
    """
    if ctx.rank != 0:
        return
    path = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def get_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The state dict of the user's module inside DDP and torch.compile wrappers, in either order.

    Its keys carry no ``module.`` or ``_orig_mod.`` prefix, so it loads strictly into the plain model.
    """
    while True:
        inner = prepare.unwrap_model(model)
        inner = getattr(inner, "_orig_mod", inner)
        if inner is model:
            return model.state_dict()
        model = inner


def save_model(model: torch.nn.Module, directory: str | os.PathLike, ctx: RankContext) -> None:
    """Write ``get_state_dict(model)`` to ``directory/model.pt`` from rank 0, creating the directory.

    The file holds tensors only, so ``torch.load(path, weights_only=True)`` reads it.
    """
    if ctx.rank != 0:
        return
    os.makedirs(directory, exist_ok=True)
    save(get_state_dict(model), os.path.join(directory, MODEL_FILE), ctx)
