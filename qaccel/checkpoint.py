"""Writing checkpoints: once per world, atomically, and loadable into the user's plain model."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import secrets
import shutil
from typing import Any

import numpy as np
import torch

from qaccel import collectives, prepare, sharding
from qaccel.group import RankContext
from qaccel.training import StepState

MODEL_FILE = "model.pt"
MARKER_FILE = "qaccel_state.json"  # written last: a checkpoint folder holding it is complete
SHARDED_DIR = "sharded"  # strategy="fsdp": models and optimizers, in torch.distributed.checkpoint's format
_NUMBERED = re.compile(r"checkpoint_(\d+)")


def save(obj: Any, path: str | os.PathLike, ctx: RankContext) -> None:
    """``torch.save`` on rank 0 only, atomically: a crash mid-save leaves any previous file intact.

    The object is written to a temporary file beside ``path``, flushed to disk, and renamed onto it. The
    temporary file is removed if writing fails. Other ranks return at once, without a barrier: ranks that
    read the file afterwards should call ``wait_for_everyone()`` first.
    """
    if ctx.rank == 0:
        _write(obj, path)


def _write(obj: Any, path: str | os.PathLike) -> None:
    """torch.save through a temporary file beside ``path``, fsynced and renamed onto it."""
    _write_with(lambda f: torch.save(obj, f), path)


def _write_bytes(data: bytes, path: str | os.PathLike) -> None:
    _write_with(lambda f: f.write(data), path)


def _write_with(write: Any, path: str | os.PathLike) -> None:
    path = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def get_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The state dict of the user's module inside DDP and torch.compile wrappers, in either order.

    Its keys carry no ``module.`` or ``_orig_mod.`` prefix, so it loads strictly into the plain model. A model
    sharded by FSDP2 is gathered: every rank must call this, and rank 0 gets the full dict ({} elsewhere).
    """
    if sharding.is_sharded(model):
        return sharding.full_state_dict(model)
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
    state = get_state_dict(model)  # on every rank: a sharded model is gathered (a collective)
    if ctx.rank != 0:
        return
    os.makedirs(directory, exist_ok=True)
    save(state, os.path.join(directory, MODEL_FILE), ctx)


def save_state(
    directory: str | os.PathLike, state: StepState, ctx: RankContext, keep: int | None = None, numbered: bool = False
) -> str:
    """Checkpoint everything a resumed run needs, atomically: models, optimizers, schedulers, the fp16 scaler,
    every rank's RNG states, loader positions, registered objects and the step count. Returns the path written.

    ``numbered``: ``directory`` holds numbered checkpoints; this one goes to ``checkpoint_<step>``, and only the
    ``keep`` newest complete ones stay (None: all). Every rank sends its RNG states to rank 0, which writes all parts into a
    temporary directory beside the target and swaps it in. A crash before the swap leaves the previous checkpoint
    untouched; a crash between the swap's two renames leaves it as ``<target>.old-*``, which load_state() falls
    back to.
    """
    directory = os.path.abspath(os.fspath(directory))
    target = os.path.join(directory, f"checkpoint_{state.updates:08d}") if numbered else directory
    tmp = collectives.broadcast(_new_tmp(target) if ctx.rank == 0 else None, 0, ctx)
    failure: BaseException | None = None
    try:
        if state.mesh is not None:  # sharded models: every rank writes its own shards (fails on every rank)
            sharding.save_sharded(os.path.join(tmp, SHARDED_DIR), state.models, _optimizers(state))
        rng_states = collectives.gather_object(_rng_state(), ctx)
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if ctx.rank == 0:
        try:
            _write_checkpoint(target, tmp, state, rng_states, ctx.world_size)
            if numbered and keep is not None:
                _prune(directory, keep)
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
            shutil.rmtree(tmp, ignore_errors=True)
            failure = exc
    # In place of a barrier: every rank learns whether rank 0's part failed, so none trains on as if it was saved.
    outcome = collectives.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}", 0, ctx)
    if failure is not None:
        raise failure
    if outcome is not None:
        raise RuntimeError(f"save_state() failed on rank 0 ({outcome}); the previous checkpoint stands")
    return target


def _new_tmp(target: str) -> str:
    """A new temporary folder beside ``target`` (what killed saves left there removed first)."""
    for stale in glob.glob(f"{glob.escape(target)}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = f"{target}.tmp-{secrets.token_hex(6)}"
    os.makedirs(tmp)
    return tmp


def _optimizers(state: StepState) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in state.optimizers]


def _write_checkpoint(directory: str, tmp: str, state: StepState, rng_states: list[dict[str, Any]], world_size: int) -> None:
    """Rank 0 writes everything but the shards (peers sent their RNG states) and swaps the folder in, so a failure
    here cannot pull a directory from under a peer that is still writing."""
    _write_parts(tmp, state)
    for rank, rng in enumerate(rng_states):
        _write(rng, os.path.join(tmp, f"random_states_{rank}.pt"))
    marker = {"format": 1, "step": state.updates, "world_size": world_size}
    if state.mesh is not None:
        marker["sharded"] = {"model": len(state.models), "optimizer": len(state.optimizers)}
    _write_bytes(json.dumps(marker).encode(), os.path.join(tmp, MARKER_FILE))
    old = f"{directory}.old-{secrets.token_hex(6)}" if os.path.exists(directory) else None
    if old:
        os.rename(directory, old)
    os.rename(tmp, directory)
    if old:
        shutil.rmtree(old)


def _prune(directory: str, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints of ``directory``, backups already replaced, and what
    killed saves left (rank 0, the only writer, has finished writing)."""
    complete = _numbered(directory)
    for _, path in complete[:-keep]:
        shutil.rmtree(path)
    kept = {path for _, path in complete[-keep:]}
    for pattern in ("checkpoint_*.old-*", "checkpoint_*.tmp-*"):
        for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
            if path not in kept:
                shutil.rmtree(path, ignore_errors=True)


def _numbered(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in ``directory``, oldest first. A save that died between its two
    renames counts through its ``.old-*`` backup, as long as no checkpoint of that step replaced it."""
    found: dict[int, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:  # "checkpoint_N" sorts before its "checkpoint_N.old-*"
        match = _NUMBERED.match(name)
        path = os.path.join(directory, name)
        if match is None or not os.path.isfile(os.path.join(path, MARKER_FILE)):
            continue
        step = int(match.group(1))
        if match.end() == len(name) or (name[match.end():].startswith(".old-") and step not in found):
            found[step] = path
    return sorted(found.items())


def newest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The checkpoint load_state(directory) reads: ``directory`` itself if it is one, else the newest complete
    ``checkpoint_<step>`` in it; None if there is none."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.isfile(os.path.join(directory, MARKER_FILE)) or os.path.isfile(os.path.join(directory, "model_0.pt")):
        return directory
    numbered = _numbered(directory)
    if numbered:
        return numbered[-1][1]
    backups = sorted(glob.glob(f"{glob.escape(directory)}.old-*"), key=os.path.getmtime)
    return backups[-1] if backups else None  # a save died between its two renames: the previous checkpoint


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, model: int = 0) -> str:
    """Write prepared model ``model`` of a save_state() checkpoint (sharded or not) to ``out`` as one plain state
    dict, loadable strictly into the user's model, atomically. ``checkpoint`` may be a folder of numbered ones (the
    newest is read). Runs in one process, without ranks. Returns the checkpoint read."""
    found = newest_checkpoint(checkpoint)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {os.path.abspath(os.fspath(checkpoint))}")
    sharded = os.path.join(found, SHARDED_DIR)
    if os.path.isdir(sharded):
        state = sharding.read_full_model(sharded, model)
    elif os.path.isfile(os.path.join(found, f"model_{model}.pt")):
        state = torch.load(os.path.join(found, f"model_{model}.pt"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{found} holds no model {model}")
    _write(state, out)
    return found


def _write_parts(tmp: str, state: StepState) -> None:
    sharded = state.mesh is not None  # then models and optimizers are in SHARDED_DIR
    parts = {
        "model": [] if sharded else [get_state_dict(m) for m in state.models],
        "optimizer": [] if sharded else [o.state_dict() for o in state.optimizers],
        "scheduler": [s.state_dict() for s in state.schedulers],
        "loader": [loader.state_dict() for loader in state.loaders],
        "registered": [obj.state_dict() for obj in state.registered],
    }
    for kind, items in parts.items():
        for i, item in enumerate(items):
            _write(item, os.path.join(tmp, f"{kind}_{i}.pt"))
    if state.scaler is not None:
        _write(state.scaler.state_dict(), os.path.join(tmp, "scaler.pt"))


def load_state(
    directory: str | os.PathLike, state: StepState, ctx: RankContext, missing_ok: bool = False
) -> str | None:
    """Restore what save_state() wrote into the objects prepared (and registered) in this run, in order.

    ``directory`` is a checkpoint or a folder of numbered ones (the newest complete one is read). Returns the path
    read; with ``missing_ok``, None when there is no checkpoint yet (a first start).
    """
    found = newest_checkpoint(directory)
    if found is None:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no checkpoint at {os.path.abspath(os.fspath(directory))}")
    directory = found
    marker = _marker(directory)
    sharded = os.path.isdir(os.path.join(directory, SHARDED_DIR))
    kinds = [("scheduler", state.schedulers), ("loader", state.loaders), ("registered", state.registered)]
    if sharded:
        for kind, objects in (("model", state.models), ("optimizer", state.optimizers)):
            _check_count(directory, kind, marker["sharded"][kind], len(objects))
        sharding.load_sharded(os.path.join(directory, SHARDED_DIR), state.models, _optimizers(state))
    else:
        kinds = [("model", [prepare.unwrap_model(m) for m in state.models]), ("optimizer", state.optimizers)] + kinds
    full: dict[str, list] = {}  # a DDP checkpoint's full states, for sharded models
    for kind, objects in kinds:
        _check_count(directory, kind, len(glob.glob(os.path.join(glob.escape(directory), f"{kind}_*.pt"))), len(objects))
        for i, obj in enumerate(objects):
            saved = _read(os.path.join(directory, f"{kind}_{i}.pt"), ctx, weights_only=kind != "registered")
            if state.mesh is not None and kind in ("model", "optimizer"):
                full.setdefault(kind, []).append(saved)
            else:
                obj.load_state_dict(saved)
    if full:
        sharding.load_full(state.models, _optimizers(state), full.get("model", []), full.get("optimizer", []))
    if state.scaler is not None:
        state.scaler.load_state_dict(_read(os.path.join(directory, "scaler.pt"), ctx))
    rng_file = os.path.join(directory, f"random_states_{ctx.rank}.pt")
    if not os.path.exists(rng_file):
        raise ValueError(f"{directory} has no RNG states for rank {ctx.rank}: it was saved by a smaller world")
    _set_rng_state(_read(rng_file, ctx))
    if "step" in marker:
        state.updates = int(marker["step"])
    return directory


def _marker(directory: str) -> dict[str, Any]:
    """The checkpoint's marker ({} for a checkpoint older than markers)."""
    try:
        with open(os.path.join(directory, MARKER_FILE), "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _check_count(directory: str, kind: str, saved: int, prepared: int) -> None:
    if saved != prepared:
        raise ValueError(
            f"{directory} holds {saved} {kind} state(s) but this run prepared/registered {prepared}; "
            "prepare the same objects, in the same order, before load_state()"
        )


def _read(path: str, ctx: RankContext, weights_only: bool = True) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=weights_only)


def _rng_state() -> dict[str, Any]:
    """This process's random states in types torch.load(weights_only=True) accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def _set_rng_state(saved: dict[str, Any]) -> None:
    random.setstate(saved["python"])
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch"].cpu())
    if saved["cuda"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in saved["cuda"]])
