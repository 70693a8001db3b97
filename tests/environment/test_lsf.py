"""LSF's jsrun: JSM_NAMESPACE_* give the layout, LSB_* the rendezvous."""

from __future__ import annotations

import pytest

from qaccel.environment import Environment, derived_port, detect


def test_jsrun_takes_the_first_compute_host_and_the_jobs_port():
    jsrun = {
        "JSM_NAMESPACE_RANK": "5",
        "JSM_NAMESPACE_SIZE": "8",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
        "JSM_NAMESPACE_LOCAL_SIZE": "4",
        "LSB_JOBID": "8842",
        "LSB_MCPU_HOSTS": "batch1 1 c01 4 c02 4",
    }
    assert detect(jsrun) == Environment(
        kind="lsf",
        rank=5,
        local_rank=1,
        node_rank=1,
        world_size=8,
        local_world_size=4,
        num_nodes=2,
        master_addr="c01",
        master_port=derived_port("8842"),
    )
    assert detect(jsrun).address_from == "LSB_MCPU_HOSTS"
    with pytest.raises(ValueError, match="a jsrun rank needs LSB_MCPU_HOSTS and LSB_JOBID"):
        detect({k: v for k, v in jsrun.items() if k != "LSB_JOBID"})
