"""Flux's tasks: FLUX_TASK_* and FLUX_JOB_* give the layout, FLUX_JOB_ID the port; the address is MASTER_ADDR's
on several nodes."""

from __future__ import annotations

import pytest

from qaccel.environment import Environment, derived_port, detect

TASK = {"FLUX_TASK_RANK": "5", "FLUX_TASK_LOCAL_ID": "1", "FLUX_JOB_SIZE": "8", "FLUX_JOB_NNODES": "2"}


def test_a_task_of_a_two_node_job_takes_its_layout_the_jobs_port_and_the_address_given():
    task = {**TASK, "FLUX_JOB_ID": "f3ETxsR9H", "MASTER_ADDR": "node0"}
    assert detect(task) == Environment(
        kind="flux",
        rank=5,
        local_rank=1,
        node_rank=1,
        world_size=8,
        local_world_size=4,
        num_nodes=2,
        master_addr="node0",
        master_port=derived_port("f3ETxsR9H"),
    )
    assert detect({**task, "MASTER_PORT": "29511"}).master_port == 29511, "a port you pass wins"
    assert detect(task).kind.exports_rank_variables and not detect(task).kind.creates_processes


def test_one_node_rendezvouses_on_the_loopback_and_one_task_is_a_plain_process():
    one_node = {"FLUX_TASK_RANK": "1", "FLUX_TASK_LOCAL_ID": "1", "FLUX_JOB_SIZE": "2", "FLUX_JOB_NNODES": "1"}
    found = detect({**one_node, "FLUX_JOB_ID": "42"})
    assert (found.master_addr, found.address_from, found.world_size, found.local_world_size) == (
        "127.0.0.1",
        "one node: loopback",
        2,
        2,
    )
    assert detect({**one_node, "FLUX_JOB_SIZE": "1", "FLUX_TASK_RANK": "0"}).kind == "plain"


def test_what_qaccel_cannot_place_fails_saying_what_to_pass():
    with pytest.raises(ValueError, match=r"needs the rendezvous address.*flux run --env=MASTER_ADDR="):
        detect({**TASK, "FLUX_JOB_ID": "42"})
    with pytest.raises(ValueError, match=r"tasks fill the nodes in order.*--tasks-per-node=4"):
        detect({**TASK, "FLUX_TASK_LOCAL_ID": "0", "FLUX_JOB_ID": "42", "MASTER_ADDR": "node0"})
    with pytest.raises(ValueError, match="needs FLUX_JOB_ID"):
        detect({**TASK, "MASTER_ADDR": "node0"})
