"""Accelerator(rank_prefix=True): every line the ranks of a plain launch write comes out as ``[rank N] line``, whole,
whoever wrote it (print, os.write, a subprocess, a DataLoader worker), also from a rank that fails or is killed.
The caller writes the prefixed lines to its own fds 1 and 2, so capfd sees them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings

import pytest
import torch
from support.procs import wait_dead
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator, RankKilledError

pytestmark = [
    pytest.mark.timeout(120),
    # Under capfd, torch's loggers hold pytest's earlier sys.stderr, which cannot travel to the ranks; they keep their own.
    pytest.mark.filterwarnings("ignore:qaccel. the StreamHandler of logger"),
]

LINES = 200  # per rank, long ones: the two ranks' lines interleave in the caller


@pytest.fixture(scope="module")
def prefixed():
    return Accelerator(nprocs=2, compute_setup="cpu", rank_prefix=True, timeout=60)


class Announcing(Dataset):
    """Each item is loaded by a DataLoader worker, which says so on its stdout (inherited from its rank)."""

    def __init__(self, rank):
        self.rank = rank

    def __len__(self):
        return 2

    def __getitem__(self, i):
        print(f"item {i} from a DataLoader worker of rank {self.rank}")
        return torch.tensor(i)


def _write_every_way(acc):
    r = acc.rank
    for i in range(LINES):
        print(f"line {i} of rank {r} " + "x" * 1000)
    print(f"on stderr from rank {r}", file=sys.stderr)
    os.write(1, f"os.write from rank {r}\n".encode())
    subprocess.run(["echo", f"from a subprocess of rank {r}"], check=True)
    for _ in acc.prepare(DataLoader(Announcing(r), batch_size=1, num_workers=1)):
        pass
    os.write(1, b"one\rtwo\rthree\n")  # a progress bar's redraws
    os.write(1, f"unfinished line of rank {r}".encode())


def test_every_kind_of_output_comes_out_prefixed_and_whole(prefixed, capfd):
    prefixed.distribute(_write_every_way)(prefixed)
    out, err = capfd.readouterr()
    segments = [s for s in re.split(r"\r|\n", out) if s]
    assert all(re.match(r"\[rank [01]\] ", s) for s in segments), [s for s in segments if not s.startswith("[rank")]
    for r in (0, 1):
        long_lines = [s for s in segments if s.startswith(f"[rank {r}] line ")]
        assert long_lines == [f"[rank {r}] line {i} of rank {r} " + "x" * 1000 for i in range(LINES)]
        for line in (
            f"os.write from rank {r}",
            f"from a subprocess of rank {r}",
            f"item {r} from a DataLoader worker of rank {r}",
            f"unfinished line of rank {r}",
        ):
            assert f"[rank {r}] {line}\n" in out
        assert f"[rank {r}] one\r[rank {r}] two\r[rank {r}] three\n" in out
        assert f"[rank {r}] on stderr from rank {r}\n" in err and "on stderr" not in out


def _fail_on_rank_1(acc):
    print(f"rank {acc.rank} is up")
    acc.wait_for_everyone()
    if acc.rank == 1:
        try:
            raise ValueError("bad batch 17")
        except ValueError:
            traceback.print_exc()  # as logging.exception would
        sys.stdout.write("half a line, still in the buffer")  # flushed before the rank reports
        raise ValueError("rank 1 fails")
    acc.wait_for_everyone()  # rank 0 waits here until the caller stops it


def test_a_failing_ranks_lines_are_prefixed_and_its_error_raised(prefixed, capfd):
    with pytest.raises(ValueError, match="rank 1 fails") as info:
        prefixed.distribute(_fail_on_rank_1)(prefixed)
    assert any("rank 1 of 2" in note for note in info.value.__notes__)
    out, err = capfd.readouterr()
    assert "[rank 0] rank 0 is up\n" in out and "[rank 1] rank 1 is up\n" in out
    assert "[rank 1] half a line, still in the buffer\n" in out
    traceback_lines = [line for line in err.splitlines() if line.startswith("[rank 1] ")]
    assert traceback_lines[0] == "[rank 1] Traceback (most recent call last):", err
    assert traceback_lines[-1] == "[rank 1] ValueError: bad batch 17", err
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in err.splitlines()), err


def test_a_rank_killed_mid_line_and_an_escaped_child_holding_a_pipe_do_not_hang_the_caller(prefixed, capfd, tmp_path):
    def killed(acc):
        if acc.rank == 0:  # a child in a session of its own: stopping rank 0's process group misses it
            escaped = subprocess.Popen(["sleep", "60"], start_new_session=True)
            (tmp_path / "escaped").write_text(str(escaped.pid))
        acc.wait_for_everyone()
        if acc.rank == 1:
            os.write(1, b"cut off in the middle of a li")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    start = time.monotonic()
    try:
        with pytest.raises(RankKilledError, match="rank 1 was killed by signal SIGKILL"):
            prefixed.distribute(killed)(prefixed)
        assert time.monotonic() - start < 15
    finally:
        escaped_pid = int((tmp_path / "escaped").read_text())
        os.kill(escaped_pid, signal.SIGKILL)
        assert wait_dead([escaped_pid]) == []
    assert "[rank 1] cut off in the middle of a li\n" in capfd.readouterr().out


def _where_fds_1_and_2_lead(acc):
    """(device, inode) of this rank's fds 1 and 2, and of its parent's (the forkserver, whose fds it inherited)."""
    own = [os.fstat(fd) for fd in (1, 2)]
    parents = [os.stat(f"/proc/{os.getppid()}/fd/{fd}") for fd in (1, 2)]
    return [(s.st_dev, s.st_ino) for s in own], [(s.st_dev, s.st_ino) for s in parents]


def test_off_by_default_nothing_is_put_between_a_rank_and_its_output(acc, prefixed):
    """Without rank_prefix a rank writes to the fds it inherited, as before; with it, to the caller's pipes."""
    for own, parents in acc.distribute(_where_fds_1_and_2_lead, all_results=True)(acc):
        assert own == parents
    for own, parents in prefixed.distribute(_where_fds_1_and_2_lead, all_results=True)(prefixed):
        assert own[0] != parents[0] and own[1] != parents[1] and own[0] != own[1]


def _say(acc):
    print(f"spawned rank {acc.rank} says hello")
    print(f"spawned rank {acc.rank} on stderr", file=sys.stderr)


def test_ranks_started_with_spawn_are_prefixed_too(capfd):
    spawned = Accelerator(nprocs=2, compute_setup="cpu", rank_prefix=True, start_method="spawn", timeout=60)
    spawned.distribute(_say)(spawned)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] spawned rank 0 says hello", "[rank 1] spawned rank 1 says hello"]
    assert sorted(line for line in err.splitlines() if "spawned" in line) == [
        "[rank 0] spawned rank 0 on stderr",
        "[rank 1] spawned rank 1 on stderr",
    ]


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_under_torchrun_or_srun_it_warns_on_rank_0_and_names_their_options(monkeypatch, launcher):
    for rank in (0, 1):
        if launcher == "torchrun":
            variables = {
                "TORCHELASTIC_RUN_ID": "x",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0",
            }
        else:
            variables = {
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_NODES": "1",
                "SLURM_NNODES": "1",
                "SLURM_STEP_TASKS_PER_NODE": "2",
                "SLURM_TASKS_PER_NODE": "2",
                "SLURM_NODELIST": "localhost",
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_JOB_ID": "4242",
            }
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = Accelerator(nprocs=2, compute_setup="cpu", rank_prefix=True)
        assert acc.rank == rank
        messages = [str(w.message) for w in caught if "rank_prefix" in str(w.message)]
        if rank == 0:
            assert messages == [
                (
                    f"Accelerator(rank_prefix=True) prefixes the output of a plain launch only; under {launcher} ask the "
                    "launcher: torchrun --tee 3 with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}] ' in its "
                    "environment, or srun --label"
                )
            ]
        else:
            assert messages == []
