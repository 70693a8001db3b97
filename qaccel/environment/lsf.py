"""The processes of LSF's jsrun, by its JSM_NAMESPACE_* variables."""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind, derived_port
from qaccel.environment.variables import ceil_div, int_of, optional_int


class LsfJsrun:
    """LSF's jsrun: ``JSM_NAMESPACE_*`` give the layout; rank 0's host is the first compute host of
    ``LSB_MCPU_HOSTS`` (after the launch node, which runs no rank) and the port comes from ``LSB_JOBID`` (as
    Lightning's LSF environment takes them), unless MASTER_ADDR/MASTER_PORT are set."""

    kind = Kind.LSF

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if "JSM_NAMESPACE_RANK" not in env or "JSM_NAMESPACE_SIZE" not in env:
            return None
        world_size = int_of(env, "JSM_NAMESPACE_SIZE", 1)
        if world_size <= 1:
            return None
        rank = int_of(env, "JSM_NAMESPACE_RANK", 0)
        local_world_size = int_of(env, "JSM_NAMESPACE_LOCAL_SIZE", world_size)
        hosts = env.get("LSB_MCPU_HOSTS", "").split()[::2]  # "launch 1 host1 4 host2 4": names, then counts
        master_addr = env.get("MASTER_ADDR") or (hosts[1] if len(hosts) > 1 else hosts[0] if hosts else None)
        job = env.get("LSB_JOBID")
        master_port = optional_int(env, "MASTER_PORT") or (derived_port(job) if job else None)
        if master_addr is None or master_port is None:
            raise ValueError(
                "a jsrun rank needs LSB_MCPU_HOSTS and LSB_JOBID (set by LSF) or MASTER_ADDR and "
                "MASTER_PORT to find rank 0"
            )
        return Environment(
            kind=self.kind,
            rank=rank,
            local_rank=int_of(env, "JSM_NAMESPACE_LOCAL_RANK", rank),
            node_rank=rank // max(local_world_size, 1),
            world_size=world_size,
            local_world_size=local_world_size,
            num_nodes=ceil_div(world_size, local_world_size),
            master_addr=master_addr,
            master_port=master_port,
            address_from="MASTER_ADDR" if env.get("MASTER_ADDR") else "LSB_MCPU_HOSTS",
        )
