"""perceptrain's tutorial page docs/tutorials/distributed/accelerator_doc.md ("Accelerator for Distributed
Training"), perceptrain 0.1.0 at commit 2ef328a, run as a reader pastes its Python blocks, on perceptrain's
Accelerator or on qaccel.perceptrain's.

Usage: ``python accelerator_doc.py perceptrain|qaccel``. Every rank prints the page's lines ``Rank: r | Epoch: e |
Loss: l``; the caller prints one line ``RESULT <json>`` at the end (also after an error, with what was recorded up
to it): what ``distributed_train_epoch(...)`` returned.

Changes from the page:

- imports: ``perceptrain.train_utils`` (its Accelerator) -> ``qaccel.perceptrain.train_utils``, in a second import
  block next to perceptrain's;
- sizes: ``nprocs=2`` (tutorial: ``nprocs=4``): the test machine has 2 cores;
- left out: the first block, ``Accelerator(nprocs=4, compute_setup="auto", ..., backend="nccl")``, made for GPUs:
  without CUDA qaccel refuses ``backend="nccl"`` when the Accelerator is made (ValueError: "backend='nccl' needs
  GPU compute"), where perceptrain makes it and would fail only when ranks start; the ``all_reduce_dict`` block,
  which uses that accelerator; the fragments that use names the page never defines (``accelerator.distribute(fun)``,
  ``accelerator.prepare(model, optimizer, dataloader)``, ``accelerator.prepare(batch)``) and the shell commands;
- what ``distributed_train_epoch(...)`` returns is kept (``returned = ...``; the page drops it);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

PERCEPTRAIN = {"perceptrain": True, "qaccel": False}[sys.argv[1]]  # test: whose Accelerator
RESULT: dict = {"library": sys.argv[1]}  # test
if __name__ == "__main__":  # test: the caller only, not the ranks
    atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- Example Code (train_script.py) ----

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
if PERCEPTRAIN:
    from perceptrain.train_utils import Accelerator
else:
    from qaccel.perceptrain.train_utils import Accelerator


def train_epoch(epochs, model, dataloader, optimizer, accelerator):

    # Prepare model, optimizer, and dataloader for distributed training
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    # accelerator.rank will provide you the rank of the process.
    if accelerator.rank == 0:
        print("Prepared model of type: ", type(model))
        print("Prepared optimizer of type: ", type(optimizer))
        print("Prepared dataloader of type: ", type(dataloader))

    model.train()
    for epoch in range(epochs):
        for batch in dataloader:

            # Move batch to the correct device
            batch = accelerator.prepare_batch(batch)

            batch_data, batch_targets = batch
            optimizer.zero_grad()
            output = model(batch_data)
            loss = torch.nn.functional.mse_loss(output, batch_targets)
            loss.backward()
            optimizer.step()
        print("Rank: ", accelerator.rank, " | Epoch: ", epoch, " | Loss: ", loss.item())

if __name__ == "__main__":
    n_epochs = 10
    model = nn.Sequential(
        nn.Linear(10, 100),  # Input Layer
        nn.ReLU(),  # Activation Function
        nn.Linear(100, 1)  # Output Layer
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    # A random dataset with 10 features and a target to predict.
    dataset = TensorDataset(torch.randn(100, 10), torch.randn(100, 1))
    dataloader = DataLoader(dataset, batch_size=32)

    accelerator = Accelerator(
        nprocs=2,               # tutorial: nprocs=4
        compute_setup="cpu",    # or choose GPU
        backend="gloo"          # choose `nccl` for GPU
    )

    distributed_train_epoch = accelerator.distribute(train_epoch)
    returned = distributed_train_epoch(n_epochs, model, dataloader, optimizer, accelerator)  # tutorial: no `returned = `
    RESULT["returned"] = repr(returned)  # test
    RESULT["n_epochs"] = n_epochs  # test
