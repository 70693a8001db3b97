"""A training script as Accelerate's guides write one (a classifier with an LR scheduler, evaluation through
gather_for_metrics, save_state every epoch, the model saved by the main process), with its import changed to
qaccel and ``step_scheduler_with_optimizer=True`` (Accelerate's default; qaccel's leaves schedulers to you).
Logging is set up at the top, the Dataset class is the script's own and the loaders use 2 workers.

    torchrun --nproc_per_node 2 accelerate_guide.py OUT     # as Accelerate's guides run it: main() on every rank
    python accelerate_guide.py OUT --distribute             # qaccel starts 2 ranks: distribute(main)

Prints ``RESULT {"accuracy": ..., "seen": ..., "hash": ..., "lr": ..., "steps": ...}`` once (the main
process)."""

import hashlib
import json
import logging
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator  # was: from accelerate import Accelerator

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
logger = logging.getLogger("accelerate_guide")


class Digits(Dataset):
    """8x8 images of 10 classes: a class's pattern plus noise (an MNIST-like set that needs no download)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        patterns = torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = patterns[self.labels] + 0.3 * torch.randn(n, 1, 8, 8, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def main():
    out = sys.argv[1]
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=True)  # Accelerate's default
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = DataLoader(
        Digits(512, 1), batch_size=16, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7)
    )
    evaluation = DataLoader(Digits(300, 2), batch_size=32, num_workers=2)
    # sized on the unprepared loader, as Accelerate's guides size it: step_scheduler_with_optimizer=True below
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=3 * len(train))
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)
    for epoch in range(3):
        model.train()
        for images, labels in train:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
        model.eval()
        correct = seen = 0
        for images, labels in evaluation:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += int((predictions == labels).sum())
            seen += len(labels)
        accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.3f} on {seen} samples")
        accelerator.save_state(f"{out}/epoch_{epoch}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        accelerator.save(weights, f"{out}/model.pt")
        digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values())).hexdigest()
        print(
            "RESULT "
            + json.dumps(
                {
                    "accuracy": correct / seen,
                    "seen": seen,
                    "hash": digest,
                    "lr": scheduler.get_last_lr()[0],
                    "steps": scheduler.last_epoch,
                }
            ),
            flush=True,
        )
    accelerator.end_training()


if __name__ == "__main__":
    if "--distribute" in sys.argv:
        Accelerator(nprocs=2, cpu=True, step_scheduler_with_optimizer=True).distribute(main)()
    else:
        main()
