"""Print the GPU qaccel's rule gives this rank, from what its launcher set: the layout (detect()) and the GPUs the
rank sees, counted from CUDA_VISIBLE_DEVICES as SLURM, mpirun's wrapper or a pod set it (this machine's torch sees
no GPU, so torch's count is not asked).

    srun ... python gpu_choice.py          # one RESULT line per rank: its physical GPU and the binding, or the error
"""

import json
import os

from qaccel.environment import detect, gpus

env = detect()
shown = os.environ.get("CUDA_VISIBLE_DEVICES", "")
seen = shown.split(",") if shown else []
try:
    choice = gpus.choose(env.local_rank, env.local_world_size, len(seen), gpus.node_gpus())
    out = {"rank": env.rank, "node": env.node_rank, "gpu": seen[choice.index], "binding": str(choice.binding)}
except gpus.GpuLayoutError as exc:
    out = {"rank": env.rank, "error": str(exc)}
print("RESULT " + json.dumps(out), flush=True)
