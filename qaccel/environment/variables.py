"""Readers of a launcher's variables, shared by the detectors (one module per launcher): integers that fail loudly
on garbage, the first of several names, the torchrun-style layout around a known rank."""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind


def launcher_layout(env: Mapping[str, str], kind: Kind, rank: int, world_size: int) -> Environment:
    """The layout torchrun-style variables describe around a known rank and world (one node when silent)."""
    local_world_size = int_of(env, "LOCAL_WORLD_SIZE", world_size)
    node_key = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    return Environment(
        kind=kind,
        rank=rank,
        local_rank=int_of(env, "LOCAL_RANK", rank),
        node_rank=int_of(env, node_key, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        num_nodes=ceil_div(world_size, local_world_size),
        master_addr=env.get("MASTER_ADDR"),
        master_port=optional_int(env, "MASTER_PORT"),
        address_from=f"MASTER_ADDR, which {kind} set",
    )


def int_of(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable, or the default when unset; garbage is an error, not a silent default."""
    value = optional_int(env, name)
    return default if value is None else value


def optional_int(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    return next((optional_int(env, n) for n in names if n in env), None)


def first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[n] for n in names if n in env), None)


def ceil_div(numerator: int, denominator: int) -> int:
    """Node count from totals, never below one, and safe against a zero denominator."""
    return max(1, -(-numerator // max(denominator, 1)))
