"""A one-rank NCCL group the script makes itself, which qaccel reuses for every collective on the GPU; prints ``OUT
<backend> <group still initialized>``. Run on a GPU by tests/test_cuda.py."""

import torch
import torch.distributed as dist

from qaccel import Accelerator

if __name__ == "__main__":
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    acc = Accelerator(compute_setup="gpu", log_setup="auto")

    def work():
        acc.wait_for_everyone()
        d = acc.all_reduce_dict({"a": 1.5, "n": 3, "t": torch.ones(2, device=acc.device)}, op="sum")
        assert d["a"] == 1.5 and d["n"] == 3 and d["t"].device == acc.device, d
        g = acc.gather(torch.arange(3, device=acc.device))
        assert g.tolist() == [0, 1, 2] and g.device == acc.device
        assert acc.broadcast({"k": 1}) == {"k": 1}
        assert acc.gather_object(["x"]) == ["x"]
        assert acc.reduce(torch.ones(2, device=acc.device), reduction="mean").tolist() == [1.0, 1.0]
        return acc.backend

    print("OUT", acc.distribute(work)(), dist.is_initialized(), flush=True)
    dist.destroy_process_group()
