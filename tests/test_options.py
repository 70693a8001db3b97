"""The options are declared once (qaccel.options.OPTIONS): the Accelerator's signature, its docstring, the resolved
Config and the docs' table all follow that declaration, and a drift between them fails here."""

from __future__ import annotations

import dataclasses
import datetime
import inspect

import pytest

from qaccel import Accelerator, options
from qaccel.environment import detect


def test_the_signature_is_the_declaration():
    """What IDEs and type checkers read (the written-out __init__) is what the declaration says, in order, with the
    same defaults, kinds and annotations; then Accelerate's translated arguments, then the refused rest."""
    *parameters, refused = list(inspect.signature(Accelerator.__init__).parameters.values())[1:]
    assert refused.kind is inspect.Parameter.VAR_KEYWORD and refused.annotation == "Never", (
        "other keywords: refused at run time naming the qaccel way, and by a type checker"
    )
    names = [o.name for o in options.OPTIONS] + list(options.ACCELERATE_NAMES)
    assert [p.name for p in parameters] == names
    for parameter, option in zip(parameters, options.OPTIONS):
        assert (parameter.default, parameter.annotation) == (option.default, option.annotation), option.name
        kind = inspect.Parameter.KEYWORD_ONLY if option.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert parameter.kind is kind, option.name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[len(options.OPTIONS) :])


def test_the_trainers_config_inherits_every_option_and_the_resolved_config_has_one_field_each():
    from qaccel import TrainConfig

    declared = {f.name: f.default for f in dataclasses.fields(options.Options)}
    assert list(declared) == list(options.NAMES)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, default in declared.items():
        assert fields[name].default == default and fields[name].kw_only, name
    # the resolved Config: each option as resolved, except the two resolved into others, and what they decide
    resolved_into = {"kwargs_handlers": "handlers", "dynamo_backend": "compile"}
    resolved_names = [resolved_into.get(name, name) for name in options.NAMES]
    config_names = [f.name for f in dataclasses.fields(options.Config)]
    assert set(config_names) == {*resolved_names, "device_type", "log_device_type"}
    assert options.Config.__dataclass_params__.frozen


def test_the_resolved_config_holds_resolved_values_and_cannot_change():
    resolved = Accelerator(compute_setup="cpu", timeout=datetime.timedelta(minutes=1), strategy="ddp")._config
    assert resolved.timeout == 60.0 and resolved.strategy is options.Strategy.DDP
    assert resolved.compute_setup is options.ComputeSetup.CPU and resolved.backend is options.Backend.GLOO
    assert resolved.mixed_precision is options.MixedPrecision.NO and resolved.rng_types == ("generator",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.nprocs = 4  # type: ignore[misc]


def test_the_docstring_and_the_table_name_every_option_in_order():
    doc = Accelerator.__doc__.split("Args:", 1)[1]
    table = options.option_table()
    for text in (doc, table):
        positions = [text.index(o.name + (":" if text is doc else "`")) for o in options.OPTIONS]
        assert positions == sorted(positions)
    assert table.count("\n| `") == len(options.OPTIONS)


def test_make_config_refuses_a_name_it_does_not_declare():
    with pytest.raises(TypeError, match="unknown option.*nproc.*the options are nprocs, compute_setup"):
        options.make_config(detect(), nproc=2)


def test_closed_sets_resolve_to_enums_that_still_compare_as_strings():
    acc = Accelerator(compute_setup="cpu", mixed_precision="bf16", strategy="ddp")
    config = acc._config
    assert config.device_type is options.DeviceType.CPU and config.backend is options.Backend.GLOO
    assert config.mixed_precision is options.MixedPrecision.BF16 and config.strategy is options.Strategy.DDP
    assert config.start_method is options.StartMethod.FORKSERVER
    assert acc.backend == "gloo" and acc.mixed_precision == "bf16" and acc.strategy == "ddp"
    assert repr(acc).endswith("backend='gloo', dtype=None)")


def test_accelerates_cpu_is_understood_and_its_other_arguments_name_the_qaccel_way():
    assert Accelerator(cpu=True).device.type == "cpu"
    with pytest.raises(ValueError, match="cpu=True contradicts compute_setup='gpu'"):
        Accelerator(cpu=True, compute_setup="gpu")
    with pytest.raises(
        TypeError,
        match=r"Accelerator\(fsdp_plugin=...\) is Accelerate's; in qaccel: "
        r"strategy='fsdp' with fsdp_modules",
    ):
        Accelerator(fsdp_plugin=object())
    with pytest.raises(TypeError, match="unexpected argument 'nproc'; the options are nprocs, compute_setup"):
        Accelerator(nproc=2)
    for name in options.ACCELERATE_ONLY:
        with pytest.raises(TypeError, match=f"Accelerator\\({name}=...\\) is Accelerate's; in qaccel: "):
            Accelerator(**{name: None})


def test_accelerates_dataloader_configuration_sets_the_loader_options_and_refuses_what_qaccel_lacks():
    from types import SimpleNamespace as DataLoaderConfiguration  # its fields, without installing Accelerate

    config = DataLoaderConfiguration(
        split_batches=True, even_batches=True, dispatch_batches=False, use_seedable_sampler=True, non_blocking=False
    )
    assert Accelerator(cpu=True, dataloader_config=config)._config.split_batches is True
    assert Accelerator(cpu=True, dataloader_config=config)._config.use_seedable_sampler is True
    assert Accelerator(cpu=True, dataloader_config=None)._config.split_batches is False
    uneven = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    assert (uneven.even_batches, uneven.split_batches) == (False, False)
    with pytest.raises(TypeError, match=r"DataLoaderConfiguration.even_batches must be True or False"):
        Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=None))
    assert Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).dispatch_batches
    seeded = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3)
    from qaccel import DataLoaderConfiguration as Ours

    changed = Ours(use_seedable_sampler=True, data_seed=42)
    changed.data_seed = 43  # a plain dataclass, as Accelerate's: scripts change a field before passing it
    assert Accelerator(cpu=True, dataloader_config=changed)._config.data_seed == 43
    assert Accelerator(cpu=True, dataloader_config=seeded)._config.data_seed == 3
    with pytest.raises(
        ValueError,
        match=r"data_seed seeds the order of use_seedable_sampler=True .as in Accelerate, "
        r"where it does nothing otherwise.",
    ):
        Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=3))
    with pytest.raises(ValueError, match=r"DataLoaderConfiguration\(use_stateful_dataloader=True\) is not in qaccel"):
        Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    assert Accelerator(rng_types=["torch", "generator"])._config.rng_types == ("torch", "generator")
    with pytest.raises(ValueError, match="rng_types holds 'torch', 'cuda', 'generator'.*; got 'xla'"):
        Accelerator(rng_types=["xla"])


def test_accelerates_accumulation_plugin_sets_the_accumulation_options():
    from qaccel import GradientAccumulationPlugin

    acc = Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_each_batch=True)
    )
    assert (acc.gradient_accumulation_steps, acc._config.sync_each_batch) == (4, True)
    with pytest.raises(ValueError, match=r"num_steps=4\) contradicts gradient_accumulation_steps=2"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    with pytest.raises(ValueError, match="sync_with_dataloader=False. is not in qaccel"):
        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(sync_with_dataloader=False))


def test_mixed_precision_unset_reads_what_accelerates_launchers_export(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert Accelerator(compute_setup="cpu").mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    assert Accelerator(compute_setup="cpu").mixed_precision == "bf16", "as Accelerate reads it: any case"
    assert Accelerator(compute_setup="cpu", mixed_precision="no").mixed_precision == "no", "an argument wins"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(
        ValueError,
        match=r"^ACCELERATE_MIXED_PRECISION='fp8' \(read for mixed_precision=None\) must "
        r"be one of 'no', 'bf16', 'fp16'$",
    ):
        Accelerator(compute_setup="cpu")
