"""A rank started by qaccel looks like a torchrun worker to what it starts: DataLoader workers and pools are forked
from it (so classes defined in the script reach them), it leads its own process group, and whatever it started
dies with it however the rank is stopped (when its caller is stopped: tests/launch/test_caller_stops.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.procs import STUCK_WORKERS, run_script, script_env, stuck_ranks_and_workers, wait_dead, write_script

pytestmark = pytest.mark.timeout(180)


def test_dataset_and_pool_functions_defined_in_the_script_reach_the_ranks_children(tmp_path):
    script = write_script(tmp_path, """
        import json, multiprocessing, os, signal
        import torch
        from torch.utils.data import DataLoader, Dataset
        from qaccel import Accelerator

        class Squares(Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                return torch.tensor(i * i), os.getppid()

        def cube(n):
            return n ** 3

        def work(acc):
            loader = acc.prepare(DataLoader(Squares(), batch_size=4, num_workers=2))
            seen, parents = [], set()
            for values, ppids in loader:
                seen += values.tolist()
                parents.update(ppids.tolist())
            with multiprocessing.Pool(2) as pool:
                cubes = pool.map(cube, range(4))
            with multiprocessing.get_context("spawn").Pool(1) as pool:  # imports the script, as under torchrun
                cubes += pool.map(cube, [4])
            return {"seen": seen, "workers_parent_is_rank": parents == {os.getpid()}, "cubes": cubes,
                    "start_method": multiprocessing.get_start_method(),
                    "group_leader": os.getpgid(0) == os.getpid() == os.getsid(0),
                    "ctrl_c_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler}

        if __name__ == "__main__":
            acc = Accelerator(nprocs=2, compute_setup="cpu")
            print("OUT", json.dumps(acc.distribute(work, all_results=True)(acc)), flush=True)
    """)
    proc = run_script(script)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.split("OUT ", 1)[1])
    assert sorted(out[0]["seen"] + out[1]["seen"]) == [i * i for i in range(16)]
    for rank in out:
        assert rank["workers_parent_is_rank"] and rank["group_leader"] and rank["ctrl_c_raises"], rank
        assert (rank["cubes"], rank["start_method"]) == ([0, 1, 8, 27, 64], "fork")


def test_dataloader_workers_die_with_their_rank_when_another_rank_fails(tmp_path):
    """Stopped by its caller (Ctrl-C, SIGKILL), the same ranks and workers: tests/launch/test_caller_stops.py."""
    script = write_script(tmp_path, STUCK_WORKERS)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path), "fail"], env=script_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks, workers = stuck_ranks_and_workers(tmp_path)
        _, err = caller.communicate(timeout=30)
        assert caller.returncode != 0
        assert "rank 1 fails while every rank's workers are busy" in err
        assert wait_dead(ranks + workers, timeout=10) == [], "left running after another rank failed"
    finally:
        caller.kill()
        caller.wait()


def test_pools_opened_and_closed_in_a_rank_never_hang(tmp_path):
    """Pool.__exit__ stops its workers with SIGTERM and waits for them: a worker still starting when the pool
    closes must die of it (a Python-level SIGTERM handler inherited from the rank made it miss the signal)."""
    script = write_script(tmp_path, """
        import multiprocessing
        from qaccel import Accelerator

        def cube(n):
            return n ** 3

        def work():
            for _ in range(40):
                with multiprocessing.Pool(2) as pool:
                    assert pool.map(cube, range(4)) == [0, 1, 8, 27]
            return "closed"

        if __name__ == "__main__":
            print(Accelerator(nprocs=2, compute_setup="cpu").distribute(work, all_results=True)(), flush=True)
    """)
    proc = run_script(script, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['closed', 'closed']"
