"""A Trainer script as a user writes one: logging set up at the top, a Dataset class of its own, DataLoader workers,
TensorBoard tracking (every epoch, and every batch's loss) and a checkpoint every epoch. Prints the trained
parameters' hash on stdout as ``RESULT {"hash": ...}`` (rank 0 under torchrun), and ``epoch N done`` on stderr as
each epoch ends.

Arguments: LOG_FOLDER EPOCHS [STEP_SLEEP [FAIL_AT]]: the run's folder (``root=DIR``: qadence's default, a new
subfolder of DIR per run), the epochs, seconds slept per training batch (so that a signal lands mid-run), and a
training batch at which rank 1 raises in the first attempt (to be restarted). TRACKING in the environment picks the
tracking tool (default: tensorboard); EPOCH_END_S makes the train_epoch_end callback take that many seconds;
BATCH_LOG names a file where rank 0 notes each batch it trains: the run's start (restarts and SLURM requeues so far)
and the batch's number in the fit."""

import hashlib
import json
import logging
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import TrainConfig, Trainer
from qaccel.callbacks import Callback, WriteMetrics

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
log = logging.getLogger("trainer_run")


class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) * 0.5 + 0.1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def slow(trainer, config, tracker):
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    if os.environ.get("BATCH_LOG") and trainer.accelerator.is_main_process:  # what this run trained itself
        start = trainer.accelerator.restart_count + int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        with open(os.environ["BATCH_LOG"], "a") as log:
            log.write(f"{start} {trainer.global_step}\n")
    first_attempt = trainer.accelerator.restart_count == 0
    if (
        len(sys.argv) > 4
        and first_attempt
        and trainer.accelerator.rank == 1
        and trainer.global_step == int(sys.argv[4])
    ):
        raise RuntimeError(f"failing on purpose at batch {trainer.global_step}")


def epoch_done(trainer, config, tracker):
    if trainer.accelerator.is_main_process:
        print(f"epoch {trainer.opt_result.iteration} done", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("EPOCH_END_S", "0")))  # a slow callback (plots, say)


if __name__ == "__main__":
    folder, epochs = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    where = {"root_folder": folder[5:]} if folder.startswith("root=") else {"log_folder": folder}
    config = TrainConfig(
        nprocs=2,
        max_iter=epochs,
        compute_setup="cpu",
        **where,
        checkpoint_every=1,
        write_every=1,
        val_every=1,
        tracking_tool=os.environ.get("TRACKING", "tensorboard"),
        verbose=False,
        seed=3,
        callbacks=[
            Callback("train_batch_end", 1, slow),
            Callback("train_epoch_end", 1, epoch_done),
            WriteMetrics("train_batch_end", 1),
        ],
    )
    train = DataLoader(Points(96), batch_size=8, shuffle=True, num_workers=2)
    val = DataLoader(Points(32), batch_size=8, num_workers=2)
    trainer = Trainer(model, optimizer, config, "mse", train, val, lr_scheduler=scheduler)
    model, optimizer = trainer.fit()
    log.info("trained %d epochs into %s", epochs, trainer.log_folder)
    if trainer.accelerator.is_main_process:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print("RESULT " + json.dumps({"hash": digest, "lr": optimizer.param_groups[0]["lr"]}), flush=True)
