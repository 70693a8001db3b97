"""Accelerate's own checks of even_batches and join_uneven_inputs (its test_distributed_data_loop.py script), ported
with only the import changed to qaccel. Logging is set up at the top; the loaders are Accelerate's.

    torchrun --nproc_per_node 2 accelerate_data_loop.py     # as Accelerate runs it: main() on every rank
    python accelerate_data_loop.py --distribute             # qaccel starts 2 ranks: distribute(main)

Prints ``RESULT {"passed": [...]}`` on the main process once every check passed on every rank.
"""

import json
import logging
import sys
import warnings

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from qaccel import Accelerator, DataLoaderConfiguration  # was: from accelerate import ...

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


class DummyIterableDataset(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        yield from self.data


def create_accelerator(even_batches=True):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=even_batches))
    assert accelerator.num_processes == 2, "this script expects two processes"
    return accelerator


def create_dataloader(accelerator, dataset_size, batch_size, iterable=False):
    values = torch.as_tensor(range(dataset_size))
    dataset = DummyIterableDataset(values) if iterable else TensorDataset(values)
    return accelerator.prepare(DataLoader(dataset, batch_size=batch_size))


def verify_dataloader_batch_sizes(accelerator, dataset_size, batch_size, process_0_expected, process_1_expected):
    dl = create_dataloader(accelerator, dataset_size=dataset_size, batch_size=batch_size)
    batch_sizes = [len(batch[0]) for batch in dl]
    expected = process_0_expected if accelerator.process_index == 0 else process_1_expected
    assert batch_sizes == expected, (accelerator.process_index, batch_sizes, expected)


def test_default_ensures_even_batch_sizes():
    accelerator = create_accelerator()
    verify_dataloader_batch_sizes(accelerator, 3, 1, [1, 1], [1, 1])
    verify_dataloader_batch_sizes(accelerator, 7, 2, [2, 2], [2, 2])


def test_can_disable_even_batches():
    accelerator = create_accelerator(even_batches=False)
    verify_dataloader_batch_sizes(accelerator, 3, 1, [1, 1], [1])
    verify_dataloader_batch_sizes(accelerator, 7, 2, [2, 2], [2, 1])


def test_can_join_uneven_inputs():
    accelerator = create_accelerator(even_batches=False)
    ddp_model = accelerator.prepare(torch.nn.Linear(1, 1))
    dl = create_dataloader(accelerator, dataset_size=3, batch_size=1)
    batch_idxs = []
    with accelerator.join_uneven_inputs([ddp_model]):
        for batch_idx, batch in enumerate(dl):
            ddp_model(batch[0].float()).sum().backward()
            batch_idxs.append(batch_idx)
    accelerator.wait_for_everyone()
    assert batch_idxs == ([0, 1] if accelerator.process_index == 0 else [0])


def test_join_can_override_even_batches():
    accelerator = create_accelerator(even_batches=True)
    ddp_model = accelerator.prepare(torch.nn.Linear(1, 1))
    train_dl = create_dataloader(accelerator, dataset_size=3, batch_size=1)
    valid_dl = create_dataloader(accelerator, dataset_size=3, batch_size=1)
    with accelerator.join_uneven_inputs([ddp_model], even_batches=False):
        train_value, valid_value = train_dl.batch_sampler.even_batches, valid_dl.batch_sampler.even_batches
    assert train_value is False and valid_value is False
    assert train_dl.batch_sampler.even_batches is True and valid_dl.batch_sampler.even_batches is True


def test_join_can_override_for_mixed_type_dataloaders():
    accelerator = create_accelerator(even_batches=True)
    ddp_model = accelerator.prepare(torch.nn.Linear(1, 1))
    create_dataloader(accelerator, dataset_size=3, batch_size=1, iterable=True)
    batch_dl = create_dataloader(accelerator, dataset_size=3, batch_size=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        with accelerator.join_uneven_inputs([ddp_model], even_batches=False):
            overridden = batch_dl.batch_sampler.even_batches
    assert overridden is False and batch_dl.batch_sampler.even_batches is True


def test_join_raises_warning_for_iterable_when_overriding_even_batches():
    accelerator = create_accelerator()
    ddp_model = accelerator.prepare(torch.nn.Linear(1, 1))
    create_dataloader(accelerator, dataset_size=3, batch_size=1, iterable=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([ddp_model], even_batches=False):
            pass
    assert issubclass(w[-1].category, UserWarning)
    assert "only supported for map-style datasets" in str(w[-1].message)


CHECKS = [test_default_ensures_even_batch_sizes, test_can_disable_even_batches, test_can_join_uneven_inputs,
          test_join_can_override_even_batches, test_join_can_override_for_mixed_type_dataloaders,
          test_join_raises_warning_for_iterable_when_overriding_even_batches]


def main():
    for check in CHECKS:
        check()
    accelerator = Accelerator(cpu=True)
    passed = accelerator.gather_object([[check.__name__ for check in CHECKS]])
    if accelerator.is_main_process:
        assert passed[0] == passed[1]
        print("RESULT " + json.dumps({"passed": passed[0]}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    if "--distribute" in sys.argv:
        Accelerator(nprocs=2, cpu=True).distribute(main)()
    else:
        main()
