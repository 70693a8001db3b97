"""A transformers Trainer script as its tutorials write one: a small CNN with a ``compute_loss`` override, a Dataset
class, two loader workers, a checkpoint every epoch, logging configured at the top. Run twice in one process: with
the ``TrainingArguments`` made at the script's top level (as notebooks do) and made inside the function. Prints
``RESULT {...}`` per run: every rank's world, the samples it trained on and its weights.

Usage: hf_trainer.py OUTPUT_DIR (under python, qaccel starts 2 ranks; under torchrun, each process is one)."""

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from qaccel import Accelerator

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
OUT = sys.argv[1]


class Images(Dataset):
    def __init__(self, n: int = 48):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 8, 8, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i], "index": i}


class SimpleCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, pixel_values):
        return self.fc(torch.relu(self.conv(pixel_values)).flatten(1))


class IndexedTrainer(Trainer):
    """Records the samples this rank trains on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.extend(inputs.pop("index").tolist())
        labels = inputs.pop("labels")
        logits = model(**inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        return (loss, logits) if return_outputs else loss


def arguments(name):
    return TrainingArguments(output_dir=os.path.join(OUT, name), use_cpu=True, per_device_train_batch_size=4,
                             num_train_epochs=2, save_strategy="epoch", logging_strategy="no", report_to=[],
                             remove_unused_columns=False, dataloader_num_workers=2, disable_tqdm=True, seed=0)


ARGUMENTS = arguments("top_level")


def train(made_inside):
    args = arguments("inside") if made_inside else ARGUMENTS
    torch.manual_seed(0)  # the same weights in every call, whichever process runs it
    model = SimpleCNN()
    trainer = IndexedTrainer(model=model, args=args, train_dataset=Images())
    trainer.train()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {"rank": dist.get_rank(), "world": args.world_size, "seen": trainer.seen, "weights": weights,
            "wrapped": type(trainer.model_wrapped).__name__,
            "checkpoints": sorted(os.listdir(args.output_dir)) if args.process_index == 0 else None}


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    for made_inside in (False, True):
        results = acc.distribute(train, all_results=True)(made_inside)
        call = "inside" if made_inside else "top_level"
        os.write(1, f"RESULT {json.dumps({'call': call, 'ranks': results})}\n".encode())
