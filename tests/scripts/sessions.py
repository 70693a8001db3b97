"""Two sessions in one process, the second loading the first one's checkpoint; run by the tests under torchrun and
as srun tasks, and imported by them for nprocs=1."""

import json
import os
import sys

import torch

from qaccel import Accelerator


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def session(acc, ckpt, load):
    """Prepare and register one of each, optionally load the last session's checkpoint, take one micro-step."""
    model = torch.nn.Linear(2, 1)
    model, _optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    if load:
        acc.load_state(ckpt)  # a registration left from the first session would fail its count check
    with acc.accumulate(model):
        first_step_syncs = acc.sync_gradients
    counter.n += 1
    acc.save_state(ckpt)
    return {"first_step_syncs": first_step_syncs, "counter": counter.n}


if __name__ == "__main__":
    acc = Accelerator(compute_setup="cpu", gradient_accumulation_steps=2, timeout=60)
    ckpt = os.path.join(sys.argv[1], "ckpt")
    first = acc.distribute(session)(acc, ckpt, False)
    second = acc.distribute(session)(acc, ckpt, True)
    os.write(1, ("RESULT " + json.dumps({"rank": acc.rank, "first": first, "second": second}) + "\n").encode())
