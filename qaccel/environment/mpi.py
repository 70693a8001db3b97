"""The processes of mpirun (Open MPI, MPICH, Intel MPI, MVAPICH), by their MPI's variables."""

from __future__ import annotations

import os
from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind, derived_port
from qaccel.environment.variables import ceil_div, first, int_of, optional_int


class Mpi:
    """mpirun's processes, by the variables of the MPI that started them (the first family present): Open MPI's
    ``OMPI_COMM_WORLD_*``, MPICH's and Intel MPI's (Hydra) ``PMI_*``/``MPI_LOCAL*``, MVAPICH's ``MV2_COMM_WORLD_*``.

    MPI gives no rendezvous address: ``MASTER_ADDR``/``MASTER_PORT`` you pass (``mpirun -x``) win; on one node it
    is 127.0.0.1 and a port from the job's id (Open MPI's), else from the launcher's daemon, every local rank's
    parent; on several nodes MASTER_ADDR is needed, and a ValueError says so.

    MPI does not say which node a rank is on; ranks placed by slot with as many on every node (mpirun's default
    with equal slots) are on node rank // local size. Any other placement is refused with a ValueError rather than
    given wrong node ranks: a rank whose local rank is not rank % local size, a world not a multiple of the local
    size, or (Open MPI says how many nodes) another node count.
    """

    kind = Kind.MPI
    FAMILIES = (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    )
    JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")  # the same on every rank of an Open MPI job
    NODES = "OMPI_MCA_orte_num_nodes"  # Open MPI 4's count of the job's nodes

    def find(self, env: Mapping[str, str]) -> Environment | None:
        family = next((f for f in self.FAMILIES if f[0] in env and f[1] in env), None)
        if family is None:
            return None
        rank_key, size_key, local_rank_key, local_size_key = family
        world_size = int_of(env, size_key, 1)
        if world_size <= 1:
            return None
        rank = int_of(env, rank_key, 0)
        local_rank, local_world_size = int_of(env, local_rank_key, rank), int_of(env, local_size_key, world_size)
        num_nodes = ceil_div(world_size, local_world_size)
        told = optional_int(env, self.NODES)
        if local_rank != rank % local_world_size or world_size % local_world_size or told not in (None, num_nodes):
            raise ValueError(
                f"mpirun placed rank {rank} of {world_size} as local rank {local_rank} of {local_world_size} "
                f"({rank_key}, {local_rank_key}, {local_size_key}" + (f", {self.NODES}={told}" if told else "") + "): "
                "qaccel finds a rank's node only when ranks fill the nodes in order, as many on each; place them so, "
                f"e.g. mpirun --map-by slot -npernode {local_world_size} (Open MPI), or -ppn {local_world_size} "
                "(MPICH, Intel MPI)"
            )
        master_addr = env.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else None)
        if master_addr is None:
            raise ValueError(
                f"an MPI job of {world_size} ranks on {num_nodes} nodes ({size_key}, {local_size_key}) "
                "needs the rendezvous address of rank 0's node: pass MASTER_ADDR (and MASTER_PORT) to "
                "every rank, e.g. mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500"
            )
        master_port = optional_int(env, "MASTER_PORT")
        if master_port is None:
            job = first(env, self.JOB_IDS)
            if job is None and num_nodes > 1:
                raise ValueError(
                    f"an MPI job on {num_nodes} nodes needs MASTER_PORT: mpirun -x MASTER_PORT=<a free "
                    "port on rank 0's host>"
                )
            master_port = derived_port(job if job is not None else f"daemon {os.getppid()}")
        return Environment(
            kind=self.kind,
            rank=rank,
            local_rank=local_rank,
            node_rank=rank // max(local_world_size, 1),
            world_size=world_size,
            local_world_size=local_world_size,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
            address_from="MASTER_ADDR" if env.get("MASTER_ADDR") else "one node: loopback",
        )
