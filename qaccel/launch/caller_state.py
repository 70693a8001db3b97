"""What libraries remember about the process they ran in, made in the caller and sent to its ranks.

Accelerate keeps one ``PartialState`` per process (a shared dict, its world, its device) and transformers'
``TrainingArguments`` computes that setup once and caches it in the object. Made in a plain launch's caller, both
describe one process; unpickled in a rank they would make each rank train alone on all the data, silently. So:

- a ``TrainingArguments`` travels without its cached setup and computes it again when the rank unpickles it,
  inside its session, where the group exists: the Trainer then trains on all ranks, as under torchrun;
- an Accelerate ``PartialState`` or ``AcceleratorState`` (an Accelerate ``Accelerator`` or a transformers
  ``Trainer`` holds one) cannot be made again from what it holds: sending one fails in the caller, before any rank
  starts, with what to do (Accelerate's ``notebook_launcher`` refuses a caller with a state too);
- a rank forgets the state it inherited from the caller by fork, so that one made in fn is the rank's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

TRAINING_ARGUMENTS = ("transformers.training_args", "TrainingArguments")
STATES = (("accelerate.state", "PartialState"), ("accelerate.state", "AcceleratorState"))
PER_PROCESS = frozenset({"_setup_devices", "distributed_state", "_n_gpu"})
"""What TrainingArguments caches about the process it was set up in (``_setup_devices`` is a cached_property)."""


class MadeInCaller(TypeError):
    """An object that describes the caller's process was about to be sent to the ranks."""


def reducer() -> Callable[[Any], Any] | None:
    """A ``reducer_override`` step for the pickler that sends a call to the ranks (NotImplemented: not ours), or
    None when neither library is imported (nothing can hold their state)."""
    arguments = _loaded(*TRAINING_ARGUMENTS)
    states = tuple(cls for cls in (_loaded(*where) for where in STATES) if cls is not None)
    if arguments is None and not states:
        return None

    def reduce(obj: Any) -> Any:
        if arguments is not None and isinstance(obj, arguments):
            return _made_again, (type(obj), {k: v for k, v in vars(obj).items() if k not in PER_PROCESS})
        if states and isinstance(obj, states):
            raise MadeInCaller(
                f"an Accelerate {type(obj).__name__} made in the caller (an accelerate Accelerator or a transformers "
                "Trainer holds one) describes the caller's single process, not a rank: make the Accelerator, "
                "PartialState or Trainer inside the function you distribute, as Accelerate's notebook_launcher "
                "requires (TrainingArguments may stay outside: each rank sets it up again)"
            )
        return NotImplemented

    return reduce


def _made_again(cls: type[object], fields: dict[str, Any]) -> Any:
    """The TrainingArguments, its setup (device, world, rank) computed again here: a rank unpickles its call inside
    its session, so Accelerate finds the session's group."""
    import torch.distributed as dist

    obj: Any = cls.__new__(cls)
    vars(obj).update(fields, distributed_state=None)
    if dist.is_available() and dist.is_initialized():
        obj.device  # noqa: B018 - a cached_property: the setup runs once, here
    return obj


def forget_inherited() -> None:
    """In a rank: drop the Accelerate state a fork copied from the caller (a new PartialState is then the rank's)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _loaded(module: str, name: str) -> type | None:
    """The class, if its library is imported already (this module never imports one)."""
    return getattr(sys.modules.get(module), name, None)
