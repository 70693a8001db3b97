"""Handwritten digits with the Trainer: a small CNN on scikit-learn's digits (1797 images of 8x8 pixels), trained on
2 CPU ranks with validation every epoch, early stopping, checkpoints, a tracker and a plot of the curves.

    python examples/digits_trainer.py                                   # qaccel starts 2 ranks (nprocs=2)
    torchrun --standalone --nproc_per_node 2 examples/digits_trainer.py  # torchrun's ranks, run in place
    srun -n 2 python examples/digits_trainer.py                          # each SLURM task is a rank

Options: --epochs N (the total, also when continuing a run), --log-folder DIR (the run's folder; default
digits_run in the working directory) and --tracking {tensorboard,mlflow,csv} (default tensorboard).

The run's folder holds checkpoints/ (one per epoch), tracking/ (the tracker's files) and curves.png (the training
and validation curves). Running again with the same --log-folder continues from its newest checkpoint: give a
larger --epochs to train further. Needs scikit-learn for the data, matplotlib for curves.png and the tracker's
package: pip install -e '.[examples]' from qaccel's checkout.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset

from qaccel import TrainConfig, Trainer
from qaccel.callbacks import EarlyStopping

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logger = logging.getLogger("digits")


class Digits(Dataset):
    """The digits at ``indices``: images as (1, 8, 8) float32 in [0, 1], labels as int64 in 0..9."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> None:
        self.images = torch.from_numpy(images[indices] / 16.0).float().reshape(-1, 1, 8, 8)
        self.labels = torch.from_numpy(labels[indices]).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions (8x8 -> 4x4 -> 2x2 after pooling) and a linear layer to the 10 classes' logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.classify = torch.nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(torch.flatten(self.features(x), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="training epochs in all (default 15)")
    parser.add_argument("--log-folder", default="digits_run", metavar="DIR", help="the run's folder")
    parser.add_argument("--tracking", choices=["tensorboard", "mlflow", "csv"], default="tensorboard")
    args = parser.parse_args()

    digits = load_digits()  # bundled with scikit-learn: nothing is downloaded
    order = np.random.default_rng(0).permutation(len(digits.target))  # the same split on every rank
    val_size = 360
    train_set = Digits(digits.images, digits.target, order[val_size:])
    val_set = Digits(digits.images, digits.target, order[:val_size])
    logger.info("%d digits: %d to train on, %d to validate on", len(order), len(train_set), len(val_set))

    # The batches are these DataLoaders'; the Trainer gives each rank its share of them. Validation is 6 batches of
    # 60, 3 per rank: the mean over the ranks is the mean over the 360 images.
    train = DataLoader(train_set, batch_size=32, shuffle=True, num_workers=2)
    val = DataLoader(val_set, batch_size=60, num_workers=2)

    torch.manual_seed(0)  # the same initial weights however the script is started
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    config = TrainConfig(
        nprocs=2,  # under torchrun or srun the launcher's world size wins
        compute_setup="cpu",
        max_iter=args.epochs - 1,  # the last epoch: epochs count from 0, as in qadence
        val_every=1,  # and once before training, at step 0
        print_every=1,
        write_every=1,
        checkpoint_every=1,
        all_reduce_metrics=True,  # metrics over every rank's batches, not rank 0's share only
        tracking_tool=args.tracking,
        log_folder=args.log_folder,
        callbacks=[EarlyStopping(on="val_epoch_end", called_every=1, monitor="val_loss", patience=3)],
        seed=0,  # shuffling and every rank's RNGs
    )
    trainer = Trainer(model, optimizer, config, loss_fn="cross_entropy")
    trainer.fit(train, val)

    if trainer.accelerator.is_main_process:  # under torchrun and srun every rank gets here: print once
        last = trainer.history[-1]
        print(f"validation accuracy {last['val_accuracy']:.2%} after epoch {last['step']}")
        print(f"run folder: {trainer.log_folder} (curves.png, tracking/ with the {args.tracking} files, checkpoints/)")


if __name__ == "__main__":
    main()
