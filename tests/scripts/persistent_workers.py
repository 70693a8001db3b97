"""A Trainer script whose DataLoaders keep their workers (``persistent_workers=True``), as many users set it: its
ranks must end when training ends. Prints ``RESULT {"test_loss": ...}`` once.

Argument: LOG_FOLDER."""

import json
import logging
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import TrainConfig, Trainer

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")


class Points(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum(0, keepdim=True)


def loader(n, **kwargs):
    return DataLoader(Points(n), batch_size=8, num_workers=2, persistent_workers=True, **kwargs)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = TrainConfig(
        nprocs=2,
        max_iter=3,
        compute_setup="cpu",
        log_folder=sys.argv[1],
        checkpoint_every=1,
        val_every=1,
        tracking_tool="csv",
        verbose=False,
    )
    trainer = Trainer(model, optimizer, config, "mse", loader(64, shuffle=True), loader(32))
    trainer.fit()
    metrics = trainer.test(loader(20))
    if trainer.accelerator.is_main_process:
        print("RESULT " + json.dumps(metrics), flush=True)
