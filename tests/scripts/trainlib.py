"""A module that holds an Accelerator as a global and a function that uses it; global_accelerator.py imports it."""

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu")


def train():
    return (acc.rank, acc.world_size)
