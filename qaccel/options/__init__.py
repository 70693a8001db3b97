"""The Accelerator's options: declared once (``declared``), their closed sets (``kinds``), the checks they share
(``checks``), resolved in the caller by ``make_config`` (``resolve``, with ``devices`` for where ranks compute and
``trackers`` for ``log_with``) into a frozen, typed ``Config``; Accelerate's arguments translated (``accelerate``),
``SlurmCluster`` (``cluster``) and the generated docs (``docs``). Everything is checked where the Accelerator is
made, so mistakes fail there."""

from qaccel.options.accelerate import (
    ACCELERATE_NAMES,
    ACCELERATE_ONLY,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    from_accelerate,
)
from qaccel.options.checks import count
from qaccel.options.cluster import SlurmCluster, minutes
from qaccel.options.config import Config
from qaccel.options.declared import FSDP_MIN_PARAMS, NAMES, OPTIONS, Option, Options
from qaccel.options.devices import MIXED_PRECISION_VARIABLE, ON_THE_NODES, on_node
from qaccel.options.docs import document, option_table
from qaccel.options.kinds import (
    Backend,
    BackendName,
    ComputeSetup,
    ComputeSetupName,
    DeviceType,
    DistributedType,
    JobOutput,
    LogSetup,
    LogSetupName,
    MixedPrecision,
    MixedPrecisionName,
    StartMethod,
    StartMethodName,
    Strategy,
    StrategyName,
    TrackingTool,
)
from qaccel.options.resolve import DEBUG_VARIABLE, check_uneven, make_config, placements
from qaccel.options.trackers import ALL_TRACKERS

__all__ = [
    "ACCELERATE_NAMES",
    "ACCELERATE_ONLY",
    "ALL_TRACKERS",
    "DEBUG_VARIABLE",
    "FSDP_MIN_PARAMS",
    "MIXED_PRECISION_VARIABLE",
    "NAMES",
    "ON_THE_NODES",
    "OPTIONS",
    "Backend",
    "BackendName",
    "ComputeSetup",
    "ComputeSetupName",
    "Config",
    "DataLoaderConfiguration",
    "DeviceType",
    "DistributedType",
    "GradientAccumulationPlugin",
    "JobOutput",
    "LogSetup",
    "LogSetupName",
    "MixedPrecision",
    "MixedPrecisionName",
    "Option",
    "Options",
    "ProjectConfiguration",
    "SlurmCluster",
    "StartMethod",
    "StartMethodName",
    "Strategy",
    "StrategyName",
    "TrackingTool",
    "check_uneven",
    "count",
    "document",
    "from_accelerate",
    "make_config",
    "minutes",
    "on_node",
    "option_table",
    "placements",
]
