"""A training body written for torchrun, as tutorials write it, run inside distribute() unchanged: it makes the
default group itself from torchrun's variables (``init_process_group("gloo")``, env://), shards with a
DistributedSampler, wraps in DDP and destroys the group at its end. Prints ``RESULT {...}`` once (rank 0's under a
plain launch, every rank's under torchrun): the world it saw, the samples it trained on, its weights' sum.

Usage: ddp_body.py [explicit | top]: with ``explicit``, the second call's body passes init_method="env://", its rank
and the world size as well (the first one's always makes the group from the environment alone). With ``top`` (under
a launcher), the script makes the group at its top before the Accelerator, as a transformers ``TrainingArguments``
made there does: the first call runs in that group and its body destroys it, as an Accelerate loop's
``end_training()`` does; rank 0 then reaches the second call a second later, so rank 1 makes the next group first.
After the second call, ``acc.reduce`` outside distribute() joins the ranks in a group made anew, rank 1 first again."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qaccel import Accelerator

TOP = sys.argv[1:] == ["top"]
if TOP:
    dist.init_process_group("gloo")
acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)


def train(explicit):
    if explicit:
        dist.init_process_group(
            "gloo", init_method="env://", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8.0).reshape(8, 1))
    sampler = DistributedSampler(data, shuffle=False)
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=2, sampler=sampler):
            seen += x[:, 0].tolist()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    weights = sum(p.detach().sum().item() for p in model.parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, weights)
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "seen": seen, "weights": everyone}


if __name__ == "__main__":
    results = acc.distribute(train, all_results=True)(False)
    assert [r["rank"] for r in results] == [0, 1], results  # every rank's result came back
    result = results[int(os.environ.get("RANK", "0"))]  # this process's (the caller's: rank 0's)
    if TOP:
        assert not dist.is_initialized(), "the script's group, destroyed by the body, is gone once the call ends"
        if result["rank"] == 0:
            time.sleep(1)  # rank 1 makes the next group first: it must not read the destroyed group's addresses
    again = acc.distribute(train)(sys.argv[1:] == ["explicit"])  # a second call: the group made anew, the same training
    assert again == result, (again, result)
    if TOP:  # code outside distribute() (as a script written for Accelerate has) joins the ranks in a group made anew
        if result["rank"] == 0:
            time.sleep(1)
        total = acc.reduce(torch.tensor([result["rank"] + 1.0]), "sum")
        assert total.item() == 3.0, f"the Accelerator's reduce acted for rank {result['rank']} alone: {total}"
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())
