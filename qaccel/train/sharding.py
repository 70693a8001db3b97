"""strategy="fsdp": torch's FSDP2 (``fully_shard``) on any device, with the policy that picks the sharded units.

Each rank keeps 1/N of every parameter, gradient and optimizer state; a unit's full parameters exist only while it
runs forward or backward. The mesh is built on the rank's own device type: with gloo it must be "cpu", or FSDP2
moves the model to a GPU the machine happens to have (torch #132471).

torch's FSDP, DTensor and checkpoint modules are imported on first use: they cost ~1 s, which `import qaccel` and
every DDP rank would otherwise pay (benchmarks/launch.py).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from qaccel import storage
from qaccel.comm.session import RankContext
from qaccel.options import MixedPrecision
from qaccel.wrapping import is_sharded

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor


def _has_dtensor(tensors: list[torch.Tensor]) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(t, module.DTensor) for t in tensors)


def units(model: torch.nn.Module, class_names: tuple[str, ...], min_params: int) -> list[torch.nn.Module]:
    """The submodules to shard as units of their own, children before parents (fully_shard's order).

    With ``class_names``, every instance of those classes (matched by qualified name along the MRO, so a class
    from ``__main__`` matches in a rank too). Otherwise bottom-up by size: a submodule becomes a unit when the
    parameters not already in a smaller unit number at least ``min_params``. A module sharing a parameter
    with a module outside it (tied weights) is never a unit: the tie would be cut; the parent keeps both.
    """
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    chosen: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module, prefix: str) -> int:
        rest = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            rest += visit(child, f"{prefix}{name}.")
        if module is model or not _self_contained(module, prefix, names_of):
            return rest
        if class_names:
            wanted = any(cls.__qualname__ in class_names for cls in type(module).__mro__)
        else:
            wanted = rest >= min_params
        if wanted:
            chosen.append(module)
            return 0
        return rest

    visit(model, "")
    return chosen


def _self_contained(module: torch.nn.Module, prefix: str, names_of: dict[int, list[str]]) -> bool:
    return all(name.startswith(prefix) for p in module.parameters() for name in names_of[id(p)])


def shard(
    model: torch.nn.Module,
    class_names: tuple[str, ...],
    min_params: int,
    mixed_precision: MixedPrecision,
    mesh: DeviceMesh,
) -> dict[int, tuple[weakref.ref, torch.nn.Parameter]]:
    """fully_shard the policy's units, then the root, in place. Returns, for optimizers built before this, each
    replaced parameter's id -> (a weak reference to it, its sharded replacement)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    before = dict(model.named_parameters())
    policy = MixedPrecisionPolicy()
    if mixed_precision is MixedPrecision.BF16:  # compute in bf16, reduce gradients in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units(model, class_names, min_params):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    # The loss is computed from the root's outputs: in fp32, as under DDP's autocast path.
    root_policy = (
        MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, output_dtype=torch.float32)
        if mixed_precision is MixedPrecision.BF16
        else policy
    )
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    after = dict(model.named_parameters())
    return {id(old): (weakref.ref(old), after[name]) for name, old in before.items() if after[name] is not old}


def mesh_for(ctx: RankContext) -> DeviceMesh:
    """A 1-D mesh over every rank, on this rank's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def point_at_shards(optimizer: torch.optim.Optimizer, replaced: dict[int, tuple[weakref.ref, Any]]) -> None:
    """Make an optimizer built before sharding hold the sharded parameters instead of the replaced ones."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            entry = replaced.get(id(param))
            if entry is None or entry[0]() is not param:
                continue
            if optimizer.state.get(param):
                raise ValueError(
                    "this optimizer already has state (it stepped before prepare()): with strategy='fsdp' its "
                    "moments would not match the sharded parameters; prepare the model and optimizer before training"
                )
            optimizer.state.pop(param, None)
            params[i] = entry[1]


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The sharded model's full state dict, plain CPU tensors, on rank 0 ({} on the others). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state of a sharded ``model``, keyed by parameter name, plain CPU tensors, on rank 0 ({}
    on the others). A collective. ``by_index`` turns it into what the plain optimizer's load_state_dict takes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def by_index(named: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (full_optimizer_state_dict's) keyed as ``optimizer.state_dict()``
    keys it: by the position of each parameter in ``optimizer``'s groups, a plain optimizer of the plain ``model``."""
    names = {id(param): name for name, param in model.named_parameters()}
    index = {
        names[id(param)]: i for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in named["param_groups"]
        ],
    }


def state_dicts(models: list[torch.nn.Module], optimizers: list[Any]) -> dict[str, Any]:
    """Models' and optimizers' state dicts as torch.distributed.checkpoint saves and loads them: keyed by parameter
    name, sharded where the model is (DTensors), plain where it is not (DDP, one process). The same names on
    every strategy and world size, which is what lets a checkpoint load into another."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {f"model_{i}": get_model_state_dict(m) for i, m in enumerate(models)}
    for j, optimizer in enumerate(optimizers):
        out[f"optimizer_{j}"] = get_optimizer_state_dict(_owner(optimizer, models), optimizer)
    return out


def save_sharded(path: str, states: dict[str, Any], group: Any = None) -> None:
    """Every rank writes its shards of ``states`` (state_dicts()'s) under ``path`` (rank 0 also the metadata). A
    collective over ``group`` (None: the default group)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(states, storage_writer=_writer(path), process_group=group)


def _writer(path: str) -> Any:
    """torch.distributed.checkpoint's file writer, keeping a full disk's errno in the error every rank raises.

    It sends each rank's failure to the others pickled, which drops the OSError that torch.save's own error was
    raised from: the error is re-raised here as that OSError, which pickles whole.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except Exception as exc:
                named = storage.named_full_disk(exc, path)
                if named is None:
                    raise
                raise named from exc

    return Writer(path)


def load_sharded(path: str, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
    """Read what save_sharded() wrote into these models and optimizers, resharding to this world (any size, any
    strategy; without a process group, as one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = state_dicts(models, optimizers)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(states, checkpoint_id=path)
    for i, model in enumerate(models):
        set_model_state_dict(model, states[f"model_{i}"])
    for j, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(_owner(optimizer, models), optimizer, states[f"optimizer_{j}"])


def saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The full shape of every tensor a sharded checkpoint holds, by flattened name ("model_0.fc.weight")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key: tuple(meta.size) for key, meta in metadata.items() if isinstance(meta, TensorStorageMetadata)}


def read_full_model(path: str, index: int) -> dict[str, torch.Tensor]:
    """Model ``index``'s full state dict from a sharded checkpoint, read in this one process (no group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"model_{index}."
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    target = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not target:
        raise ValueError(f"{path} holds no model {index}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({f"model_{index}": target}, checkpoint_id=path)
    return target


def load_full(
    models: list[torch.nn.Module], optimizers: list[Any], model_states: list[dict], optimizer_states: list[dict]
) -> None:
    """Load full (unsharded) states, as a DDP checkpoint holds them, into sharded models and their optimizers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    for model, state in zip(models, model_states):
        set_model_state_dict(model, state, options=full)
    for optimizer, state in zip(optimizers, optimizer_states):
        owner = _owner(optimizer, models)
        # torch's optimizer state_dict numbers parameters in param_groups order; DCP wants their names
        names = {id(p): name for name, p in owner.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {
            "state": {order[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[k] for k in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(owner, optimizer, by_name, options=full)


def _owner(optimizer: Any, models: list[torch.nn.Module]) -> torch.nn.Module:
    """The prepared model(s) whose parameters ``optimizer`` updates."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in models if any(id(p) in held for p in m.parameters())]
    if not owners:
        raise ValueError("an optimizer holds none of the prepared models' parameters; prepare() the model it trains")
    return owners[0] if len(owners) == 1 else torch.nn.ModuleList(owners)


def set_accumulating(models: Iterable[torch.nn.Module], accumulating: bool) -> None:
    """On accumulation steps keep gradients and parameters unsharded: no reduce-scatter, no re-gather."""
    for model in models:
        if is_sharded(model):
            sharded = cast("FSDPModule", model)
            sharded.set_requires_gradient_sync(not accumulating)
            sharded.set_reshard_after_backward(not accumulating)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """torch's clip_grad_norm_, with the total norm over all ranks' gradient shards when they are DTensors
    (torch's returns a DTensor of partial norms then); the norm comes back as a plain tensor."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not _has_dtensor(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    if _has_dtensor([total]):
        total = cast("DTensor", total).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
