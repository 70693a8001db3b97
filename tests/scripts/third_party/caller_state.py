"""Accelerate state made in a plain launch's caller. Prints ``RESULT {...}``.

Usage: caller_state.py MODE
- ``named``: fn uses a PartialState made at the top level: the launch must fail before any rank starts;
- ``trainer``: a transformers Trainer made at the top level is passed to fn: the same;
- ``inherited``: a PartialState made at the top level and not used by fn; the caller ran no torch op, so its ranks
  are forked with Accelerate's state in memory: an Accelerate Accelerator made in fn must see the rank's world."""

import json
import os
import sys
import time

import torch
from accelerate import Accelerator as AccelerateAccelerator
from accelerate import PartialState

from qaccel import Accelerator

MODE = sys.argv[1]
STATE = PartialState(cpu=True)


def uses_state():
    return STATE.num_processes


def uses_trainer(trainer):
    return trainer.args.world_size


def makes_its_own():
    accelerator = AccelerateAccelerator(cpu=True)
    return {"world": accelerator.num_processes, "rank": accelerator.process_index, "pid": os.getpid()}


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    call = (uses_state,) if MODE == "named" else (makes_its_own,)
    if MODE == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[])
        call = (uses_trainer, Trainer(model=torch.nn.Linear(1, 1), args=args))
    started = time.monotonic()
    try:
        result = acc.distribute(call[0], all_results=True)(*call[1:])
    except TypeError as exc:
        result = {"error": str(exc), "seconds": time.monotonic() - started}
    os.write(1, f"RESULT {json.dumps({'result': result, 'caller_world': STATE.num_processes})}\n".encode())
