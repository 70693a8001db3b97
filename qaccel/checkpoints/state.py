"""Checkpoints: written once per world, atomically, with every file's size and checksum in the marker written last;
read back only when intact and only into objects they fit, so a load happens whole or not at all."""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import glob
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from qaccel import storage, unpickling
from qaccel.checkpoints import background, folders, random_states
from qaccel.comm import agreement, collectives
from qaccel.comm.session import RankContext
from qaccel.errors import CheckpointError
from qaccel.train import prepare, sharding
from qaccel.train.registry import Registry
from qaccel.wrapping import is_sharded

T = TypeVar("T")


def save(obj: Any, path: str | os.PathLike[str], ctx: RankContext) -> None:
    """``torch.save`` on rank 0 only, atomically: a crash mid-save leaves any previous file intact.

    The object is written to a temporary file beside ``path``, flushed to disk, and renamed onto it. The
    temporary file is removed if writing fails. Other ranks return at once, without a barrier: ranks that
    read the file afterwards should call ``wait_for_everyone()`` first.
    """
    if ctx.rank == 0:
        storage.save(obj, path)


def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP and torch.compile wrappers, in either order."""
    while True:
        inner = prepare.unwrap_model(model)
        inner = getattr(inner, "_orig_mod", inner)
        if inner is model:
            return model
        model = inner


def get_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The state dict of the user's module inside DDP and torch.compile wrappers, in either order.

    Its keys carry no ``module.`` or ``_orig_mod.`` prefix, so it loads strictly into the plain model. A model
    sharded by FSDP2 is gathered: every rank must call this, and rank 0 gets the full dict ({} elsewhere).
    """
    if is_sharded(model):
        return sharding.full_state_dict(model)
    return _plain_module(model).state_dict()


def save_model(model: torch.nn.Module, directory: str | os.PathLike[str], ctx: RankContext) -> None:
    """Write ``get_state_dict(model)`` to ``directory/model.pt`` from rank 0, creating the directory.

    The file holds tensors only, so ``torch.load(path, weights_only=True)`` reads it.
    """
    state = get_state_dict(model)  # on every rank: a sharded model is gathered (a collective)
    if ctx.rank != 0:
        return
    os.makedirs(directory, exist_ok=True)
    save(state, os.path.join(directory, folders.MODEL_FILE), ctx)


# ---- saving ----


@dataclass
class _Saving:
    """One save_state(): where it goes, and what it writes, taken at the call (a background save's copied aside)."""

    directory: str
    target: str
    tmp: str
    numbered: bool
    keep: int | None
    parts: dict[str, list[Any]]  # rank 0: what it writes as .pt files (models and optimizers unless sharded)
    rngs: list[Any]  # rank 0: every rank's random states
    marker: dict[str, Any]  # rank 0: the marker's entries but the files
    sharded: dict[str, Any] | None  # every rank: its shards of the models and optimizers (strategy="fsdp")
    staging: background.Staging | None = None  # a background save's: its copies are waited for before writing
    hand_on_pages: bool = False  # a later background save: _hand_on_pages() in the writing thread


def save_state(
    directory: str | os.PathLike[str],
    registry: Registry,
    ctx: RankContext,
    keep: int | None = None,
    numbered: bool = False,
    in_background: bool = False,
) -> str:
    """Checkpoint everything a resumed run needs, atomically: models, optimizers, schedulers, the fp16 scaler,
    every rank's RNG states, loader positions, registered objects and the step count. Returns the path written.

    ``numbered``: ``directory`` holds numbered checkpoints; this one goes to ``checkpoint_<step>``, and only the
    ``keep`` newest complete ones stay (None: all). Every rank sends its RNG states to rank 0, which writes all
    parts into a temporary directory beside the target and swaps it in. A crash before the swap leaves the previous
    checkpoint untouched; a crash between the swap's two renames leaves it as ``<target>.old-*``, which load_state()
    falls back to. A failure is raised on every rank; a full disk as an OSError saying how much room there was.

    ``in_background``: return once the state is copied aside; a thread writes the files (see background.py). A
    save still in flight ends first, whatever ``in_background`` is.
    """
    directory = os.path.abspath(os.fspath(directory))
    target = os.path.join(directory, f"checkpoint_{registry.updates:08d}") if numbered else directory
    background.wait(registry)
    later = (
        in_background and background.staging_of(registry) is not None
    )  # its copy takes no new memory: pages go in the thread
    if not later:
        _hand_on_pages(directory, target, numbered, ctx.rank)
    tmp = _from_rank_0(
        functools.partial(folders.new_tmp, target), ctx, _failed(ctx, "save_state()", "making its folder")
    )
    try:
        saving = _collect(directory, target, tmp, numbered, keep, registry, ctx, in_background)
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    saving.hand_on_pages = later
    if in_background:
        background.start(registry, ctx, target, functools.partial(_write, saving, ctx))
    else:
        _write(saving, ctx, background.Peers(ctx))
    return target


def _hand_on_pages(directory: str, target: str, numbered: bool, rank: int) -> None:
    """Drop the checkpoint this save follows (the newest of ``directory``, or the one at ``target`` it replaces) from
    the page cache just before this save takes memory for its copy and files (a later background save, whose copy
    goes into memory it had, does it in its thread before writing), so that the pages freed are reused at
    once: rank 0 drops every file, each other rank its own shards (only its host holds their pages), so that a save
    opens each file about once, not once per rank. On a VM that hands free memory back to its host (virtio-balloon's
    free page reporting), memory taken anew costs a fault in the host per page, and writing a checkpoint beside a
    cached one is what made the blocking save slower than torch.save overwriting its own file
    (benchmarks/repeated_save.py)."""
    if numbered:
        complete = folders.numbered_in(directory)
        previous = complete[-1][1] if complete else None
    else:
        previous = target if os.path.isdir(target) else None
    if previous is None:
        return
    if rank == 0:
        storage.release(previous)
    else:
        for shard in glob.glob(os.path.join(glob.escape(previous), folders.SHARDED_DIR, f"__{rank}_*")):
            storage.release(shard)


def _collect(
    directory: str,
    target: str,
    tmp: str,
    numbered: bool,
    keep: int | None,
    registry: Registry,
    ctx: RankContext,
    copy: bool,
) -> _Saving:
    """What this save writes, read from the objects now (``copy``: copied aside, for a background save). A failure
    is raised on every rank: the ranks learn of it with the RNG states they send rank 0."""
    failure: Exception | None = None
    parts: dict[str, list[Any]] = {}
    marker: dict[str, Any] = {}
    sharded, rng = None, None
    try:
        rng = random_states.rng_state()
        if registry.mesh is not None:
            sharded = sharding.state_dicts(registry.models, _optimizers(registry))
        if ctx.rank == 0:
            parts, marker = _parts(registry), _new_marker(registry, ctx.world_size)
        if copy:
            parts, sharded = background.stage(registry, (parts, sharded), ctx.device)
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on every rank
        failure = exc
    gathered = collectives.gather_object((rng, agreement.told(failure, ctx.rank)), ctx)
    agreement.raise_first(
        [told for _, told in gathered], failure, ctx.rank, _failed(ctx, "save_state()", "collecting the state")
    )
    return _Saving(
        directory,
        target,
        tmp,
        numbered,
        keep,
        parts,
        [rng for rng, _ in gathered] if ctx.rank == 0 else [],
        marker,
        sharded,
        background.staging_of(registry) if copy else None,
    )


def _from_rank_0(make: Callable[[], T], ctx: RankContext, note: str) -> T:
    """``make()`` on rank 0, its result on every rank. A failure is raised on every rank with ``note``
    (agreement.py), none left in the broadcast."""
    made: Any = None
    failure: Exception | None = None
    if ctx.rank == 0:
        try:
            made = make()
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on every rank
            failure = exc
    made, told = collectives.broadcast((made, agreement.told(failure, 0)), 0, ctx)
    agreement.raise_first([told], failure, ctx.rank, note)
    return made


def _failed(ctx: RankContext, call: str, doing: str, after: str = "; the previous checkpoint stands") -> str:
    """The note every rank's error gets, ``{rank}`` to fill (agreement.raise_first)."""
    if ctx.world_size == 1:
        return f"[qaccel] {call} failed while {doing}{after}"
    return f"[qaccel] {call} failed on rank {{rank}} while {doing}, and every rank raised it{after}"


def _write(saving: _Saving, ctx: RankContext, peers: background.Peers) -> None:
    """Write what ``saving`` holds and swap it in, on every rank, the ranks talking through ``peers``: each its
    shards, rank 0 the rest and the marker last. A failure anywhere is raised on every rank (agreement.py)."""
    tmp, target = saving.tmp, saving.target
    failure: BaseException | None = None
    shard_sums: dict[str, dict[str, int]] = {}
    try:
        if saving.staging is not None:
            saving.staging.wait()
        if saving.hand_on_pages:
            _hand_on_pages(saving.directory, target, saving.numbered, ctx.rank)
        if saving.sharded is not None:  # sharded models: every rank writes its own shards
            sharded = os.path.join(tmp, folders.SHARDED_DIR)
            sharding.save_sharded(sharded, saving.sharded, peers.group)
            shard_sums = _own_shard_sums(sharded, ctx.rank)
    except (KeyboardInterrupt, SystemExit):
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException as exc:  # noqa: BLE001 - torch.distributed.checkpoint's CheckpointException is one
        failure = _named(exc, saving, ctx.rank)
    gathered = peers.gather((shard_sums, agreement.told(failure, ctx.rank)))
    if any(told is not None for _, told in gathered):
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        agreement.raise_first(
            [told for _, told in gathered], failure, ctx.rank, _failed(ctx, "save_state()", "writing the shards")
        )
    doing, after = "writing the checkpoint", "; the previous checkpoint stands"
    if ctx.rank == 0:
        try:
            _write_checkpoint(saving, [sums for sums, _ in gathered])
            if saving.numbered and saving.keep is not None:
                doing, after = "removing older checkpoints", f"; the new checkpoint {target} is complete"
                folders.prune(saving.directory, saving.keep)
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on every rank
            failure = _named(exc, saving, ctx.rank)
            shutil.rmtree(tmp, ignore_errors=True)
    # In place of a barrier: every rank learns whether rank 0's part failed, so none trains on as if it was saved.
    doing, after, told = peers.broadcast((doing, after, agreement.told(failure, 0)))
    agreement.raise_first([told], failure, ctx.rank, _failed(ctx, "save_state()", doing, after))


def _named(exc: BaseException, saving: _Saving, rank: int) -> BaseException:
    """``exc``, or the OSError naming the full disk or quota behind it (rank 0 says what was written)."""
    full = storage.full_disk_error(exc)
    if full is None:
        return exc
    failed = _saving_failed(full, saving.target, storage.tree_size(saving.tmp) if rank == 0 else None)
    failed.__cause__ = exc
    return failed


def _saving_failed(full: OSError, target: str, written: int | None) -> OSError:
    """The OSError a full disk or quota (``full``) raises from save_state(): which file, how much room, what was
    written."""
    what = "the disk is full" if full.errno == errno.ENOSPC else "the disk quota is exceeded"
    file = full.filename or target
    partial = "" if written is None else f" (the partial checkpoint, {storage.mib(written)} written, is removed)"
    return OSError(
        full.errno,
        f"save_state() could not write {target}: {what} while writing {file}{partial}; "
        f"{storage.space(target)} now; the previous checkpoint stands",
    )


def _optimizers(registry: Registry) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in registry.optimizers]


def _own_shard_sums(sharded: str, rank: int) -> dict[str, dict[str, int]]:
    """Sizes and checksums of the shard files this rank wrote (torch.distributed.checkpoint names them
    ``__<rank>_*``), taken while they are in the page cache; rank 0 sums whatever no rank claimed."""
    return {
        f"{folders.SHARDED_DIR}/{name}": storage.sums(os.path.join(sharded, name)).to_json()
        for name in sorted(os.listdir(sharded))
        if name.startswith(f"__{rank}_")
    }


def _write_checkpoint(saving: _Saving, gathered: list[dict[str, dict[str, int]]]) -> None:
    """Rank 0 writes everything but the shards (the peers sent their RNG states at the call and their shards' sums
    now), the marker last with every file's size and checksum, and swaps the folder in, so a failure here cannot
    pull a directory from under a peer that is still writing."""
    tmp = saving.tmp
    files = {}
    for kind, items in saving.parts.items():
        for i, item in enumerate(items):
            name = "scaler.pt" if kind == "scaler" else f"{kind}_{i}.pt"
            files[name] = storage.save(item, os.path.join(tmp, name)).to_json()
    for rank, (rng, shard_sums) in enumerate(zip(saving.rngs, gathered)):
        files[f"random_states_{rank}.pt"] = storage.save(rng, os.path.join(tmp, f"random_states_{rank}.pt")).to_json()
        files.update(shard_sums)
    for base, _, names in os.walk(os.path.join(tmp, folders.SHARDED_DIR)):
        for name in names:
            relative = os.path.relpath(os.path.join(base, name), tmp).replace(os.sep, "/")
            if relative not in files:
                files[relative] = storage.sums(os.path.join(base, name)).to_json()
    marker = {**saving.marker, "files": dict(sorted(files.items()))}
    storage.write_bytes(json.dumps(marker, indent=1).encode(), os.path.join(tmp, folders.MARKER_FILE))
    directory = saving.target
    old = f"{directory}.old-{secrets.token_hex(6)}" if os.path.exists(directory) else None
    if old:
        os.rename(directory, old)
    os.rename(tmp, directory)
    if old:
        shutil.rmtree(old)


def _new_marker(registry: Registry, world_size: int) -> dict[str, Any]:
    """The marker's entries but the files, as the registry says now."""
    marker: dict[str, Any] = {
        "format": folders.FORMAT,
        "step": registry.updates,
        "world_size": world_size,
        "accumulation_steps": registry.accumulation_steps,
    }
    if registry.mesh is not None:
        marker["sharded"] = {"model": len(registry.models), "optimizer": len(registry.optimizers)}
    trackers = registry.trackers.state()  # rank 0's runs (log_with), continued by load_state()
    if trackers is not None:
        marker["trackers"] = trackers
    return marker


def _parts(registry: Registry) -> dict[str, list[Any]]:
    """Rank 0's state dicts, by kind (the models and optimizers are in the shards when they are sharded)."""
    sharded = registry.mesh is not None
    parts = {
        "model": [] if sharded else [get_state_dict(m) for m in registry.models],
        "optimizer": [] if sharded else [o.state_dict() for o in registry.optimizers],
        "scheduler": [s.state_dict() for s in registry.schedulers],
        "loader": [loader.state_dict() for loader in registry.loaders],
        "registered": [obj.state_dict() for obj in registry.registered],
    }
    if registry.scaler is not None:
        parts["scaler"] = [registry.scaler.state_dict()]
    return parts


# ---- finding checkpoints ----


# ---- loading ----


@dataclass
class _Read:
    """What one rank read of a checkpoint before touching any object: the parts, by kind, in saved order."""

    marker: dict[str, Any]
    sharded: bool
    parts: dict[str, list[Any]] = field(default_factory=dict)
    rng: Any = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a sharded checkpoint's tensors


def load_state(
    directory: str | os.PathLike[str],
    registry: Registry,
    ctx: RankContext,
    missing_ok: bool = False,
    fall_back: bool = False,
    allow_pickle: bool | None = None,
) -> str | None:
    """Restore what save_state() wrote into the objects prepared (and registered) in this run, in order.

    ``directory`` is a checkpoint or a folder of numbered ones (the newest complete one is read). Returns the path
    read; with ``missing_ok``, None when there is no checkpoint yet (a first start). Every file is checked against
    the sizes and checksums in the marker, and every part is read and checked against the prepared objects, before
    any object changes; a damaged checkpoint raises CheckpointError on every rank, or with ``fall_back`` (resume,
    which no one may be watching) the next older intact one is read, with a warning naming what was skipped.

    Only the files the marker lists are read, and only the parts this run prepared and registered; with
    ``torch.load(weights_only=True)``, but for what needs full unpickling (a registered object's own types, a
    sharded checkpoint's metadata), read as ``allow_pickle`` says (unpickling.py): by default only from a folder
    no one else can write.
    """
    directory = os.path.abspath(os.fspath(directory))
    background.wait(registry)  # a background save in flight may be writing the checkpoint asked for
    candidates = _from_rank_0(
        functools.partial(folders.candidates_in, directory),
        ctx,
        _failed(ctx, "load_state()", f"looking for a checkpoint in {directory}", ""),
    )
    if not candidates:
        if missing_ok:
            return None
        raise folders.not_a_checkpoint(directory)
    skipped: list[CheckpointError] = []
    for found in candidates:
        try:
            read = _read_checked(found, registry, ctx, allow_pickle)
        except CheckpointError as failed:
            if not (fall_back and failed.damaged):
                raise
            skipped.append(failed)
            continue
        if skipped and ctx.rank == 0:
            warnings.warn(
                f"resume() skipped {len(skipped)} damaged checkpoint(s) and loaded {found}: "
                + "; ".join(str(s) for s in skipped),
                stacklevel=3,
            )
        _apply_everywhere(found, read, registry, ctx)
        return found
    raise CheckpointError(
        f"every checkpoint in {directory} is damaged, so none was loaded (move them away to "
        "start afresh): " + "; ".join(str(s) for s in skipped),
        directory,
        skipped[0].file,
        damaged=True,
    )


def _read_checked(found: str, registry: Registry, ctx: RankContext, allow_pickle: bool | None) -> _Read:
    """Check the files (each rank a share), read the parts and check that they fit the prepared objects, all before
    any object changes. The ranks agree on the outcome in one collective, so all raise the same error: a
    CheckpointError, damaged, naming the first damaged file (a file that differs from what was written before one
    torch could not read); else the first rank's other failure (agreement.py); else a CheckpointError naming the
    first thing that does not fit or may not be unpickled."""
    problems: list[tuple[int, str, str]] = []  # (0: not what was written, 1: unreadable; file; why)
    misfit: tuple[str, str | None] | None = None
    read: _Read | None = None
    failure: Exception | None = None
    try:
        read = _read_share(found, registry, ctx, allow_pickle, problems)
    except CheckpointError as exc:
        misfit = (str(exc), exc.file)
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on every rank
        failure = exc
    outcomes = collectives.gather_object((problems, misfit, agreement.told(failure, ctx.rank)), ctx)
    damaged: dict[str, str] = {}
    for _, file, why in sorted(p for rank_problems, _, _ in outcomes for p in rank_problems):
        damaged.setdefault(file, why)
    if damaged:
        (file, why), others = next(iter(damaged.items())), list(damaged)[1:]
        more = f" (and {len(others)} more: {', '.join(others[:3])})" if others else ""
        raise CheckpointError(
            f"checkpoint {found} is damaged: {file} {why}{more}", found, os.path.join(found, file), damaged=True
        )
    agreement.raise_first(
        [told for _, _, told in outcomes],
        failure,
        ctx.rank,
        _failed(ctx, "load_state()", f"reading {found}", "; nothing was loaded"),
    )
    misfits = [m for _, m, _ in outcomes if m is not None]
    if misfits:
        raise CheckpointError(misfits[0][0], found, misfits[0][1])
    assert read is not None
    return read


def _read_share(
    found: str, registry: Registry, ctx: RankContext, allow_pickle: bool | None, problems: list[tuple[int, str, str]]
) -> _Read | None:
    """This rank's part of _read_checked: its share of the files checked, the parts read and checked; damage goes to
    ``problems``, what does not fit is raised as a CheckpointError."""
    misfit: tuple[str, str | None] | None = None
    read = None
    try:
        marker = folders.read_marker(found)
    except folders.Unreadable as exc:
        problems.append((1, exc.file, exc.why))
    else:
        files = sorted(marker["files"].items())
        share = files[ctx.rank :: ctx.world_size] if ctx.world_size > 1 else files
        try:
            _check_counts(found, marker, registry)  # before any file is read: only what this run has is
        except CheckpointError as exc:
            misfit = (str(exc), exc.file)
        # The share is checked in a second thread while the parts are read (numpy's sum and torch's reads release
        # the GIL), so checking costs little more than reading (benchmarks/checkpoint_integrity.py).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qaccel-check") as pool:
            checking = pool.submit(
                lambda: [
                    (0, name, why)
                    for name, recorded in share
                    if (why := storage.damage(os.path.join(found, name), recorded))
                ]
            )
            if misfit is None:
                try:
                    read = _read_parts(found, marker, registry, ctx, allow_pickle)
                except folders.Unreadable as exc:
                    problems.append((1, exc.file, exc.why))
                except unpickling.Untrusted as exc:
                    misfit = (f"checkpoint {found} was not loaded: {exc}", exc.path)
            problems += checking.result()
        if not problems and misfit is None and read is not None:  # read: set without a problem or misfit
            _check_fit(found, read, registry, ctx)
    if misfit is not None:
        raise CheckpointError(misfit[0], found, misfit[1])
    return read


def _read_parts(
    found: str, marker: dict[str, Any], registry: Registry, ctx: RankContext, allow_pickle: bool | None
) -> _Read:
    """The parts the marker lists, read as plain data; a registered object's state that needs more, and a sharded
    checkpoint's metadata (torch.distributed.checkpoint pickles it), as ``allow_pickle`` says (unpickling.py)."""
    read = _Read(marker, folders.marks_sharded(marker))
    kinds = (
        ["scheduler", "loader", "registered"]
        if read.sharded
        else ["model", "optimizer", "scheduler", "loader", "registered"]
    )
    for kind in kinds:
        read.parts[kind] = [
            _read(found, f"{kind}_{i}.pt", ctx, registered=kind == "registered", allow_pickle=allow_pickle)
            for i in range(folders.listed_count(marker, kind))
        ]
    if registry.scaler is not None:
        read.parts["scaler"] = [_read(found, "scaler.pt", ctx)]
    if f"random_states_{ctx.rank}.pt" in marker["files"]:
        read.rng = _read(found, f"random_states_{ctx.rank}.pt", ctx)
    if read.sharded:
        unpickling.check(
            os.path.join(found, folders.SHARDED_DIR), "torch.distributed.checkpoint pickles its metadata", allow_pickle
        )
        try:
            read.shapes = sharding.saved_shapes(os.path.join(found, folders.SHARDED_DIR))
        except Exception as exc:
            raise folders.Unreadable(
                f"{folders.SHARDED_DIR}/.metadata", f"cannot be read ({type(exc).__name__}: {exc})"
            ) from exc
    return read


def _read(found: str, name: str, ctx: RankContext, registered: bool = False, allow_pickle: bool | None = None) -> Any:
    """A part of the checkpoint: plain data (what qaccel writes: a file that needs more is damaged), or, for a
    registered object's state, as ``allow_pickle`` says (unpickling.py)."""
    path = os.path.join(found, name)
    try:
        if registered:
            return unpickling.load(path, allow_pickle, map_location=ctx.device)
        return torch.load(path, map_location=ctx.device, weights_only=True)
    except unpickling.Untrusted:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0].split(". ")[0] if str(exc) else ""
        raise folders.Unreadable(name, f"cannot be read ({type(exc).__name__}: {first})") from exc


def _check_counts(found: str, marker: dict[str, Any], registry: Registry) -> None:
    """Raise CheckpointError, before any file is read, when the checkpoint holds other numbers of objects than this
    run prepared and registered."""
    counts = {"scheduler": registry.schedulers, "loader": registry.loaders, "registered": registry.registered}
    if folders.marks_sharded(marker):
        for kind, objects in (("model", registry.models), ("optimizer", registry.optimizers)):
            _check_count(found, kind, marker.get("sharded", {}).get(kind, 0), len(objects))
    else:
        counts = {"model": registry.models, "optimizer": registry.optimizers, **counts}
    for kind, objects in counts.items():
        _check_count(found, kind, folders.listed_count(marker, kind), len(objects))


def _check_fit(found: str, read: _Read, registry: Registry, ctx: RankContext) -> None:
    """Raise CheckpointError, before anything is loaded, when the checkpoint was not written for these objects."""
    for i, model in enumerate(registry.models):
        if read.sharded:
            prefix = f"model_{i}."
            saved = {k[len(prefix) :]: shape for k, shape in read.shapes.items() if k.startswith(prefix)}
        else:
            saved = {k: tuple(v.shape) for k, v in read.parts["model"][i].items() if torch.is_tensor(v)}
        mismatch = _first_mismatch(saved, _target(model))
        if mismatch:
            file = folders.SHARDED_DIR if read.sharded else f"model_{i}.pt"
            raise CheckpointError(
                f"checkpoint {found} was not written for this run's model {i} (prepared model "
                f"number {i}): {mismatch}; nothing was loaded",
                found,
                os.path.join(found, file),
            )
    if not read.sharded:
        for j, (saved_opt, optimizer) in enumerate(zip(read.parts["optimizer"], registry.optimizers)):
            saved_sizes = [len(g["params"]) for g in saved_opt.get("param_groups", [])]
            sizes = [len(g["params"]) for g in optimizer.param_groups]
            if saved_sizes != sizes:
                raise CheckpointError(
                    f"checkpoint {found} was not written for this run's optimizer {j}: optimizer_{j}.pt has parameter "
                    f"groups of {saved_sizes} parameters, the prepared optimizer {sizes}; nothing was loaded",
                    found,
                    os.path.join(found, f"optimizer_{j}.pt"),
                )
    if read.rng is None and _world(read.marker, ctx) == ctx.world_size:
        raise CheckpointError(f"checkpoint {found} has no RNG states for rank {ctx.rank}; nothing was loaded", found)
    for i, (loader, saved) in enumerate(zip(registry.loaders, read.parts["loader"])):
        try:
            loader.check_state_dict(saved)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {found} cannot be loaded into prepared DataLoader {i}: {exc}; nothing was loaded",
                found,
                os.path.join(found, f"loader_{i}.pt"),
            ) from None
    if registry.keep_global_batch:
        _kept_accumulation(found, read.marker, registry, ctx)


def _split(registry: Registry) -> bool:
    """Whether the first prepared loader slices the global batch (split_batches)."""
    return bool(registry.loaders) and registry.loaders[0].shard is not None and registry.loaders[0].shard.split


def _saved_accumulation(marker: dict[str, Any], registry: Registry) -> int:
    return int(marker.get("accumulation_steps", registry.accumulation_steps))


def _kept_accumulation(found: str, marker: dict[str, Any], registry: Registry, ctx: RankContext) -> int:
    """The gradient accumulation that keeps the checkpoint's global batch on this world (keep_global_batch): the
    micro-batches of all ranks per update stay the same. CheckpointError when this world cannot."""
    written, saved = _world(marker, ctx), _saved_accumulation(marker, registry)
    if _split(registry):  # each micro-batch already is the global one
        return saved
    units = written * saved
    if units % ctx.world_size:
        fits = ", ".join(str(n) for n in range(1, units + 1) if units % n == 0)
        raise CheckpointError(
            f"checkpoint {found} was written by {written} rank{'s' * (written != 1)} with gradient accumulation "
            f"{saved}: keep_global_batch cannot keep its global batch on {ctx.world_size} ranks ({written} x {saved} = "
            f"{units} micro-batches per update do not divide by {ctx.world_size}); resume on {fits} ranks, or with "
            "keep_global_batch=False to keep the batch per rank (the global batch then changes); nothing was loaded",
            found,
        )
    return units // ctx.world_size


def _world(marker: dict[str, Any], ctx: RankContext) -> int:
    """The number of ranks that wrote a checkpoint."""
    return int(marker.get("world_size", ctx.world_size))


def _target(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The full shape of each tensor in ``model``'s state dict (a sharded parameter's too)."""
    module = model if is_sharded(model) else _plain_module(model)
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if torch.is_tensor(v)}


def _first_mismatch(saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str | None:
    for key, shape in wanted.items():
        if key not in saved:
            return f"it holds no {key!r}"
        if saved[key] != shape:
            return f"its {key!r} has shape {list(saved[key])}, the model's {list(shape)}"
    extra = [key for key in saved if key not in wanted]
    return f"it holds {extra[0]!r}, which the model has not" if extra else None


def _check_count(directory: str, kind: str, saved: int, prepared: int) -> None:
    if saved != prepared:
        raise CheckpointError(
            f"{directory} holds {saved} {kind} state(s) but this run prepared/registered {prepared}; "
            "prepare the same objects, in the same order, before load_state()",
            directory,
        )


def _apply_everywhere(found: str, read: _Read, registry: Registry, ctx: RankContext) -> None:
    """_apply(), its failure on any rank raised on every rank (a registered object's load_state_dict may raise)."""
    failure: Exception | None = None
    try:
        _apply(found, read, registry, ctx)
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on every rank
        failure = exc
    reports = collectives.gather_object(agreement.told(failure, ctx.rank), ctx)
    agreement.raise_first(
        reports,
        failure,
        ctx.rank,
        _failed(
            ctx, "load_state()", f"loading {found} into the prepared objects", "; they may hold part of it: load again"
        ),
    )


def _apply(found: str, read: _Read, registry: Registry, ctx: RankContext) -> None:
    """Load what was read into the prepared objects (a sharded checkpoint's models and optimizers are read here)."""
    if read.sharded:
        sharding.load_sharded(os.path.join(found, folders.SHARDED_DIR), registry.models, _optimizers(registry))
    elif registry.mesh is not None:  # a DDP checkpoint's full states, into sharded models
        sharding.load_full(registry.models, _optimizers(registry), read.parts["model"], read.parts["optimizer"])
    else:
        for model, saved in zip(registry.models, read.parts["model"]):
            _plain_module(model).load_state_dict(saved)
        for optimizer, saved in zip(registry.optimizers, read.parts["optimizer"]):
            optimizer.load_state_dict(saved)
    for kind, objects in (
        ("scheduler", registry.schedulers),
        ("loader", registry.loaders),
        ("registered", registry.registered),
    ):
        for obj, saved in zip(objects, read.parts[kind]):
            obj.load_state_dict(saved)
    if registry.scaler is not None:
        registry.scaler.load_state_dict(read.parts["scaler"][0])
    if _world(read.marker, ctx) == ctx.world_size:
        random_states.set_rng_state(read.rng)
    else:  # one rank's states cannot stand for another's: every rank derives its own
        seed = read.parts["loader"][0]["seed"] if read.parts["loader"] else 0
        random_states.seed_rng_states(seed, int(read.marker["step"]), ctx.rank)
    registry.updates = int(read.marker["step"])
    registry.trackers.restore(read.marker.get("trackers"))
    if registry.keep_global_batch:
        steps = _kept_accumulation(found, read.marker, registry, ctx)
        if steps != registry.accumulation_steps:
            registry.accumulation_steps = steps
            registry.accumulation_set_by = (
                f"keep_global_batch, resuming {os.path.basename(found)} of "
                f"{_world(read.marker, ctx)} ranks on {ctx.world_size}"
            )


def resumed_line(found: str, registry: Registry, ctx: RankContext) -> str:
    """What resume() did, in one line: the checkpoint, the world that wrote it and this one, where the first
    prepared loader goes on, and what became of the batch of all ranks together."""
    marker = folders.read_marker(found)
    written, saved = _world(marker, ctx), _saved_accumulation(marker, registry)
    line = f"qaccel: resumed {os.path.basename(found)} (written by {written} rank{'s' * (written != 1)})"
    line += f" on {ctx.world_size} rank{'s' * (ctx.world_size != 1)}"
    if not registry.loaders:
        return line
    loader = registry.loaders[0]
    try:
        of = f" of {len(loader)}"
    except TypeError:  # a stream without a length
        of = ""
    line += f" at epoch {loader.epoch}, batch {loader.batches_to_skip}{of}"
    steps = registry.accumulation_steps
    if (written == ctx.world_size and saved == steps) or loader.batch_size is None:
        return line
    accumulation = f"gradient accumulation {steps}"
    if _split(registry):
        before, after = loader.batch_size * saved, loader.batch_size * steps
        how = "split_batches" + (f", {accumulation}" if steps > 1 else "")
    else:
        before, after = loader.batch_size * written * saved, loader.batch_size * ctx.world_size * steps
        how = accumulation
    if before == after:
        return line + f"; global batch {after} kept ({how})"
    return (
        line + f"; batch per rank {loader.batch_size} kept, so the global batch changes from {before} to {after}"
        " (keep_global_batch=True keeps it)"
    )


def consolidate(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], model: int = 0, allow_pickle: bool | None = None
) -> str:
    """Write prepared model ``model`` of a save_state() checkpoint (sharded or not) to ``out`` as one plain state
    dict, loadable strictly into the user's model, atomically. ``checkpoint`` may be a folder of numbered ones (the
    newest is read). Runs in one process, without ranks. Returns the checkpoint read. A sharded checkpoint's
    metadata is a pickle: read as ``allow_pickle`` says (unpickling.py)."""
    path = os.path.abspath(os.fspath(checkpoint))
    found = folders.newest_checkpoint(path)
    if found is None:
        raise folders.not_a_checkpoint(path)
    try:
        marker = folders.read_marker(found)
        for name, recorded in sorted(marker["files"].items()):
            if why := storage.damage(os.path.join(found, name), recorded):
                raise folders.Unreadable(name, why)
        sharded = os.path.join(found, folders.SHARDED_DIR)
        if folders.marks_sharded(marker):
            unpickling.check(sharded, "torch.distributed.checkpoint pickles its metadata", allow_pickle)
            state = sharding.read_full_model(sharded, model)
        elif f"model_{model}.pt" in marker["files"]:
            state = torch.load(os.path.join(found, f"model_{model}.pt"), map_location="cpu", weights_only=True)
        else:
            raise CheckpointError(
                f"checkpoint {found} holds no model {model} (it holds {folders.listed_count(marker, 'model')})", found
            )
    except unpickling.Untrusted as exc:
        raise CheckpointError(f"checkpoint {found} was not read: {exc}", found, exc.path) from None
    except folders.Unreadable as exc:
        raise CheckpointError(
            f"checkpoint {found} is damaged: {exc}", found, os.path.join(found, exc.file), damaged=True
        ) from exc
    except (OSError, RuntimeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {found} cannot be read: {type(exc).__name__}: {exc}", found) from exc
    storage.save(state, out)
    return found
