"""Accelerate's arguments that qaccel understands, translated into qaccel's options (its configuration groups
included), and those it refuses, each with the qaccel way to do what it does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qaccel.options.checks import flag
from qaccel.options.declared import NAMES

# Arguments of Accelerate's Accelerator that qaccel does not take, and the qaccel way to get what they do.
ACCELERATE_ONLY = {
    "deepspeed_plugin": "qaccel has no DeepSpeed; strategy='fsdp' shards parameters, gradients and optimizer state",
    "deepspeed_plugins": "qaccel has no DeepSpeed; strategy='fsdp' shards parameters, gradients and optimizer state",
    "fsdp_plugin": "strategy='fsdp' with fsdp_modules=... or fsdp_min_params=...",
    "torch_tp_plugin": "qaccel has no tensor parallelism",
    "megatron_lm_plugin": "qaccel has no Megatron-LM",
    "parallelism_config": "qaccel has data parallelism (strategy='ddp') and FSDP (strategy='fsdp')",
}


ACCELERATE_NAMES = ("cpu", "dataloader_config", "gradient_accumulation_plugin", "project_config", "dynamo_plugin")


def from_accelerate(arguments: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """``chosen`` with the Accelerate arguments qaccel understands translated (``cpu=True``: compute_setup="cpu");
    any other refused with the qaccel way to do what it does."""
    chosen = dict(chosen)
    for name, value in arguments.items():
        if name == "cpu":
            if flag("cpu", value):
                if chosen.get("compute_setup", "auto") not in ("auto", "cpu"):
                    raise ValueError(f"cpu=True contradicts compute_setup={chosen['compute_setup']!r}")
                chosen["compute_setup"] = "cpu"
        elif name == "dataloader_config":
            chosen = _dataloader_config(value, chosen)
        elif name == "gradient_accumulation_plugin":
            chosen = _accumulation_plugin(value, chosen)
        elif name == "project_config":
            chosen = _project_config(value, chosen)
        elif name == "dynamo_plugin":
            if value is not None and chosen.get("dynamo_backend") is not None:
                raise ValueError("pass dynamo_backend or dynamo_plugin, not both (as Accelerate)")
            chosen["dynamo_backend"] = value
        elif name in ACCELERATE_ONLY:
            raise TypeError(f"Accelerator({name}=...) is Accelerate's; in qaccel: {ACCELERATE_ONLY[name]}")
        else:
            raise TypeError(
                f"Accelerator() got an unexpected argument {name!r}; the options are "
                f"{', '.join(NAMES)} (and Accelerate's cpu=True, dataloader_config=..., "
                "gradient_accumulation_plugin=... and project_config=...)"
            )
    return chosen


@dataclass
class DataLoaderConfiguration:
    """Accelerate's grouping of the prepared loaders' options, for scripts that pass one: ``split_batches``,
    ``even_batches``, ``dispatch_batches``, ``use_seedable_sampler`` and ``data_seed`` are qaccel's options of those
    names; ``non_blocking`` is what prepared loaders do anyway; ``use_stateful_dataloader`` is refused (qaccel's
    way is named then)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Accelerate's grouping of where a project keeps its files, for scripts that pass one: ``project_dir`` is the
    option of that name and ``total_limit`` is ``keep_checkpoints``. Checkpoints saved without a folder are always
    numbered, by step; ``logging_dir`` is the option of that name, where trackers write (by default project_dir)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's grouping of the accumulation options, for scripts that pass one: ``num_steps`` is
    ``gradient_accumulation_steps``, ``sync_each_batch`` the option of that name; an epoch's last batch always
    synchronises (``sync_with_dataloader``), and ``adjust_scheduler`` is what step_scheduler_with_optimizer does."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


def _accumulation_plugin(plugin: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate GradientAccumulationPlugin (any object with its fields) as qaccel's options."""
    if plugin is None:
        return chosen
    if getattr(plugin, "sync_with_dataloader", True) is not True:
        raise ValueError(
            "GradientAccumulationPlugin(sync_with_dataloader=False) is not in qaccel: an epoch's last "
            "batch always synchronises and updates"
        )
    steps = getattr(plugin, "num_steps", None)
    each = flag("GradientAccumulationPlugin.sync_each_batch", getattr(plugin, "sync_each_batch", False))
    chosen = {**chosen, "sync_each_batch": each or chosen.get("sync_each_batch", False)}
    if steps is not None:
        if chosen.get("gradient_accumulation_steps", 1) not in (1, steps):
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={steps}) contradicts "
                f"gradient_accumulation_steps={chosen['gradient_accumulation_steps']}"
            )
        chosen["gradient_accumulation_steps"] = steps
    return chosen


# DataLoaderConfiguration fields and the values that describe qaccel's prepared loaders (other values are refused).
_LOADER_VALUES = {"use_stateful_dataloader": (False,)}


_LOADER_WAYS = {
    "use_stateful_dataloader": "save_state() records where every prepared loader is, and load_state() continues "
    "there, mid-epoch included",
}


def _project_config(config: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate ProjectConfiguration (any object with its fields): ``project_dir`` is the option of that name,
    ``total_limit`` is ``keep_checkpoints``; checkpoints saved without a folder are numbered whatever
    ``automatic_checkpoint_naming`` says (by step: ``iteration`` must stay 0); ``save_on_each_node`` is refused."""
    if config is None:
        return chosen
    if getattr(config, "save_on_each_node", False):
        raise ValueError(
            "ProjectConfiguration(save_on_each_node=True) is not in qaccel: a checkpoint's files go to "
            "one folder every node reaches (a shared file system); leave save_on_each_node at False"
        )
    if getattr(config, "iteration", 0):
        raise ValueError(
            f"ProjectConfiguration(iteration={config.iteration}) is not in qaccel: numbered "
            "checkpoints are named by the optimizer step (checkpoint_<step>), which a resumed run "
            "continues; leave iteration at 0"
        )
    chosen = dict(chosen)
    for field, option in (
        ("project_dir", "project_dir"),
        ("logging_dir", "logging_dir"),
        ("total_limit", "keep_checkpoints"),
    ):
        value = getattr(config, field, None)
        if value is None:
            continue
        if chosen.get(option) is not None and chosen[option] != value:
            raise ValueError(f"ProjectConfiguration({field}={value!r}) contradicts {option}={chosen[option]!r}")
        chosen[option] = value
    return chosen


def _dataloader_config(config: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate DataLoaderConfiguration (any object with its fields): ``split_batches``, ``even_batches``,
    ``dispatch_batches``, ``use_seedable_sampler`` and ``data_seed`` are the options of those names; ``non_blocking`` is what
    prepared loaders do anyway; the others must keep their defaults."""
    if config is None:
        return chosen
    for field, allowed in _LOADER_VALUES.items():
        value = getattr(config, field, allowed[0])
        if not any(value is a for a in allowed):
            raise ValueError(
                f"DataLoaderConfiguration({field}={value!r}) is not in qaccel: {_LOADER_WAYS[field]}; "
                f"leave {field} at {allowed[0]!r}"
            )
    split = flag("DataLoaderConfiguration.split_batches", getattr(config, "split_batches", False))
    even = flag("DataLoaderConfiguration.even_batches", getattr(config, "even_batches", True))
    dispatch = getattr(config, "dispatch_batches", None)
    if dispatch is not None:
        flag("DataLoaderConfiguration.dispatch_batches", dispatch)
    seedable = flag("DataLoaderConfiguration.use_seedable_sampler", getattr(config, "use_seedable_sampler", False))
    data_seed = getattr(config, "data_seed", None)
    if data_seed is not None and chosen.get("data_seed") not in (None, data_seed):
        raise ValueError(
            f"DataLoaderConfiguration(data_seed={data_seed!r}) contradicts data_seed={chosen['data_seed']!r}"
        )
    return {
        **chosen,
        "split_batches": split or chosen.get("split_batches", False),
        "use_seedable_sampler": seedable or chosen.get("use_seedable_sampler", False),
        "data_seed": data_seed if data_seed is not None else chosen.get("data_seed"),
        "even_batches": even and chosen.get("even_batches", True),
        "dispatch_batches": dispatch if dispatch is not None else chosen.get("dispatch_batches"),
    }
