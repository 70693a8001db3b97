"""qadence's checkpoint helpers (``qadence.ml_tools.write_checkpoint``, ``load_checkpoint``, ...) with their file
names, contents and choice of the latest file, so a folder either library wrote is read by the other and a qadence
user's own save/load code keeps working after ``from qaccel import ...``.

Unlike qadence's, these never log a failure and go on: a checkpoint that cannot be written or read raises an error
naming the file, and a file is written beside its name and renamed onto it, so a crash never leaves half of one.
And they never run code from a folder someone else can write: files are read as plain data (``weights_only``, the
optimizer's own class allowed), and what needs full unpickling (a nevergrad optimizer, a model's own objects) only
as ``allow_pickle`` says (qaccel/unpickling.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from qaccel import storage, unpickling
from qaccel.checkpoints import folders
from qaccel.errors import CheckpointError
from qaccel.train.prepare import plain_object

logger = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]  # a folder, as qadence's Path or a str


class _QadenceModel(Protocol):
    """What qadence's QuantumModel and QNN have beyond torch's Module (see _is_qadence_model())."""

    def _to_dict(self, save_params: bool = ...) -> dict[str, Any]: ...

    def load_params_from_dict(self, d: dict[str, Any], strict: bool = ...) -> None: ...


def get_latest_checkpoint_name(folder: StrPath, type: str, device: str | torch.device = "cpu") -> Path:
    """The latest ``type`` (``"model"`` or ``"opt"``) checkpoint file's name in ``folder``, as qadence chooses it.

    The only ``.pt`` file whose name contains ``type``, if there is one; else the one with the highest iteration
    number written for ``device``'s type (``..._<n>_device_cpu.pt``) or in the legacy format (``..._<n>.pt``).
    Files of a string iteration (``best``) are never the latest unless alone. ``Path("")`` when none is found.
    """
    file = Path("")
    files = [f for f in os.listdir(folder) if f.endswith(".pt") and type in f]
    if len(files) == 0:
        logger.info("Directory %s does not contain any %s checkpoints.", folder, type)
    if len(files) == 1:
        file = Path(files[0])
    else:
        device = str(device).split(":")[0]
        pattern = re.compile(rf".*_(\d+)_device_{device}.pt$")  # qadence's patterns, unescaped dots included
        legacy_pattern = re.compile(r".*_(\d+).pt$")
        max_index = -1
        for f in files:
            legacy_match = legacy_pattern.search(f)
            match = pattern.search(f)
            if legacy_match:
                logger.warning("Found checkpoint(s) in legacy format: %s.", f)
                match = legacy_match
            if match:
                index = int(match.group(1).replace("_", ""))
                if index > max_index:
                    max_index = index
                    file = Path(f)
    return file


def write_checkpoint(folder: StrPath, model: Module, optimizer: Any, iteration: int | str) -> None:
    """Save ``model`` and ``optimizer`` in ``folder`` as qadence does, under iteration ``iteration``.

    ``model_<ModelClass>_ckpt_<iteration>_device_<cpu|cuda>.pt`` holds ``(iteration, model.state_dict())``, or
    ``(iteration, model._to_dict(save_params=True))`` for a model that has ``_to_dict`` and
    ``load_params_from_dict`` (qadence's ``QuantumModel`` and ``QNN``); ``opt_<OptClass>_ckpt_..._device_....pt``
    holds ``(iteration, type(optimizer), optimizer.state_dict())``, or a nevergrad optimizer pickled as its
    ``dump()`` writes it. An int iteration is written ``{iteration:03n}`` (``007``), a string as it is (``best``);
    the device is the model's (``None`` for a model without parameters).

    A model under DistributedDataParallel is saved as its ``.module`` (file named after the user's class, keys
    without the ``module.`` prefix qadence's would have), and an optimizer qaccel prepared as the user's own, so
    the files are those of the plain objects, which any model loads. The folder must exist.

    Raises:
        OSError: naming the file, when it cannot be written (the previous file of that name stays).
        RuntimeError: naming the file, when torch cannot save it.
        TypeError: for an optimizer neither torch's nor nevergrad's (qadence writes no file for it).
    """
    folder = Path(folder)
    model = plain_object(model)
    optimizer = plain_object(optimizer)
    qadence_model = _is_qadence_model(model)
    try:
        device: Any = model.device if qadence_model else next(model.parameters()).device
        device = str(device).split(":")[0]  # in case of using several CUDA devices
    except StopIteration:  # no parameters: qadence writes device None
        device = None
    iteration_substring = f"{iteration:03n}" if isinstance(iteration, int) else iteration
    model_file = folder / f"model_{type(model).__name__}_ckpt_{iteration_substring}_device_{device}.pt"
    opt_file = folder / f"opt_{type(optimizer).__name__}_ckpt_{iteration_substring}_device_{device}.pt"

    write_optimizer: Callable[[Any], Any]
    if isinstance(optimizer, Optimizer):
        opt_state = (iteration, type(optimizer), optimizer.state_dict())
        write_optimizer = lambda f: torch.save(opt_state, f)
    elif _is_nevergrad(optimizer):
        write_optimizer = lambda f: pickle.dump(optimizer, f)  # as nevergrad's Optimizer.dump()
    else:
        raise TypeError(
            f"write_checkpoint() saves a torch.optim.Optimizer or a nevergrad optimizer, not "
            f"{type(optimizer).__qualname__}; nothing was written"
        )

    if qadence_model:
        state = cast(_QadenceModel, model)._to_dict(save_params=True)
        if not state:  # qadence's _to_dict logs its error and returns {}
            raise RuntimeError(
                f"write_checkpoint() cannot write {model_file}: {type(model).__name__}._to_dict() "
                "returned nothing (it logs why to qadence's logger)"
            )
    else:
        state = model.state_dict()
    _write(model_file, lambda f: torch.save((iteration, state), f))
    logger.info("Writing %s checkpoint %s", type(model).__name__, model_file.name)
    _write(opt_file, write_optimizer)
    logger.info("Writing %s to checkpoint %s", type(optimizer).__name__, opt_file.name)


def load_checkpoint(
    folder: StrPath,
    model: Module,
    optimizer: Any,
    model_ckpt_name: str | Path = "",
    opt_ckpt_name: str | Path = "",
    device: str | torch.device = "cpu",
    *,
    allow_pickle: bool | None = None,
) -> tuple[Module, Any, int | str]:
    """Load the latest (or the named) model and optimizer checkpoints of ``folder``, as qadence does; from a run's
    folder where a qaccel fit saved its checkpoints (``checkpoint_every``) and no qadence files are, the newest
    checkpoint's, as a perceptrain script reads what its fit saved; from a qaccel checkpoint's own folder (the
    run's ``best``), that checkpoint's.

    A folder that does not exist is created and nothing is loaded (iteration 0); so is a folder without
    checkpoints. Returns the model, the optimizer (a nevergrad one is the loaded object) and the iteration the
    model's file was written at (an int, or a string such as ``"best"``). See load_model() and load_optimizer().
    ``allow_pickle``: what needs full unpickling is read only from a folder no one but you can write (None), always
    (True) or never (False).
    """
    folder = Path(folder)
    if not folder.exists():
        folder.mkdir(parents=True)
        return model, optimizer, 0
    if not model_ckpt_name and not opt_ckpt_name and not any(folder.glob("model_*_ckpt_*.pt")):
        if (folder / folders.MARKER_FILE).exists():  # a checkpoint itself: the run's best/, say
            return _load_fit_checkpoint(folder, model, optimizer, device)
        newest = folders.newest_checkpoint(folder / "checkpoints")
        if newest is not None:
            return _load_fit_checkpoint(Path(newest), model, optimizer, device)
    model, iteration = load_model(folder, model, model_ckpt_name, device, allow_pickle=allow_pickle)
    optimizer = load_optimizer(folder, optimizer, opt_ckpt_name, device, allow_pickle=allow_pickle)
    return model, optimizer, iteration


def _load_fit_checkpoint(
    checkpoint: Path, model: Module, optimizer: Any, device: str | torch.device
) -> tuple[Module, Any, int | str]:
    """The model and optimizer of a checkpoint a qaccel fit saved (``<log_folder>/checkpoints/checkpoint_<step>``),
    read as plain data; the iteration is the last epoch done before it ("best" for the run's best). A sharded (FSDP) checkpoint holds each
    rank's shards: the Trainer, or ``Accelerator.load_state``, reads it."""
    try:
        marker = folders.read_marker(str(checkpoint))
    except folders.Unreadable as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint} cannot be read: {exc}", str(checkpoint), str(checkpoint)
        ) from exc
    if folders.marks_sharded(marker):
        raise CheckpointError(
            f"checkpoint {checkpoint} holds a model sharded by strategy='fsdp', rank by rank: continue it with the "
            "Trainer (fit() finds it) or Accelerator.load_state()",
            str(checkpoint),
            str(checkpoint),
        )
    folder = checkpoint.parent

    def part(name: str) -> Any:
        path = checkpoint / name
        return _read(path, folder, lambda: torch.load(path, map_location=device, weights_only=True), None)

    cast(Any, plain_object(model)).load_state_dict(part("model_0.pt"))
    if optimizer is not None and "optimizer_0.pt" in marker["files"]:
        getattr(optimizer, "optimizer", optimizer).load_state_dict(part("optimizer_0.pt"))
    try:  # the fit's state, for its epoch: plain data, or else the step stands for it
        registered = torch.load(checkpoint / "registered_0.pt", weights_only=True)
    except Exception:  # noqa: BLE001 - a callback's state of its own, say: not needed for the weights
        registered = None
    done = registered.get("epochs_done") if isinstance(registered, dict) else None
    if checkpoint.name == "best":  # as qadence's and perceptrain's best file, whose iteration is "best"
        return model, optimizer, "best"
    return model, optimizer, done - 1 if isinstance(done, int) else int(marker["step"])


def load_model(
    folder: StrPath,
    model: Module,
    model_ckpt_name: str | Path = "",
    device: str | torch.device = "cpu",
    *args: Any,
    allow_pickle: bool | None = None,
    **kwargs: Any,
) -> tuple[Module, int | str]:
    """Load the latest (see get_latest_checkpoint_name()) or the named model checkpoint of ``folder`` into
    ``model``, as qadence does: ``load_params_from_dict`` for a model that has it (qadence's ``QuantumModel`` and
    ``QNN``), else ``load_state_dict(strict=True)``; then moved to ``device`` when that is ``cuda:<n>``.
    ``args`` and ``kwargs`` go to ``torch.load`` (``map_location=...``). Nothing found: ``(model, 0)``.
    ``allow_pickle``: see load_checkpoint().

    Loaded into the model given, as qadence does: a file qadence wrote from a DistributedDataParallel model (keys
    prefixed ``module.``) loads into a DDP model; any other file given a DDP model loads into its ``.module``.

    Raises:
        OSError (FileNotFoundError...): naming the file, when it cannot be opened.
        CheckpointError: naming the file, when it is not a checkpoint torch can read (damaged) or does not fit
            ``model``, or needs full unpickling where ``allow_pickle`` does not allow it; qadence logs the first two
            and returns the model as it was, and unpickles anything.
    """
    folder = Path(folder)
    if model_ckpt_name == "":
        model_ckpt_name = get_latest_checkpoint_name(folder, "model", device)
        if model_ckpt_name == Path(""):
            return model, 0
    path = folder / model_ckpt_name
    iteration, model_dict = _read(path, folder, lambda: unpickling.load(path, allow_pickle, *args, **kwargs), 2)
    target = model
    if isinstance(model, DistributedDataParallel) and not _ddp_keys(model_dict):
        target = model.module
    try:
        if _is_qadence_model(target):
            cast(_QadenceModel, target).load_params_from_dict(model_dict)
        else:
            target.load_state_dict(model_dict, strict=True)
    except Exception as exc:
        raise CheckpointError(
            f"model checkpoint {path} does not fit the {type(target).__name__} it is loaded into: {exc}",
            str(folder),
            str(path),
        ) from exc
    if re.search(r"cuda:\d+$", str(device)):  # load the model to a specific GPU if one is named
        model.to(device)
    return model, iteration


def load_optimizer(
    folder: StrPath,
    optimizer: Any,
    opt_ckpt_name: str | Path = "",
    device: str | torch.device = "cpu",
    *,
    allow_pickle: bool | None = None,
) -> Any:
    """Load the latest (see get_latest_checkpoint_name()) or the named optimizer checkpoint of ``folder``, as qadence
    does: a torch optimizer's state goes into ``optimizer``; a nevergrad optimizer is the one loaded from the file
    (returned). Nothing found: ``optimizer`` as it is. ``allow_pickle``: see load_checkpoint() (a nevergrad file is
    a pickle).

    Raises:
        OSError: naming the file, when a named file is missing or cannot be opened (qadence ignores a missing one).
        CheckpointError: naming the file, when it is damaged or was written for another optimizer class or
            parameters (qadence then keeps ``optimizer`` as it was, saying nothing).
        NotImplementedError: for an optimizer neither torch's nor nevergrad's, as qadence.
    """
    folder = Path(folder)
    if opt_ckpt_name == "":
        opt_ckpt_name = get_latest_checkpoint_name(folder, "opt", device)
        if not os.path.isfile(folder / opt_ckpt_name):
            return optimizer
    path = folder / opt_ckpt_name
    target = plain_object(optimizer)
    if isinstance(target, Optimizer):
        _, opt_type, state = _read(path, folder, lambda: unpickling.load(path, allow_pickle, safe=[type(target)]), 3)
        if not (isinstance(opt_type, type) and isinstance(target, opt_type)):
            written = getattr(opt_type, "__qualname__", repr(opt_type))
            raise CheckpointError(
                f"optimizer checkpoint {path} was written for a {written}, not "
                f"this {type(target).__qualname__}; nothing was loaded",
                str(folder),
                str(path),
            )
        try:
            target.load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(
                f"optimizer checkpoint {path} does not fit this {type(target).__qualname__}: {exc}",
                str(folder),
                str(path),
            ) from exc
        return optimizer
    if _is_nevergrad(target):
        loaded = _read(path, folder, lambda: _ng_load(path, allow_pickle), None)
        if loaded.name != target.name:
            raise CheckpointError(
                f"optimizer checkpoint {path} holds nevergrad's {loaded.name}, not {target.name}; nothing was loaded",
                str(folder),
                str(path),
            )
        return loaded
    raise NotImplementedError(
        f"load_optimizer() loads a torch.optim.Optimizer or a nevergrad optimizer, not {type(target).__qualname__}"
    )


def _is_qadence_model(model: Module) -> bool:
    """A model qadence saves with ``_to_dict`` and loads with ``load_params_from_dict`` (QuantumModel, QNN)."""
    return callable(getattr(model, "_to_dict", None)) and callable(getattr(model, "load_params_from_dict", None))


def _nevergrad_base() -> Any:
    """nevergrad's Optimizer class when nevergrad is imported (an optimizer of it cannot exist otherwise)."""
    base = sys.modules.get("nevergrad.optimization.base")
    return None if base is None else base.Optimizer


def _is_nevergrad(optimizer: Any) -> bool:
    base = _nevergrad_base()
    return base is not None and isinstance(optimizer, base)


def _ng_load(path: Path, allow_pickle: bool | None) -> Any:
    unpickling.check(path, "nevergrad pickles its optimizers", allow_pickle)
    return _nevergrad_base().load(path)


def _ddp_keys(state: Any) -> bool:
    """A state dict saved from a DistributedDataParallel model: every key starts with ``module.``."""
    return (
        isinstance(state, Mapping)
        and len(state) > 0
        and all(isinstance(key, str) and key.startswith("module.") for key in state)
    )


def _write(path: Path, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into a temporary file beside ``path``, renamed onto it; its errors name ``path``."""
    try:
        storage.write_with(write, path)
    except OSError as exc:
        if exc.filename == os.path.abspath(path):  # storage's full-disk error: names the file and the room left
            raise
        raise _os_error(exc, f"write_checkpoint() could not write {path}") from exc
    except RuntimeError as exc:
        raise RuntimeError(f"write_checkpoint() could not write {path}: {exc}") from exc


def _read(path: Path, folder: Path, load: Callable[[], Any], length: int | None) -> Any:
    """``load()`` the checkpoint file at ``path``; its errors name the file. ``length``: the tuple it must be."""
    try:
        loaded = load()
    except unpickling.Untrusted as exc:
        raise CheckpointError(f"checkpoint file {path} was not loaded: {exc}", str(folder), str(path)) from None
    except OSError as exc:
        raise _os_error(exc, f"cannot read checkpoint file {path}") from exc
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} is damaged or not a checkpoint: {type(exc).__name__}: {exc}",
            str(folder),
            str(path),
            damaged=True,
        ) from exc
    if length is not None and not (isinstance(loaded, tuple) and len(loaded) == length):
        raise CheckpointError(
            f"checkpoint file {path} is not a qadence checkpoint (a tuple of {length} items): it "
            f"holds a {type(loaded).__name__}",
            str(folder),
            str(path),
            damaged=True,
        )
    return loaded


def _os_error(exc: OSError, what: str) -> OSError:
    """``exc`` said with ``what`` (which names the file) first: the same errno, so the same OSError subclass."""
    text = f"{what}: {exc.strerror or exc}"
    return OSError(text) if exc.errno is None else OSError(exc.errno, text)
