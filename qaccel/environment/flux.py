"""The tasks of a Flux job (``flux run``, ``flux submit``), by the variables Flux's job shell gives each task."""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind, derived_port
from qaccel.environment.variables import int_of, optional_int


class FluxTasks:
    """A Flux job's tasks: ``FLUX_TASK_RANK``, ``FLUX_TASK_LOCAL_ID``, ``FLUX_JOB_SIZE`` and ``FLUX_JOB_NNODES`` give
    the layout, ``FLUX_JOB_ID`` the port every task derives alike (unless MASTER_PORT is set).

    Flux gives no rendezvous address: MASTER_ADDR you pass to every task wins (``flux run --env=MASTER_ADDR=...``);
    on one node it is 127.0.0.1. A task's node is rank // tasks per node, so the tasks must fill the nodes in order,
    as many on each (Flux's default); any other placement is refused with a ValueError rather than given wrong node
    ranks.
    """

    kind = Kind.FLUX

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if "FLUX_TASK_RANK" not in env or "FLUX_JOB_SIZE" not in env:
            return None
        world_size = int_of(env, "FLUX_JOB_SIZE", 1)
        if world_size <= 1:
            return None
        rank, num_nodes = int_of(env, "FLUX_TASK_RANK", 0), max(int_of(env, "FLUX_JOB_NNODES", 1), 1)
        local_world_size = world_size // num_nodes
        local_rank = int_of(env, "FLUX_TASK_LOCAL_ID", rank)
        if world_size % num_nodes or local_rank != rank % local_world_size:
            raise ValueError(
                f"Flux placed task {rank} of {world_size} on {num_nodes} nodes as local task {local_rank} "
                "(FLUX_TASK_RANK, FLUX_JOB_SIZE, FLUX_JOB_NNODES, FLUX_TASK_LOCAL_ID): qaccel finds a task's node only "
                "when the tasks fill the nodes in order, as many on each; ask for that, e.g. flux run -N "
                f"{num_nodes} --tasks-per-node={max(world_size // num_nodes, 1)}"
            )
        master_addr = env.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else None)
        if master_addr is None:
            raise ValueError(
                f"a Flux job of {world_size} tasks on {num_nodes} nodes needs the rendezvous address of task 0's "
                "node: pass MASTER_ADDR to every task, e.g. flux run --env=MASTER_ADDR=<task 0's host>"
            )
        job = env.get("FLUX_JOB_ID")
        master_port = optional_int(env, "MASTER_PORT") or (derived_port(job) if job else None)
        if master_port is None:
            raise ValueError("a Flux task needs FLUX_JOB_ID (set by Flux) or MASTER_PORT to find task 0")
        return Environment(
            kind=self.kind,
            rank=rank,
            local_rank=local_rank,
            node_rank=rank // local_world_size,
            world_size=world_size,
            local_world_size=local_world_size,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
            address_from="MASTER_ADDR" if env.get("MASTER_ADDR") else "one node: loopback",
        )
