"""An Accelerate-style script (the Accelerator used outside distribute()) whose rank 1 raises after prepare():
under torchrun the job must end with that error, never wait for the rank that left. Run by
tests/test_accelerate_scripts.py."""

import logging

import torch

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO)

accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(2, 1))
if accelerator.process_index == 1:
    raise ValueError("failing on purpose on rank 1")
accelerator.wait_for_everyone()  # rank 0 waits here for a rank that never comes
