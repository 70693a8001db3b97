"""Accelerate's notebook_launcher and debug_launcher from qaccel (qaccel/notebook.py): a notebook written for
Accelerate changes only its import. Run in a real Jupyter kernel the way Accelerate's notebook tutorial does it (a
Dataset class and the training loop in cells, Accelerate's Accelerator made inside the function), and directly."""

from __future__ import annotations

import json
import os

import pytest
from support import component
from support.procs import run_in_kernel

from qaccel import debug_launcher, notebook_launcher

pytestmark = pytest.mark.timeout(180)

CELLS = [
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    from accelerate import Accelerator
    from qaccel import notebook_launcher   # the one line changed: was `from accelerate import notebook_launcher`

    class Line(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return torch.tensor([i / 32]), torch.tensor([2 * i / 32 + 1]), i
    """,
    """
    def training_loop(seed, epochs=2):
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(seed)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(Line(), batch_size=4, shuffle=True, num_workers=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        seen = []
        for epoch in range(epochs):
            for x, y, index in loader:
                with accelerator.autocast():
                    loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                seen += index.tolist()
        return {"world": accelerator.num_processes, "precision": str(accelerator.mixed_precision),
                "seen": accelerator.gather_for_metrics(torch.tensor(seen)).tolist(),
                "weights": [p.item() for p in accelerator.unwrap_model(model).parameters()]}
    """,
    """
    import json
    first = notebook_launcher(training_loop, (0,), num_processes=2, mixed_precision="bf16")
    again = notebook_launcher(training_loop, (0,), num_processes=2, mixed_precision="bf16")
    print("RESULTS " + json.dumps([first, again]))
    """,
]


def test_a_notebook_written_for_accelerate_runs_with_its_import_changed(tmp_path):
    component.installed("accelerate")
    text = run_in_kernel(CELLS, tmp_path, timeout=150)
    first, again = json.loads(next(line for line in text.splitlines() if line.startswith("RESULTS "))[8:])
    assert first["world"] == 2 and first["precision"] == "bf16", "Accelerate's Accelerator saw the launch's settings"
    assert sorted(first["seen"]) == sorted(list(range(32)) * 2), "every sample once per epoch, over both ranks"
    assert again == first, "a second launch from the same kernel trains the same"


def _where(ask_qaccel):
    import torch

    from qaccel import Accelerator

    made = Accelerator() if ask_qaccel else None
    return {
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "use_cpu": os.environ.get("ACCELERATE_USE_CPU"),
        "precision": os.environ.get("ACCELERATE_MIXED_PRECISION"),
        "cuda": torch.cuda.is_available(),
        "qaccel": None if made is None else (made.world_size, str(made.device), made.mixed_precision.value),
    }


def test_the_launchers_tell_an_accelerator_made_in_the_function_their_settings_and_give_the_callers_back():
    before = {
        name: os.environ.get(name)
        for name in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION")
    }
    ranks = notebook_launcher(_where, (True,), num_processes=2, mixed_precision="bf16")
    assert ranks["precision"] == "bf16", "ACCELERATE_MIXED_PRECISION, for Accelerate's Accelerator"
    world, _, precision = ranks["qaccel"]
    assert (world, precision) == (2, "bf16"), "qaccel's Accelerator made without mixed_precision= reads it too"
    debug = debug_launcher(_where, (True,))
    assert (debug["cuda_visible"], debug["use_cpu"], debug["cuda"]) == ("", "yes", False), "CPU only, as Accelerate's"
    assert tuple(debug["qaccel"][:2]) == (2, "cpu")
    after = {name: os.environ.get(name) for name in before}
    assert after == before, "the caller's environment is its own again"


def test_what_notebook_launcher_cannot_do_is_refused_saying_what_to_do():
    with pytest.raises(ValueError, match=r"notebook_launcher\(\) needs num_processes=\.\.\."):
        notebook_launcher(_where, (False,))
    with pytest.raises(
        ValueError,
        match=r"notebook_launcher\(num_nodes=2, node_rank=0\): qaccel starts ranks on this "
        r"machine only; for several nodes run the script under torchrun",
    ):
        notebook_launcher(_where, (False,), num_processes=2, num_nodes=2)
