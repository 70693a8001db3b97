"""Run Accelerate's examples (ported here, or the same files with Accelerate's import) one after another in the
same processes, each as its ``__main__`` block would: ``sys.argv`` set to the example's arguments, then ``main()``.

    torchrun --standalone --nproc-per-node 2 run.py PLAN            # main() on every torchrun worker
    python run.py PLAN --distribute                                # qaccel starts 2 ranks: distribute(...)
    python run.py PLAN --notebook                                  # qaccel.notebook_launcher(..., num_processes=2)

PLAN is a JSON list of ``{"file": ..., "args": [...], "env": {...}}``: the example's file, its command line and
variables set while it runs (the stand-ins' STANDINS_DEVICE_BATCH). Before each example the main process prints
``EXAMPLE <file stem>``; after it, every rank prints ``RESULT {"example", "rank", "weights"}``, ``weights`` a
digest of the trained model's local weights (the last model the stand-ins made). When the examples import
Accelerate, its process-wide state is reset between them, as Accelerate's own tests do, and its process group kept
(see _keep_accelerates_process_group)."""

import hashlib
import importlib.util
import json
import os
import sys

import standins


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(name.encode() + local.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def run_example(file: str, args: list, env: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    stem = os.path.splitext(os.path.basename(file))[0]
    if rank == 0:
        print(f"EXAMPLE {stem}", flush=True)
    spec = importlib.util.spec_from_file_location(f"example_{stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in env}
    sys.argv = [file, *args]
    os.environ.update(env)
    made = len(standins.MODELS)
    _keep_accelerates_process_group()
    try:
        module.main()
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    weights = _weights_digest(standins.MODELS[-1]) if len(standins.MODELS) > made else None
    print(f"RESULT {json.dumps({'example': stem, 'rank': rank, 'weights': weights})}", flush=True)
    if "accelerate.state" in sys.modules:  # the next example's Accelerator starts anew, in the same process group
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _keep_accelerates_process_group() -> None:
    """Accelerate's ``end_training()`` destroys the process group, and a new ``init_process_group`` in the same
    torchrun worker may fail to connect (gloo); examples run one after another keep the first group instead."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import PartialState

        PartialState.destroy_process_group = lambda self, group=None: None


def run_plan(plan: list) -> None:
    for step in plan:
        run_example(step["file"], step.get("args", []), step.get("env", {}))


def _end_accelerates_process_group() -> None:
    """Under torchrun with Accelerate's files, the process group kept above would last until the interpreter's
    exit, whose teardown of its threads aborted one worker now and then ("terminate called without an active
    exception"): end it as Accelerate's end_training() does. (qaccel ends its own session at exit.)"""
    import torch.distributed as dist

    if "qaccel" not in sys.modules and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    PLAN = json.loads(open(sys.argv[1]).read())
    if "--distribute" in sys.argv:
        from qaccel import Accelerator

        Accelerator(nprocs=2, rank_prefix=True).distribute(run_plan)(PLAN)
    elif "--notebook" in sys.argv:
        from qaccel import notebook_launcher

        notebook_launcher(run_plan, (PLAN,), num_processes=2, log_line_prefix_template="{rank}: ")
    else:
        run_plan(PLAN)
        _end_accelerates_process_group()
