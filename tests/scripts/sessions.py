"""Two sessions in one process, the second loading the first one's checkpoint: later_sessions.py runs them under
torchrun and srun, and the tests import them for nprocs=1."""

import torch


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
