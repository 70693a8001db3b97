"""Print the GPU qaccel's rule gives this rank, from what its launcher set: the layout (detect()) and the GPUs the
rank sees, counted from CUDA_VISIBLE_DEVICES as SLURM, mpirun's wrapper or a pod set it (this machine's torch sees
no GPU, so torch's count is not asked).

    srun ... python gpu_choice.py          # one RESULT line per rank: its physical GPU and the binding, or the error

choice() makes that report from os.environ: template_train.py prints it in every rank of a job given GPUs, and
tests/environment/test_gpus.py makes it from environments that srun and mpirun tasks saved.
"""

import json
import os

from qaccel.environment import detect, gpus


def choice() -> dict:
    """This rank's report: its rank, its node rank, the physical GPU it takes and the binding; or the error."""
    env = detect()
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    seen = shown.split(",") if shown else []
    try:
        taken = gpus.choose(env.local_rank, env.local_world_size, len(seen), gpus.node_gpus())
        return {"rank": env.rank, "node": env.node_rank, "gpu": seen[taken.index], "binding": str(taken.binding)}
    except gpus.GpuLayoutError as exc:
        return {"rank": env.rank, "error": str(exc)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(choice()), flush=True)
