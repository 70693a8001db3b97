"""Real multi-node on two simulated hosts, 2 nodes x 1 proc, gloo on CPU: unmodified torchrun (c10d rendezvous), a
real Open MPI mpirun, and processes given exactly the variables a Kubernetes PyTorchJob's pods and LSF's jsrun get.

The hosts are two network namespaces joined by a veth pair, each with its own hostname and /etc/hosts (recipe:
shared/recipes/two-hosts.md), so the ranks really talk over a network and not through loopback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.component import unavailable
from support.procs import report_results, script_env, script_file, torchrun_cmd, wait_dead

pytestmark = [pytest.mark.two_hosts, pytest.mark.timeout(180)]

HOSTS = ("hostA", "hostB")


def _ip(*args: str) -> None:
    """``ip args``; any failure means this machine cannot simulate hosts: say exactly why (skip, or fail in CI)."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        unavailable(f"cannot simulate two hosts: `ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _on_host(ns: str, name: str, etc: Path, *argv: str) -> list[str]:
    """Command running ``argv`` in namespace ``ns`` with its own hostname, /etc/hosts and empty resolv.conf
    (without them torchrun and gloo resolve the shared hostname to loopback)."""
    setup = (
        'mount --bind "$0/hosts" /etc/hosts && mount --bind "$0/resolv.conf" /etc/resolv.conf'
        ' && hostname "$1" && shift && exec "$@"'
    )
    return [
        "ip",
        "netns",
        "exec",
        ns,
        "unshare",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        setup,
        str(etc),
        name,
        *argv,
    ]


def _teardown(namespaces: list[str]) -> None:
    """Kill what is left in the namespaces (only our processes run there), then delete them (and the veths)."""
    for ns in namespaces:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30, check=False
        ).stdout.split()
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_dead(list(map(int, pids)), timeout=10)
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30, check=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[dict]:
    """Two namespaces and a veth pair, names and subnet unique to this pytest process; always removed.
    Root and the tools were checked before (conftest.py)."""
    pid = os.getpid()
    namespaces = [f"qaccel{pid}{c}" for c in "ab"]
    addrs = [f"10.200.{pid % 250 + 1}.{i}" for i in (1, 2)]  # per run too, though each pair is isolated
    etc = tmp_path_factory.mktemp("etc")
    (etc / "hosts").write_text(
        "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n::ffff:{a} {h}\n" for a, h in zip(addrs, HOSTS))
    )
    (etc / "resolv.conf").write_text("")
    made: list[str] = []
    try:
        for ns in namespaces:
            _ip("netns", "add", ns)
            made.append(ns)
        veths = [f"qv{pid}{c}" for c in "ab"]  # <= 15 chars; created inside the namespaces, gone with them
        _ip(
            "link",
            "add",
            veths[0],
            "netns",
            namespaces[0],
            "type",
            "veth",
            "peer",
            "name",
            veths[1],
            "netns",
            namespaces[1],
        )
        for ns, veth, addr in zip(namespaces, veths, addrs):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        probe = subprocess.run(
            _on_host(namespaces[0], HOSTS[0], etc, "hostname"), capture_output=True, text=True, timeout=30, check=False
        )
        if probe.stdout.strip() != HOSTS[0]:
            unavailable(
                f"cannot simulate two hosts: private hostname and /etc/hosts mount failed "
                f"(exit {probe.returncode}): {probe.stdout.strip()} {probe.stderr.strip()}"
            )
        yield {"namespaces": namespaces, "addrs": addrs, "etc": etc}
    finally:
        _teardown(made)


def _torchrun_on_both(hosts: dict, tmp_path: Path, *args: str, timeout: float = 90) -> list[tuple[int, str, str]]:
    """Start the same torchrun on both hosts at once; (returncode, stdout, stderr) per host."""
    script = script_file("two_hosts.py")
    cmd = [
        *torchrun_cmd(tmp_path / "torchelastic"),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"{hosts['addrs'][0]}:29400",
        "--rdzv_id",
        "qaccel",  # port in hostA's own stack
        "--rdzv_conf",
        "join_timeout=30,read_timeout=30",
        "--max-restarts",
        "0",
        str(script),
        *args,
    ]
    return _on_both(hosts, tmp_path, [cmd, cmd], [script_env(), script_env()], timeout)


def _on_both(
    hosts: dict, tmp_path: Path, cmds: list[list[str]], envs: list[dict], timeout: float, what: str = "torchrun"
) -> list[tuple[int, str, str]]:
    """Start ``cmds[i]`` with ``envs[i]`` on host i, both at once; (returncode, stdout, stderr) per host."""
    procs = []
    for ns, name, cmd, env in zip(hosts["namespaces"], HOSTS, cmds, envs):
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            procs.append(
                subprocess.Popen(_on_host(ns, name, hosts["etc"], *cmd), stdout=out, stderr=err, env=env, cwd=tmp_path)
            )
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:  # the fixture kills what is left inside the namespaces
        p.kill()
        p.wait()
    results = [
        (code, (tmp_path / f"{n}.out").read_text(), (tmp_path / f"{n}.err").read_text())
        for code, n in zip(codes, HOSTS)
    ]
    assert None not in codes, f"{what} still running after {timeout} s: {results}"
    return results


def test_torchrun_two_hosts_ranks_on_different_hosts(hosts, tmp_path):
    """Ranks, node ranks and a collective are right when the ranks really are on two hosts, twice in a process."""
    results = _torchrun_on_both(hosts, tmp_path, "-1")
    for code, _, err in results:
        assert code == 0, err
    lines = [json.loads(line) for _, out, _ in results for line in out.splitlines()]
    for session in (0, 1):
        got = sorted((d for d in lines if d["session"] == session), key=lambda d: d["rank"])
        assert [d["rank"] for d in got] == [0, 1], lines
        assert sorted(d["node_rank"] for d in got) == [0, 1]
        assert all(d["local_rank"] == 0 and d["world"] == 2 and d["sum"] == 1 for d in got), got
        assert sorted(d["host"] for d in got) == sorted(HOSTS)
    for (_, out, _), name in zip(results, HOSTS):  # each rank reports the host its torchrun ran on
        assert all(json.loads(line)["host"] == name for line in out.splitlines())


def test_torchrun_two_hosts_rank_error_fails_both(hosts, tmp_path):
    """A rank raising on one host fails both torchruns promptly, and that host's log names the rank."""
    results = _torchrun_on_both(hosts, tmp_path, "1")
    assert all(code != 0 for code, _, _ in results), results
    failing = [err for _, _, err in results if "ValueError: boom on rank 1" in err]
    assert len(failing) == 1, results
    assert "[qaccel] raised on rank 1 of 2" in failing[0]


def _rsh_agent(hosts: dict, path: Path) -> Path:
    """mpirun's rsh agent, called as ``agent HOST COMMAND...``: like ssh, it runs the command line with a shell on
    that host in a bare environment (so what the ranks need must come with ``-x``)."""
    run = {
        name: shlex.join(_on_host(ns, name, hosts["etc"], "env", "-i", "PATH=/usr/bin:/bin", "sh", "-c"))
        for ns, name in zip(hosts["namespaces"], HOSTS)
    }
    cases = "".join(f'{name}) exec {command} "$*" ;;\n' for name, command in run.items())
    path.write_text(
        f'#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}*) echo "agent: no host $host" >&2; exit 1 ;;\nesac\n'
    )
    path.chmod(0o755)
    return path


def _mpirun(
    hosts: dict, tmp_path: Path, *args: str, timeout: float = 90, slots: tuple[int, int] = (1, 1)
) -> subprocess.CompletedProcess:
    """Real Open MPI ``mpirun -np 2 report_ranks.py mpi`` started on hostA, one rank per host: its daemon on hostB,
    started through the agent, and mpirun talk over the veth subnet only; session dirs go to ``tmp_path``."""
    subnet = hosts["addrs"][0].rsplit(".", 1)[0] + ".0/24"
    placed = ",".join(f"{host}:{n}" for host, n in zip(HOSTS, slots))
    cmd = [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        str(sum(slots)),
        "--host",
        placed,
        "--mca",
        "plm_rsh_agent",
        str(_rsh_agent(hosts, tmp_path / "agent")),
        "--mca",
        "oob_tcp_if_include",
        subnet,
        "--mca",
        "orte_tmpdir_base",
        str(tmp_path),
        "-x",
        "PATH",
        "-x",
        "PYTHONPATH",
        *args,
        sys.executable,
        str(script_file("report_ranks.py")),
        "mpi",
    ]
    env = script_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    out, err = tmp_path / "mpirun.out", tmp_path / "mpirun.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            _on_host(hosts["namespaces"][0], HOSTS[0], hosts["etc"], *cmd), stdout=o, stderr=e, env=env, cwd=tmp_path
        )
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
        proc.terminate()  # mpirun then ends the job on both hosts; the fixture kills whatever is left
        try:
            proc.wait(10)
        finally:
            proc.kill()
            proc.wait()
    assert code is not None, f"mpirun still running after {timeout} s: {out.read_text()}{err.read_text()}"
    return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def test_mpirun_two_hosts_ranks_on_different_hosts(hosts, tmp_path):
    """With MASTER_ADDR/MASTER_PORT passed by -x, mpirun's processes on two hosts are one world of 2, each its node's
    local rank 0, and the collective runs over the network (the port is in hostA's own stack)."""
    proc = _mpirun(hosts, tmp_path, "-x", f"MASTER_ADDR={hosts['addrs'][0]}", "-x", "MASTER_PORT=29500")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(report_results(proc.stdout), key=lambda r: r["rank"])
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["env_rank"], r["host"]) for r in results] == [
        (0, 0, 0, 2, 1, "0", HOSTS[0]),
        (1, 0, 1, 2, 1, "1", HOSTS[1]),
    ], proc.stdout + proc.stderr


def test_mpirun_two_hosts_without_master_addr_fails_saying_so(hosts, tmp_path):
    """Without MASTER_ADDR no rank knows where rank 0 is: the ranks fail at once, saying what to pass (a rank
    waiting for a rendezvous instead would outlast the short timeout)."""
    proc = _mpirun(hosts, tmp_path, timeout=30)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ValueError: an MPI job of 2 ranks on 2 nodes" in proc.stderr, proc.stderr
    assert "pass MASTER_ADDR" in proc.stderr and "mpirun -x MASTER_ADDR=" in proc.stderr, proc.stderr


def test_mpirun_two_hosts_placed_unevenly_fails_saying_how_to_place(hosts, tmp_path):
    """Two ranks on hostA and one on hostB: MPI's variables cannot say which node a rank is on, so every rank
    refuses at once, naming the placement qaccel reads, instead of getting a wrong node rank."""
    proc = _mpirun(
        hosts, tmp_path, "-x", f"MASTER_ADDR={hosts['addrs'][0]}", "-x", "MASTER_PORT=29500", timeout=30, slots=(2, 1)
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ValueError: mpirun placed rank" in proc.stderr and "--map-by slot" in proc.stderr, proc.stderr


def _launcher_ranks_on_both(hosts: dict, tmp_path: Path, variables: list[dict[str, str]]) -> list[dict]:
    """report_ranks.py once per host, with exactly the variables a launcher gives that host's process (no torchrun,
    no mpirun): their RESULTs, by rank."""
    envs = []
    for given in variables:
        env = script_env()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)
        envs.append({**env, **given})
    cmd = [sys.executable, str(script_file("report_ranks.py")), "launcher"]
    results = _on_both(hosts, tmp_path, [cmd, cmd], envs, timeout=60, what="a rank")
    for code, out, err in results:
        assert code == 0, out + err
    return sorted((r for _, out, _ in results for r in report_results(out)), key=lambda r: r["rank"])


def test_pytorchjob_pods_on_two_hosts_are_one_world(hosts, tmp_path):
    """A Kubernetes PyTorchJob's pods get RANK, WORLD_SIZE, MASTER_ADDR (the master pod's name) and MASTER_PORT
    only: one process per host, one world of 2, each its node's rank 0."""
    pods = [{"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": HOSTS[0], "MASTER_PORT": "23456"} for rank in (0, 1)]
    results = _launcher_ranks_on_both(hosts, tmp_path, pods)
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["host"]) for r in results] == [
        (0, 0, 0, 2, 1, HOSTS[0]),
        (1, 0, 1, 2, 1, HOSTS[1]),
    ]


def test_jsrun_ranks_on_two_hosts_rendezvous_on_the_first_compute_host(hosts, tmp_path):
    """LSF's jsrun gives JSM_NAMESPACE_* and the job's LSB_* variables: rank 0's host is the first compute host
    of LSB_MCPU_HOSTS (after the launch node) and the port comes from LSB_JOBID."""
    job = {
        "JSM_NAMESPACE_SIZE": "2",
        "JSM_NAMESPACE_LOCAL_RANK": "0",
        "JSM_NAMESPACE_LOCAL_SIZE": "1",
        "LSB_JOBID": "4711",
        "LSB_MCPU_HOSTS": f"batch1 1 {HOSTS[0]} 1 {HOSTS[1]} 1",
    }
    results = _launcher_ranks_on_both(hosts, tmp_path, [{**job, "JSM_NAMESPACE_RANK": str(r)} for r in (0, 1)])
    assert [(r["rank"], r["node"], r["world"], r["sum"], r["host"]) for r in results] == [
        (0, 0, 2, 1, HOSTS[0]),
        (1, 1, 2, 1, HOSTS[1]),
    ]
