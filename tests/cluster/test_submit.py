"""distribute() onto the local two-node SLURM with cluster= (through submitit), from a plain script, a Trainer and a
real Jupyter kernel: every rank's result with an all-reduce across the nodes; a rank's own exception with its rank,
node and traceback; a rank dying without a result; submit()'s handle; Ctrl-C cancelling the job within seconds,
nothing left; a USR1 warning that requeues the job, whose caller still gets the result of an uninterrupted run.

One run of cluster_job.py, shared by the tests of what it ran, makes its calls one after another, each a job of its
own (a caller's exception is printed as Python prints an uncaught one, and the next call goes on), and ends with a
job that sleeps until the run gets Ctrl-C; the run that is requeued is a script run of its own, after the plain
launch it is compared with."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from support import component
from support.procs import once_per_session, result_lines, script_file, slurm_env, wait_for, wait_for_text

from qaccel import Accelerator, SlurmCluster

pytestmark = pytest.mark.timeout(240)
SCRIPT = script_file("cluster_job.py")
# what the shared run calls, in this order; "gpu" only where this machine's torch sees no GPU (see its test)
CALLS = ("results", "trainer", "gpu-per-task", "dies", "gpu", "raises", "sleeps")


def _interrupted_run(slurm_cluster, tmp_path_factory) -> dict:
    """cluster_job.py making CALLS, Ctrl-C once the last one's job sleeps: each call's stdout, stderr and whether it
    raised; how long the Ctrl-C took, the exit status, what the queue and the ranks left."""
    calls = [call for call in CALLS if call != "gpu" or torch.cuda.device_count() == 0]
    tmp_path = tmp_path_factory.mktemp("cluster-job")
    folder = tmp_path / "jobs"
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "+".join(calls), str(folder)],
            env=slurm_env(slurm_cluster),
            cwd=tmp_path,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        wait_for_text(out, "rank 0 pid", timeout=400, proc=proc)
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
    left = subprocess.run(  # this run's ranks only: another test's job may be running on the other worker's cluster
        ["pgrep", "-f", f"submitit.core._submit {folder}/"], capture_output=True, text=True, check=False
    ).stdout
    run = {
        "returncode": proc.returncode,
        "took": took,
        "queue": slurm_cluster.run(["squeue", "-h"]).stdout.strip(),
        "left": left,
        "calls": {},
    }
    stdouts, stderrs = (text.split("\nCALL ") for text in ("\n" + out.read_text(), "\n" + err.read_text()))
    for call_out, call_err in zip(stdouts[1:], stderrs[1:], strict=True):
        call, stdout_text = call_out.split("\n", 1)
        stderr_text = call_err.split("\n", 1)[1]
        submissions = sorted((folder / call).rglob("*_submission.sh"))
        run["calls"][call] = {
            "stdout": stdout_text,
            "stderr": stderr_text,
            "raised": f"RAISED {call}" in stdout_text.splitlines(),
            "submitted": [path.read_text() for path in submissions],
        }
    assert list(run["calls"]) == calls, (out.read_text(), err.read_text())
    return run


@pytest.fixture(scope="module")
def interrupted_run(slurm_cluster, tmp_path_factory) -> dict:
    return once_per_session(
        tmp_path_factory, "cluster-job-calls", lambda: _interrupted_run(slurm_cluster, tmp_path_factory)
    )


def _call(run: dict, name: str) -> dict:
    call = run["calls"][name]
    assert not call["raised"], call["stdout"] + call["stderr"]
    return call


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_distribute_on_two_nodes_returns_every_ranks_result_and_follows_the_job(interrupted_run):
    call = _call(interrupted_run, "results")
    stdout, stderr = call["stdout"], call["stderr"]
    every, submitted = result_lines(stdout)
    assert [(r["rank"], r["world"], r["node"], r["sum"]) for r in every] == [(0, 2, "n1", 3.0), (1, 2, "n2", 3.0)]
    assert "rank 0 on n1 says hello" in stdout, "rank 0's output came to the caller"
    # then submit() of a lambda, every rank's output shown with its rank
    assert [(r["rank"], r["tag"]) for r in submitted] == [(0, "lambda"), (1, "lambda")]
    assert "[rank 0] rank 0 on n1 says hello\n" in stdout and "[rank 1] rank 1 on n2 says hello\n" in stdout
    assert "LOGGED True COMPLETED" in stdout, "job.logs(rank=1) holds rank 1's output; job.state"
    job = next(line.split()[1] for line in stdout.splitlines() if line.startswith("JOB "))
    states = [line.split()[-1] for line in stderr.splitlines() if line.startswith(f"qaccel: job {job} ")]
    assert states[-2:] == ["RUNNING", "COMPLETED"], stderr


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_a_failing_rank_raises_its_own_exception_with_rank_node_and_traceback(interrupted_run):
    call = interrupted_run["calls"]["raises"]
    stderr = call["stderr"]
    assert call["raised"]
    assert (
        "ValueError: rank 1 fails on purpose on n2\n[qaccel] raised on rank 1 of 2 (remote traceback above)" in stderr
    ), stderr
    remote = stderr[stderr.index("Traceback from rank 1:") :]
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "rank 1 fails on purpose" in text)
    assert f'cluster_job.py", line {line}, in raises\n' in remote and 'raise ValueError(f"rank 1 fails' in remote, (
        "the remote traceback names the script's file and shows the raising line"
    )
    assert "[qaccel] rank 1 ran on node n2 in SLURM job " in stderr
    dead = interrupted_run["calls"]["dies"]
    assert dead["raised"]
    assert "RankError: rank 1 of SLURM job " in dead["stderr"] and "without a result in " in dead["stderr"], dead


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_ctrl_c_cancels_the_job_within_seconds_and_leaves_nothing_running(interrupted_run):
    """Every job of the run, the sleeping one cancelled by the Ctrl-C included, has left the queue, and none of
    their ranks runs."""
    text = interrupted_run["calls"]["sleeps"]["stderr"]
    assert interrupted_run["returncode"] == -signal.SIGINT and "KeyboardInterrupt" in text, text
    assert "cancelled" in text and interrupted_run["took"] < 15, (interrupted_run["took"], text)
    assert interrupted_run["queue"] == ""
    assert interrupted_run["left"] == "", f"ranks left running: {interrupted_run['left']}"


@pytest.mark.slurm
def test_a_usr1_warning_requeues_and_the_callers_one_wait_ends_with_the_uninterrupted_result(slurm_cluster, tmp_path):
    """The script first trains with a plain launch of 2 ranks, then as a job with the same training, signalled."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "train-here+train", str(tmp_path / "jobs"), str(tmp_path / "ck")],
            env=slurm_env(slurm_cluster),
            cwd=tmp_path,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        wait_for(
            lambda: "rank 0 epoch 0 done" in out.read_text().partition("\nCALL train\n")[2] or proc.poll() is not None,
            180,
            lambda: f"the job's first epoch:\n{out.read_text()}\n{err.read_text()}",
            interval=0.2,
        )
        assert proc.poll() is None, out.read_text() + err.read_text()
        job = err.read_text().split("submitted SLURM job ")[1].split()[0]
        assert slurm_cluster.run(["scancel", "--signal=USR1", job]).returncode == 0
        wait_for(
            lambda: (
                slurm_cluster.job_info(job).get("Restarts") == "1"
                and slurm_cluster.job_info(job).get("JobState") == "PENDING"
            ),
            60,
            lambda: f"the requeued job to be pending:\n{err.read_text()}",
            interval=0.2,
        )
        time.sleep(2)  # a start in the second of the previous one's kill fails (tests/launch/test_real_script.py)
        slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == 0, text
    assert "the SLURM job was requeued and will resume from it" in text and "qaccel: resumed checkpoint_" in text
    after = text.split(f"qaccel: job {job} requeued (restart 1)\n")[1]  # then it waits, and runs again
    assert f"qaccel: job {job} PENDING" in after and f"qaccel: job {job} RUNNING" in after, text
    [here, there] = result_lines(out.read_text())
    assert there == here, "bitwise the parameters of an uninterrupted run"


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_a_trainer_whose_config_names_a_cluster_fits_there_as_it_fits_here(interrupted_run):
    [(here, there)] = result_lines(_call(interrupted_run, "trainer")["stdout"])
    assert there == here and here["epochs"] == 2, (here, there)


@pytest.mark.slurm
def test_a_function_defined_in_a_jupyter_cell_runs_on_the_cluster(slurm_cluster, tmp_path):
    jupyter_client = component.module("jupyter_client")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=slurm_env(slurm_cluster), cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        cell = textwrap.dedent(f"""
            import json, os
            from qaccel import Accelerator, SlurmCluster
            acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, cluster=SlurmCluster(
                nodes=2, time="00:10:00", cpus_per_task=1, folder={str(tmp_path / "jobs")!r}))

            def where(acc, offset):
                total = acc.all_reduce_dict({{"x": float(acc.rank + offset)}}, op="sum")["x"]
                return acc.rank, acc.world_size, os.environ["SLURMD_NODENAME"], total

            print("RESULT " + json.dumps(acc.distribute(where, all_results=True)(acc, 10)))
            """)
        shown = []
        reply = client.execute_interactive(cell, timeout=180, output_hook=lambda msg: shown.append(msg))
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"].get("text", "") for m in shown if m["msg_type"] == "stream")
        [result] = result_lines(text)
        assert result == [[0, 2, "n1", 21.0], [1, 2, "n2", 21.0]], text
        assert "qaccel: job " in text and " COMPLETED" in text, "the job's states appear in the cell"
        # the kernel's interrupt (Ctrl-C, or the stop button) cancels a job the cell waits for
        sleeping = textwrap.dedent("""
            import time
            def sleeps(acc):
                print(f"rank {acc.rank} sleeping", flush=True)
                time.sleep(300)
            acc.distribute(sleeps)(acc)
            """)
        shown.clear()
        asked = []

        def interrupt_once_sleeping(msg):
            shown.append(msg)
            if not asked and "rank 0 sleeping" in msg["content"].get("text", ""):
                asked.append(time.monotonic())
                manager.interrupt_kernel()

        reply = client.execute_interactive(sleeping, timeout=180, output_hook=interrupt_once_sleeping)
        assert asked and reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        assert time.monotonic() - asked[0] < 15
        assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == "", "the job is gone"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_a_gpu_job_from_a_gpu_less_caller_is_submitted_and_fails_on_the_node_that_lacks_the_gpus(interrupted_run):
    """The local SLURM hands out two GPUs per node (GRES gpu, with CUDA_VISIBLE_DEVICES) that this machine's torch
    does not see: the caller submits with "auto" resolved nowhere, SLURM gets the request, the node refuses."""
    if torch.cuda.device_count() > 0:
        component.unavailable("checks a node whose torch sees none of the GPUs SLURM gave, and this machine has one")
    call = interrupted_run["calls"]["gpu"]
    stdout, stderr = call["stdout"], call["stderr"]
    assert "STATE decided on the nodes / decided on the nodes" in stdout, stdout + stderr
    assert call["raised"]
    [submitted] = call["submitted"]
    assert "#SBATCH --gpus-per-node=2\n" in submitted
    assert (
        "RuntimeError: node n1: the job asked for 2 GPU(s) per node (SlurmCluster(gpus_per_node=2)), but torch "
        "sees no GPU here (CUDA_VISIBLE_DEVICES=0,1; torch " in stderr
    ), stderr
    assert "built without CUDA (a CPU wheel)); install a CUDA build of torch on the nodes" in stderr
    assert re.search(r"\[qaccel\] rank [01] ran on node n1 in SLURM job ", stderr), "both ranks raised it"


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_a_cluster_job_with_gpus_per_task_gives_each_rank_its_own(interrupted_run):
    """docs/cluster.md's cluster= recipe for one GPU per task: SLURM binds a different GPU to each rank."""
    [visible] = result_lines(_call(interrupted_run, "gpu-per-task")["stdout"])
    assert visible == ["0", "1"]


def test_the_caller_of_a_gpu_job_leaves_the_device_to_the_nodes_and_checks_what_it_can():
    for setup in ("auto", "gpu"):
        acc = Accelerator(
            nprocs=2,
            compute_setup=setup,
            mixed_precision="fp16",
            cluster=SlurmCluster(tasks_per_node=2, gpus_per_node=2),
        )
        assert (acc.state.device, acc.state.backend, acc.mixed_precision) == ("decided on the nodes",) * 2 + ("fp16",)
        with pytest.raises(
            RuntimeError,
            match=r"Accelerator.device is decided on the nodes: this Accelerator's "
            r"ranks are the tasks of a SLURM job",
        ):
            _ = acc.device
        assert "device='decided on the nodes'" in repr(acc)
    assert Accelerator(nprocs=2, backend="nccl", cluster=SlurmCluster(tasks_per_node=2)).backend == "nccl"
    with pytest.raises(ValueError, match=r"backend must be one of 'gloo', 'nccl', 'mpi'; got 'ncl'"):
        Accelerator(nprocs=2, backend="ncl", cluster=SlurmCluster(tasks_per_node=2))
    with pytest.raises(ValueError, match=r"backend='nccl' needs GPU compute"):
        Accelerator(nprocs=2, compute_setup="cpu", backend="nccl", cluster=SlurmCluster(tasks_per_node=2))
    with pytest.raises(ValueError, match=r"compute_setup must be one of 'auto', 'cpu', 'gpu'; got 'cuda'"):
        Accelerator(nprocs=2, compute_setup="cuda", cluster=SlurmCluster(tasks_per_node=2))
    cpu = Accelerator(nprocs=2, compute_setup="cpu", cluster=SlurmCluster(tasks_per_node=2))
    assert (cpu.device, cpu.backend) == (torch.device("cpu"), "gloo"), "a CPU job is decided at once, as before"


def test_cluster_needs_as_many_ranks_as_tasks_and_valid_fields():
    with pytest.raises(ValueError, match=r"nprocs=4 but the cluster has nodes x tasks_per_node = 2 x 1 = 2 ranks"):
        Accelerator(nprocs=4, compute_setup="cpu", cluster=SlurmCluster(nodes=2))
    with pytest.raises(
        ValueError,
        match=r"SlurmCluster.time must be minutes > 0 or a SLURM time limit "
        r"\('HH:MM:SS', 'D-HH:MM:SS', ...\); got '2 hours'",
    ):
        SlurmCluster(time="2 hours")
    with pytest.raises(ValueError, match=r"SlurmCluster.nodes must be a positive int; got 0"):
        SlurmCluster(nodes=0)
    with pytest.raises(TypeError, match=r"cluster must be a qaccel.SlurmCluster or None; got dict"):
        Accelerator(nprocs=2, compute_setup="cpu", cluster={"nodes": 2})
    with pytest.raises(ValueError, match=r"submit\(\) needs Accelerator\(cluster=qaccel.SlurmCluster\(...\)\)"):
        Accelerator(compute_setup="cpu").submit(print)


def test_an_argument_that_cannot_be_pickled_is_named_before_any_job(tmp_path):
    acc = Accelerator(nprocs=2, compute_setup="cpu", cluster=SlurmCluster(nodes=2, folder=str(tmp_path / "jobs")))
    with pytest.raises(TypeError, match=r"<lambda>\): argument 0 \('lock'\), a lock, cannot be pickled to send it"):
        acc.submit(lambda lock: None, threading.Lock())
    assert not (tmp_path / "jobs").exists(), "nothing was submitted"


def test_without_submitit_cluster_says_what_to_install():
    code = (
        "import sys; sys.modules['submitit'] = None  # as if not installed\n"
        "from qaccel import Accelerator, SlurmCluster\n"
        "Accelerator(nprocs=2, compute_setup='cpu', cluster=SlurmCluster(nodes=2))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert (
        "ImportError: cluster= submits through submitit, which is not installed: pip install submitit (from "
        "qaccel's checkout: pip install -e '.[slurm]')" in proc.stderr
    ), proc.stderr


def test_minutes_reads_slurm_time_limits():
    from qaccel.options import minutes

    limits = ("02:00:00", "1-00:00:00", "00:00:30", "90", "90:30", "2-12", "1-02:30", 45)
    assert [minutes(t) for t in limits] == [120, 1440, 1, 90, 91, 3600, 1590, 45]
