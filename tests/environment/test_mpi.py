"""mpirun's processes, by their MPI's variables; the rendezvous found on one node, asked for on several."""

from __future__ import annotations

import os

import pytest
from support.launcher_variables import OPEN_MPI

from qaccel.environment import Environment, derived_port, detect


def test_open_mpi_on_two_nodes_needs_the_rendezvous_address_and_says_how():
    with pytest.raises(
        ValueError,
        match="an MPI job of 4 ranks on 2 nodes .* needs the rendezvous address of rank "
        "0's node: pass MASTER_ADDR .* mpirun -x MASTER_ADDR=",
    ):
        detect(OPEN_MPI)
    env = detect({**OPEN_MPI, "MASTER_ADDR": "node1"})
    assert env == Environment(
        kind="mpi",
        rank=3,
        local_rank=1,
        node_rank=1,
        world_size=4,
        local_world_size=2,
        num_nodes=2,
        master_addr="node1",
        master_port=derived_port("1234567"),
    )


def test_mpi_on_one_node_rendezvouses_on_loopback_at_a_port_of_the_job_or_its_daemon():
    one_node = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    env = detect(one_node)
    assert (env.master_addr, env.master_port, env.node_rank, env.num_nodes) == (
        "127.0.0.1",
        derived_port("1234567"),
        0,
        1,
    )
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect(mpich).master_port == derived_port(f"daemon {os.getppid()}"), "every local rank's parent"
    assert detect({**mpich, "MASTER_PORT": "29400"}).master_port == 29400, "yours wins"
    assert 20000 <= derived_port("x") < 30000 and derived_port("x") == derived_port("x")


@pytest.mark.parametrize(
    ("placed", "why"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
            "--map-by node: rank 1 first on the second node",
        ),
        (
            {
                "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
                "OMPI_MCA_orte_num_nodes": "2",
            },
            "--host a:2,b:1: rank 2 alone on node 2",
        ),
        ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1"}, "--host a:2,b:1: the ranks of the first node"),
        ({"OMPI_MCA_orte_num_nodes": "3"}, "Open MPI counts another number of nodes"),
    ],
    ids=["by node", "uneven, alone", "uneven, two", "node count"],
)
def test_ranks_not_placed_by_slot_evenly_are_refused_rather_than_given_wrong_nodes(placed, why):
    with pytest.raises(
        ValueError,
        match=r"^mpirun placed rank \d of \d as local rank \d of \d .*fill the nodes "
        r"in order, as many on each; place them so, e.g. mpirun --map-by slot",
    ):
        detect({**OPEN_MPI, "MASTER_ADDR": "node1", **placed})
    by_slot = {**OPEN_MPI, "MASTER_ADDR": "node1", "OMPI_MCA_orte_num_nodes": "2"}
    assert detect(by_slot).node_rank == 1, "rank 3, local 1 of 2: the second node"
