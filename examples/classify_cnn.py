"""Image classification: the MNIST-style CNN of the Accelerate tutorials, with a distributed evaluation.

    python examples/classify_cnn.py                                   # qaccel starts 2 ranks (--nprocs)
    torchrun --standalone --nproc_per_node 2 examples/classify_cnn.py  # torchrun's ranks, run in place
    srun -n 2 python examples/classify_cnn.py                          # each SLURM task is a rank

Options: --epochs N (the total, also when resuming), --nprocs N (ignored under torchrun/srun, whose world size
wins), --out DIR (the folder save_model writes the trained weights into, as DIR/model.pt; default classify_cnn in
the working directory; the path is printed), --accumulate K (an optimizer update every K batches), --bf16 (bf16
mixed precision, CPU or GPU), --checkpoint DIR (save_state after every epoch) and --resume (load_state from DIR
first and train the remaining epochs).

The images are made here, nothing is downloaded: 28x28, one channel, 10 classes. A class is a bright blob at
one of 10 places on a ring, shifted at random by up to 2 pixels, with a fainter distractor blob anywhere and
noise on top. The 1000 test images are evaluated in batches of 96: 11 batches on 2 ranks, so the last round
is evened out with a repeated batch, which gather_for_metrics drops again: exactly 1000 samples are counted.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator


def make_images(n: int, seed: int) -> TensorDataset:
    """n images (n, 1, 28, 28) and their int64 labels in 0..9, the same for a given seed on every rank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=g)]
    angle = 2 * math.pi * labels / 10
    jitter = lambda: torch.randint(-2, 3, (n,), generator=g)
    cy, cx = 13.5 + 8 * torch.sin(angle) + jitter(), 13.5 + 8 * torch.cos(angle) + jitter()
    dy, dx = torch.rand(n, generator=g) * 27, torch.rand(n, generator=g) * 27  # distractor anywhere
    grid = torch.arange(28.0)
    yy, xx = grid.view(1, 28, 1), grid.view(1, 1, 28)

    def blob(y: torch.Tensor, x: torch.Tensor, sigma: float) -> torch.Tensor:
        return torch.exp(-((yy - y.view(-1, 1, 1)) ** 2 + (xx - x.view(-1, 1, 1)) ** 2) / (2 * sigma**2))

    images = blob(cy, cx, 2.0) + 0.6 * blob(dy, dx, 2.0) + 0.3 * torch.randn(n, 28, 28, generator=g)
    return TensorDataset(images.unsqueeze(1), labels)


class Progress:
    """Epochs done and the last train loss: save_state() writes it, load_state() restores it."""

    def __init__(self) -> None:
        self.epochs, self.loss = 0, float("nan")

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


class Net(torch.nn.Module):
    """The CNN of the Accelerate / PyTorch MNIST examples: 2 conv layers, max-pool, dropout, 2 linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, 1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.dropout2 = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(9216, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: DataLoader,
    test_loader: DataLoader,
    accelerator: Accelerator,
    epochs: int,
    out: str,
    checkpoint: str | None = None,
    resume: bool = False,
) -> dict:
    """Runs on every rank: trains, evaluates on the whole test split, and saves the weights once, as out/model.pt."""
    torch.manual_seed(1000 + accelerator.rank)  # dropout: different masks per rank, the same in every launch mode
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if resume:  # weights, Adam state, data order, every rank's RNG states (dropout) and progress
        accelerator.load_state(checkpoint)
        accelerator.print(f"resumed from {checkpoint} after epoch {progress.epochs}/{epochs}")
    accelerator.print(
        f"{accelerator.world_size} rank(s) on {accelerator.device}: {len(train_loader)} training steps per epoch "
        f"per rank, batch {train_loader.batch_size} per rank"
    )
    for epoch in range(progress.epochs, epochs):
        model.train()
        total, steps = 0.0, 0
        for batch in train_loader:
            images, labels = accelerator.prepare_batch(batch)
            with accelerator.accumulate(model):  # one micro-step: an update every --accumulate batches
                loss = F.nll_loss(model(images), labels)  # the forward runs under autocast with --bf16
                accelerator.backward(loss)
                optimizer.step()  # does nothing on accumulation steps, nor does zero_grad()
                optimizer.zero_grad()
            total, steps = total + loss.item(), steps + 1
        progress.epochs, progress.loss = epoch + 1, accelerator.all_reduce_dict({"loss": total / steps})["loss"]
        accelerator.print(f"epoch {epoch + 1}/{epochs}  train loss {progress.loss:.4f}")
        if checkpoint:
            accelerator.save_state(checkpoint)  # on every rank: it is collective

    # Distributed evaluation: each rank predicts its share of the batches; gather_for_metrics collects all
    # ranks' rows and removes the repeated samples that evened out the last round, so counts are exact.
    # Call it inside the loop, once per batch: it knows which rows are repeats only for the current step.
    model.eval()
    correct, seen = 0, 0
    with torch.no_grad():
        for batch in test_loader:
            images, labels = accelerator.prepare_batch(batch)
            predictions = model(images).argmax(dim=1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += int((predictions == labels).sum())
            seen += len(labels)
    # Every rank now holds the same counts: print them once.
    accelerator.print(f"test accuracy {correct / seen:.2%} on {seen} samples (test split: {len(test_loader.dataset)})")

    # Called on every rank; the main process writes out/model.pt once, atomically, without DDP's "module." prefix.
    accelerator.save_model(model, out)
    return {"loss": progress.loss, "accuracy": correct / seen, "seen": seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to start under plain python (default 2)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--out",
        default="classify_cnn",
        metavar="DIR",
        help="the folder to save the weights into, as DIR/model.pt (default: ./classify_cnn)",
    )
    parser.add_argument("--accumulate", type=int, default=1, metavar="K", help="batches per optimizer update")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the model stays float32)")
    parser.add_argument("--checkpoint", metavar="DIR", help="save_state(DIR) after every epoch")
    parser.add_argument("--resume", action="store_true", help="load_state(DIR) first; --epochs is the total")
    args = parser.parse_args()
    if args.epochs < 1 or args.nprocs < 1 or args.accumulate < 1:
        parser.error("--epochs, --nprocs and --accumulate must be at least 1")
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    if args.resume and not os.path.isdir(args.checkpoint):
        parser.error(f"--resume: no checkpoint directory {args.checkpoint}")

    # Create the Accelerator first: under plain python it starts warming up the rank launcher at once.
    acc = Accelerator(
        nprocs=args.nprocs,
        compute_setup="auto",
        log_setup="cpu",
        gradient_accumulation_steps=args.accumulate,
        mixed_precision="bf16" if args.bf16 else "no",
    )

    torch.manual_seed(0)  # same initial weights on every rank under torchrun/srun (DDP also syncs them)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    shuffle_rng = torch.Generator().manual_seed(0)  # the shuffling seed: the same run however it is started
    train_loader = DataLoader(make_images(4000, seed=0), batch_size=64, shuffle=True, generator=shuffle_rng)
    test_loader = DataLoader(make_images(1000, seed=1), batch_size=96)

    acc.distribute(train)(
        model, optimizer, train_loader, test_loader, acc, args.epochs, args.out, args.checkpoint, args.resume
    )

    if acc.is_main_process:
        saved = os.path.abspath(os.path.join(args.out, "model.pt"))
        state = torch.load(saved, weights_only=True)
        Net().load_state_dict(state)  # the saved weights load into a plain Net: no DDP wrapper, no prefix
        print(f"saved {sum(t.numel() for t in state.values()):,} weights to {saved}")


if __name__ == "__main__":
    main()
