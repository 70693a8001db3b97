"""A rendezvous host that cannot work fails within seconds on every rank, naming the host, the port and where they
came from (qaccel/comm/rendezvous.py): under a real srun (the local SLURM's nodes n1 and n2 do not resolve here, as
compute nodes' names often do not) and a real torchrun whose workers get an address that does not resolve."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support.procs import free_port, result_lines, script_env, script_file, slurm_env, torchrun_cmd

from qaccel.comm import rendezvous
from qaccel.errors import RendezvousError

pytestmark = pytest.mark.timeout(180)
SCRIPT = script_file("rendezvous_host.py")


def _srun(slurm_cluster, *options: str, **variables: str | None) -> list[dict]:
    env = slurm_env(slurm_cluster)
    for name, value in variables.items():
        env.pop(name) if value is None else env.update({name: value})
    proc = slurm_cluster.srun(["-N2", "-n2", *options, sys.executable, str(SCRIPT)], env=env, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return sorted(result_lines(proc.stdout), key=lambda r: r["rank"])


@pytest.mark.slurm
def test_under_srun_a_host_that_does_not_resolve_fails_every_rank_within_seconds(slurm_cluster):
    derived = _srun(slurm_cluster, MASTER_ADDR=None)  # the step's first node, n1: not a name this machine resolves
    assert [(r["rank"], r["type"]) for r in derived] == [(0, "RendezvousError"), (1, "RendezvousError")]
    for result, node in zip(derived, ("n1", "n2")):
        assert result["message"].startswith(f"rank {result['rank']} on {node}: the rendezvous host 'n1' (port ")
        assert "from the first node of SLURM_STEP_NODELIST) does not resolve here" in result["message"]
        assert result["seconds"] < 10
    given = _srun(slurm_cluster, MASTER_ADDR="nosuch.invalid")
    assert (
        all(
            "the rendezvous host 'nosuch.invalid' (port " in r["message"]
            and "from MASTER_ADDR)" in r["message"]
            and r["seconds"] < 10
            for r in given
        )
        and len(given) == 2
    ), given


@pytest.mark.slurm
def test_under_srun_rank_0_refuses_to_host_the_rendezvous_at_another_machines_address(slurm_cluster):
    # TEST-NET-1, no machine's; rank 1 would wait there for its timeout: srun ends the step when a task fails
    results = _srun(slurm_cluster, "--kill-on-bad-exit=1", MASTER_ADDR="192.0.2.1")
    first = results[0]
    assert first["rank"] == 0 and first["seconds"] < 10
    assert "rank 0 on n1 hosts the rendezvous at 192.0.2.1:" in first["message"]
    assert "(from MASTER_ADDR), but 192.0.2.1 is not an address of this machine" in first["message"]


def test_under_torchrun_workers_given_a_host_that_does_not_resolve_fail_within_seconds(tmp_path):
    """torchrun's workers meet at the address its first agent gives (--local-addr, else its host name) when the
    agent does not share its own store with them (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    env = script_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = torchrun_cmd(
            Path(logs),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--local-addr",
            "nosuch.invalid",
            str(SCRIPT),
        )
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    results = sorted(result_lines(proc.stdout), key=lambda r: r["rank"])
    assert proc.returncode != 0 and [r["rank"] for r in results] in ([0, 1], [0], [1]), proc.stdout + proc.stderr
    for result in results:  # torchrun stops the other worker once one has failed
        assert result["type"] == "RendezvousError" and result["seconds"] < 10
        assert f"rank {result['rank']} on " in result["message"]
        assert "the rendezvous host 'nosuch.invalid' (port " in result["message"]
        assert "from MASTER_ADDR, which torchrun set) does not resolve here" in result["message"]


def test_under_torchrun_its_agent_meets_first_and_its_own_timeout_bounds_the_wait(tmp_path):
    """What the torchrun page says: with --master-addr, torchrun's agent connects before any worker (so before any
    qaccel code) runs, and --rdzv-conf timeout=S bounds it."""
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = torchrun_cmd(
            Path(logs),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "nosuch.invalid",
            "--master-port",
            str(free_port()),
            "--rdzv-conf",
            "timeout=5",
            str(SCRIPT),
        )
        proc = subprocess.run(
            cmd, check=False, env=script_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
    assert proc.returncode != 0 and result_lines(proc.stdout) == [], "no worker ran"
    assert "timed out after 5000ms while trying to connect to (nosuch.invalid, " in proc.stderr, proc.stderr[-2000:]


def test_a_resolvable_local_host_passes_and_the_check_names_what_it_refuses():
    rendezvous.check("127.0.0.1", 29500, "MASTER_ADDR", 0, True, 60.0)
    with pytest.raises(
        RendezvousError,
        match=r"rank 3 on .*: the rendezvous host 'nosuch.invalid' \(port 1234, "
        r"from somewhere\) does not resolve here",
    ):
        rendezvous.check("nosuch.invalid", 1234, "somewhere", 3, False, 60.0)


def test_a_rank_refused_says_so_within_seconds_and_raises_at_the_timeout_naming_the_rendezvous(monkeypatch, capfd):
    monkeypatch.setattr(rendezvous, "SAY_AFTER_S", 0.5)
    port = free_port()  # nothing listens there
    with pytest.raises(
        RendezvousError,
        match=rf"rank 1 on .*: nothing answered at the rendezvous 127.0.0.1:{port} "
        rf"\(from MASTER_ADDR\) for 2 s \(Connection refused\): rank 0 never",
    ):
        rendezvous.check("127.0.0.1", port, "MASTER_ADDR", 1, False, 2.0)
    said = capfd.readouterr().err
    assert (
        len(
            re.findall(
                rf"qaccel: rank 1 on .* has waited \d s for the rendezvous at 127.0.0.1:{port} \(from "
                r"MASTER_ADDR; Connection refused\): rank 0 is not up yet, or 127.0.0.1 is not its machine\n",
                said,
            )
        )
        == 1
    ), "said once"


def test_a_rank_waits_for_a_late_rank_0_and_goes_on():
    late = socket.socket()
    late.bind(("127.0.0.1", 0))
    port = late.getsockname()[1]
    opened = threading.Timer(1.0, late.listen)
    opened.start()
    try:
        started = time.monotonic()
        rendezvous.check("127.0.0.1", port, "MASTER_ADDR", 1, False, 30.0)
        assert 0.9 < time.monotonic() - started < 10
    finally:
        opened.cancel()
        late.close()
