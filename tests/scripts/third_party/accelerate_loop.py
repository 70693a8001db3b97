"""An Accelerate training loop as its examples write one, run inside distribute(): the Accelerator made in the
function, a Dataset class, two loader workers, ``save_state`` every epoch, and ``end_training()`` at the end (which
destroys the process group). Run twice in one process. Prints ``RESULT {...}`` per run: every rank's world, the
samples it trained on and its weights.

Usage: accelerate_loop.py OUTPUT_DIR"""

import json
import logging
import os
import sys

import accelerate
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
OUT = sys.argv[1]


class Line(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.tensor([i / 32]), torch.tensor([2.0 * i / 32 + 1]), i


def train(call):
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Line(), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for epoch in range(2):
        for x, y, index in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen += index.tolist()
        accelerator.save_state(os.path.join(OUT, f"call_{call}", f"epoch_{epoch}"))
    weights = [p.item() for p in accelerator.unwrap_model(model).parameters()]
    result = {"rank": accelerator.process_index, "world": accelerator.num_processes, "seen": seen, "weights": weights,
              "wrapped": type(model).__name__}
    accelerator.end_training()
    return result


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    for call in (0, 1):
        results = acc.distribute(train, all_results=True)(call)
        os.write(1, f"RESULT {json.dumps({'call': call, 'ranks': results})}\n".encode())
