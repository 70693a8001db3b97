"""Objects to register for checkpointing: a counter, and objects whose state cannot be written (a save that fails
while it writes files)."""

from __future__ import annotations


class Counter:
    """A registered object with a number for its state."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Unwritable:
    """Copied aside like any state (a background save's copy), but its pickling fails: in torch.save, that is while
    the checkpoint's files are written."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __deepcopy__(self, memo):
        return Unwritable(self.message)

    def __reduce__(self):
        raise OSError(self.message)


class FailsWhenTold:
    """A registered object whose state cannot be written once ``fail`` is set."""

    def __init__(self, message: str) -> None:
        self.message, self.fail = message, False

    def state_dict(self):
        return {"payload": Unwritable(self.message)} if self.fail else {}

    def load_state_dict(self, state):
        pass
