"""A script written for Accelerate's trackers, import changed only, run under torchrun: TensorBoard and W&B started
before load_state() (Accelerate's order), a value logged per step, a checkpoint every 2 steps. With a kill step as
argv[2], rank 0 kills itself (SIGKILL) after logging that step; run again, the job continues from its newest
checkpoint and its runs."""

import os
import signal
import sys

import torch

from qaccel import Accelerator
from qaccel.utils import ProjectConfiguration

folder, kill_at = sys.argv[1], int(sys.argv[2])
accelerator = Accelerator(
    cpu=True, log_with=["tensorboard", "wandb"], project_config=ProjectConfiguration(project_dir=folder)
)
accelerator.init_trackers("job", config={"lr": 0.1}, init_kwargs={"wandb": {"tags": ["torchrun"]}})
model = torch.nn.Linear(2, 1)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
checkpoints = os.path.join(folder, "checkpoints")
if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    accelerator.load_state(checkpoints)
for step in range(accelerator.step, 6):
    optimizer.zero_grad()
    accelerator.backward(model(torch.ones(4, 2)).sum())
    optimizer.step()
    accelerator.log({"loss": 100.0 * (kill_at >= 0) + step}, step=step)
    if step % 2 == 1:
        accelerator.save_state()
    if step == kill_at and accelerator.is_main_process:
        os.kill(os.getpid(), signal.SIGKILL)
if accelerator.is_main_process:
    print("RESULT", '{{"wandb_id": "{}"}}'.format(accelerator.get_tracker("wandb", unwrap=True).id), flush=True)
accelerator.end_training()
