"""Lightning code run inside distribute(): a Fabric loop (``Fabric(accelerator="cpu", devices=2)`` and
``launch()``) and Lightning's Trainer (``devices=2, strategy="ddp"``, a checkpoint every epoch), each with a Dataset
class and two loader workers, in one process. Prints ``RESULT {...}`` per run: every rank's world, the samples it
trained on and its weights.

Usage: lightning_loops.py OUTPUT_DIR"""

import json
import logging
import os
import sys

import lightning as L
import torch
from lightning.fabric import Fabric
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


def fabric_loop():
    fabric = Fabric(accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Line(), batch_size=4, shuffle=True, num_workers=2))
    seen = []
    for epoch in range(2):
        for x, y, index in loader:
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen += index.tolist()
        fabric.save(os.path.join(OUT, f"fabric_epoch_{epoch}.ckpt"), {"model": model, "optimizer": optimizer})
    return {"rank": fabric.global_rank, "world": fabric.world_size, "seen": seen,
            "weights": [p.item() for p in model.parameters()]}


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_index):
        x, y, index = batch
        self.seen += index.tolist()
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_trainer():
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        default_root_dir=os.path.join(OUT, "trainer"), enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(Line(), batch_size=4, shuffle=True, num_workers=2))
    return {"rank": trainer.global_rank, "world": trainer.world_size, "seen": module.seen,
            "weights": [p.item() for p in module.parameters()]}


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    for fn in (fabric_loop, lightning_trainer):
        results = acc.distribute(fn, all_results=True)()
        os.write(1, f"RESULT {json.dumps({'call': fn.__name__, 'ranks': results})}\n".encode())
