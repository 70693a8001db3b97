"""distribute() and submit() onto SLURM through cluster=: run from a login node (here the local SLURM of the tests),
each SLURM task is a rank; results, a rank's exception and Ctrl-C come back to this process.

    python cluster_job.py MODE FOLDER [CKPT]    # MODE: results | raises | dies | sleeps | train | train-here | trainer
                                                # | gpu | gpu-per-task, or several joined by "+"

Several modes run one after another, each with its jobs in FOLDER/MODE (and CKPT/MODE); each starts with a line ``CALL MODE`` on
stdout and on stderr, and an exception of one (but Ctrl-C's) is printed as Python prints an uncaught one, followed
by ``RAISED MODE`` on stdout, before the next mode runs; the script then exits with 1.

``gpu`` asks for 2 GPUs per node from this GPU-less machine, with the default compute_setup="auto";
``gpu-per-task`` one GPU bound to each task (the CPU computes: this machine's torch sees none), each rank's shown.
``train`` trains 3 epochs with resume(CKPT) and a checkpoint per epoch on the cluster (``train-here``: the same as a
plain local launch), printing the parameters' hash.
"""

import hashlib
import json
import logging
import os
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator, SlurmCluster, TrainConfig, Trainer

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def report(acc, tag):
    """Every rank: where it ran, and an all-reduce across the nodes."""
    total = acc.all_reduce_dict({"ranks": float(acc.rank + 1)}, op="sum")["ranks"]
    print(f"rank {acc.rank} on {os.environ.get('SLURMD_NODENAME')} says hello", flush=True)
    return {
        "rank": acc.rank,
        "world": acc.world_size,
        "node": os.environ.get("SLURMD_NODENAME"),
        "sum": total,
        "tag": tag,
        "torch": torch.__version__,
    }


def raises(acc):
    if acc.rank == 1:
        raise ValueError(f"rank 1 fails on purpose on {os.environ.get('SLURMD_NODENAME')}")
    acc.wait_for_everyone()


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.tensor([i / 64.0, (i % 7) / 7.0])
        return x, (x**2).sum(dim=0, keepdim=True)


def train(acc, ckpt, pause=0.2):
    """3 epochs with resume() and a checkpoint per epoch; a first run pauses ``pause`` s a step, for a signal to
    land mid-run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if acc.resume(ckpt) is not None:
        pause = 0
    for epoch in range(loader.epoch, 3):
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(pause)
        print(f"rank {acc.rank} epoch {epoch} done", flush=True)
        acc.save_state()
    weights = acc.unwrap_model(model).state_dict()
    return hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values())).hexdigest()


def dies(acc):
    if acc.rank == 1:
        os._exit(3)
    acc.wait_for_everyone()


def fit(where, folder):
    """A Trainer fit of 2 epochs (0 and 1) on 2 ranks (here, or on the cluster); its parameters' hash and epochs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = TrainConfig(
        nprocs=2,
        compute_setup="cpu",
        max_iter=1,
        log_folder=f"{folder}/{where}",
        verbose=False,
        cluster=SlurmCluster(nodes=2, time="00:10:00", cpus_per_task=1, folder=f"{folder}/jobs")
        if where == "cluster"
        else None,
    )
    trainer = Trainer(model, optimizer, config, "mse", DataLoader(Squares(), batch_size=8))
    model, _ = trainer.fit()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"hash": digest, "epochs": len(trainer.history)}


def visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def sleeps(acc):
    print(f"rank {acc.rank} pid {os.getpid()} sleeping", flush=True)
    time.sleep(300)


def call(mode, folder, ckpt):
    acc = Accelerator(
        nprocs=2,
        compute_setup="cpu",
        timeout=60,
        cluster=SlurmCluster(nodes=2, tasks_per_node=1, time="00:10:00", cpus_per_task=1, folder=folder),
    )
    if mode == "results":  # then a lambda, submitted, with every rank's output shown
        print("RESULT " + json.dumps(acc.distribute(report, all_results=True)(acc, "all")), flush=True)
        every = Accelerator(
            nprocs=2,
            compute_setup="cpu",
            timeout=60,
            cluster=SlurmCluster(nodes=2, time="00:10:00", cpus_per_task=1, folder=folder, output="all"),
        )
        job = every.submit(lambda a: report(a, "lambda"), every)
        print(f"JOB {job.job_id} {job.state}", flush=True)
        print("RESULT " + json.dumps(job.results()), flush=True)
        print(f"LOGGED {'rank 1 on n2 says hello' in job.logs(rank=1)} {job.state}", flush=True)
    elif mode == "raises":
        acc.distribute(raises)(acc)
    elif mode == "trainer":
        print("RESULT " + json.dumps([fit("here", folder), fit("cluster", folder)]), flush=True)
    elif mode == "dies":
        acc.distribute(dies)(acc)
    elif mode == "sleeps":
        acc.distribute(sleeps)(acc)
    elif mode == "gpu":  # decided on the node, whose torch sees none of the GPUs SLURM gives it
        gpu = Accelerator(
            nprocs=2,
            timeout=60,
            cluster=SlurmCluster(nodes=1, tasks_per_node=2, gpus_per_node=2, time="00:10:00", folder=folder),
        )
        print(f"STATE {gpu.state.device} / {gpu.state.backend}", flush=True)
        gpu.distribute(report)(gpu, "gpu")
    elif mode == "gpu-per-task":
        bound = Accelerator(
            nprocs=2,
            compute_setup="cpu",
            timeout=60,
            cluster=SlurmCluster(
                nodes=1, tasks_per_node=2, gpus_per_node=2, sbatch={"gpus-per-task": 1}, time="00:10:00", folder=folder
            ),
        )
        print("RESULT " + json.dumps(bound.distribute(visible, all_results=True)()), flush=True)
    elif mode == "train":
        print("RESULT " + json.dumps(acc.distribute(train)(acc, ckpt)), flush=True)
    elif mode == "train-here":
        here = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
        print("RESULT " + json.dumps(here.distribute(train)(here, ckpt, 0)), flush=True)


if __name__ == "__main__":
    modes, folder, ckpt = sys.argv[1].split("+"), sys.argv[2], (sys.argv[3:] or [None])[0]
    if len(modes) == 1:
        call(modes[0], folder, ckpt)
        sys.exit(0)
    raised = False
    for mode in modes:
        print(f"CALL {mode}", flush=True)
        print(f"CALL {mode}", file=sys.stderr, flush=True)
        try:
            call(mode, os.path.join(folder, mode), ckpt and os.path.join(ckpt, mode))
        except Exception:  # noqa: BLE001 - printed as uncaught, and the next mode runs
            traceback.print_exc()
            sys.stderr.flush()
            print(f"RAISED {mode}", flush=True)
            raised = True
    sys.exit(1 if raised else 0)
