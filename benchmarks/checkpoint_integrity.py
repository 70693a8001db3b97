"""What checksums cost a checkpoint: save_state + load_state of a ~200 MB state with checksums on and off.

A 1-process Accelerator prepares an MLP of 16.8 M float32 parameters (67 MB) and Adam (two moments, 134 MB), takes
one step, then, per sample, saves a checkpoint and loads it back into the prepared objects:

    torch       by hand: torch.save of the model's and optimizer's state dicts to files, fsynced, and torch.load
                of both (load_state_dict included): the floor every checkpoint pays
    sums off    qaccel save_state + load_state, sizes recorded and checked, no checksums (storage.CHECKSUMS = False)
    sums on     the same with every file's 64-bit checksum, taken once written and checked while reading (the
                default)

The ways alternate within each round, in one process, so the page cache and the machine's load treat them alike.
Medians over the rounds.

    python benchmarks/checkpoint_integrity.py           # 7 rounds
    python benchmarks/checkpoint_integrity.py --quick   # 3 rounds

Prints a table and PASS/MISS for the target (sums on <= 1.10 x sums off); always exits 0 unless a run crashes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from report import row, verdict

from qaccel import Accelerator, storage

TARGET = 1.10
WIDTH = 2048  # 4 layers of 2048 x 2048: 16.8 M parameters


def _prepared(acc: Accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.ones(2, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def _by_hand(model, optimizer, folder: str) -> None:
    for name, state in (("model.pt", model.state_dict()), ("optimizer.pt", optimizer.state_dict())):
        with open(os.path.join(folder, name), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    model.load_state_dict(torch.load(os.path.join(folder, "model.pt"), weights_only=True))
    optimizer.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True))


def _qaccel(acc: Accelerator, folder: str, sums: bool) -> None:
    storage.CHECKSUMS = sums
    try:
        acc.save_state(folder)
        acc.load_state(folder)
    finally:
        storage.CHECKSUMS = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    rounds = 3 if parser.parse_args().quick else 7
    acc = Accelerator(nprocs=1, compute_setup="cpu")
    model, optimizer = _prepared(acc)
    size = sum(p.numel() * 3 * 4 for p in model.parameters())
    ways = {
        "torch (by hand)": lambda folder: _by_hand(model, optimizer, folder),
        "sums off": lambda folder: _qaccel(acc, folder, False),
        "sums on": lambda folder: _qaccel(acc, folder, True),
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    root = tempfile.mkdtemp(prefix="checkpoint-integrity-", dir=os.getcwd())
    try:
        for _ in range(rounds + 1):  # the first round warms the page cache and the allocator, and is dropped
            for name, way in ways.items():
                folder = os.path.join(root, name.replace(" ", "_").strip("()"))
                os.makedirs(folder, exist_ok=True)
                start = time.perf_counter()
                way(folder)
                samples[name].append(time.perf_counter() - start)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"save + load of a {size / 1e6:.0f} MB state (model + Adam), 1 process, median of {rounds} rounds")
    print(f"{'way':<18}{'median s':>10}{'min s':>9}{'max s':>9}{'x torch':>9}")
    base = statistics.median(samples["torch (by hand)"][1:])
    for name, values in samples.items():
        name, median, low, high = row(name, values[1:])
        print(f"{name:<18}{median:>10.3f}{low:>9.3f}{high:>9.3f}{median / base:>9.2f}")
    ratio = statistics.median(samples["sums on"][1:]) / statistics.median(samples["sums off"][1:])
    print(f"checksums: sums on / sums off = {ratio:.3f} (target <= {TARGET}): {verdict(ratio <= TARGET)}")


if __name__ == "__main__":
    main()
