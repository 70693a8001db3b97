"""acc.progress(): a bar on rank 0 only (tqdm's, or without tqdm a plain status line), the same batches and the same
accumulation steps as the bare loop, over prepared loaders (resumed ones too) and plain iterables."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from support import component
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator
from qaccel.comm.session import RankContext
from qaccel.train import progress

pytestmark = [
    pytest.mark.timeout(120),
    # Under capfd, torch's loggers hold pytest's earlier sys.stderr, which cannot travel to the ranks; they keep their own.
    pytest.mark.filterwarnings("ignore:qaccel. the StreamHandler of logger"),
]

STATUS = r"[\d.]+ it/s, [\d.]+ s"  # the fallback's rate and elapsed time


def _hide_tqdm(monkeypatch):
    for name in ("tqdm", "tqdm.auto"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as if it were not installed


def test_tqdm_draws_the_bar_in_a_single_process(single, capsys):
    tqdm = component.module("tqdm")
    bar = single.progress(range(7), desc="load")
    assert isinstance(bar, tqdm.tqdm)
    assert list(bar) == list(range(7))
    assert re.search(r"load: 100%\|[^\r\n]*\| 7/7 \[", capsys.readouterr().err)


def test_without_tqdm_a_status_line_at_the_end_and_at_most_every_interval(single, monkeypatch, capsys):
    _hide_tqdm(monkeypatch)
    assert list(single.progress(range(7), desc="load", leave=False, ncols=80)) == list(range(7))  # tqdm options ignored
    assert re.fullmatch(rf"load: 7/7 \(100%\), {STATUS}\n", capsys.readouterr().err)

    monkeypatch.setattr(progress, "STATUS_INTERVAL_S", 0.0)
    assert list(single.progress((i for i in range(3)), unit="batch")) == [0, 1, 2]  # no len: a count
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == ["1 batch", "2 batch", "3 batch"]

    monkeypatch.setattr(progress, "STATUS_INTERVAL_S", 3600.0)
    bar = single.progress(range(10), desc="early")
    for i, _ in enumerate(bar):
        bar.set_postfix(loss=0.25, step=i)
        if i == 3:
            break
    assert re.fullmatch(rf"early: 3/10 \(30%\), {STATUS}, loss=0.25, step=3\n", capsys.readouterr().err), (
        "closed at the break: the last line is out before the loop's next statement"
    )


def test_other_ranks_iterate_silently_and_never_import_tqdm(monkeypatch, capsys):
    looked_up = []

    def __getattr__(name):  # a tqdm.auto that records what is taken from it
        looked_up.append(name)
        raise AttributeError(name)

    fake = types.ModuleType("tqdm.auto")
    fake.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "tqdm.auto", fake)
    rank = {r: RankContext(r, r, 0, 2, 2, torch.device("cpu"), "gloo") for r in (0, 1)}
    assert list(progress.progress(range(5), rank[1], desc="quiet")) == list(range(5))
    assert looked_up == [] and capsys.readouterr().err == ""
    assert list(progress.progress(range(5), rank[0], desc="shown")) == list(range(5))
    assert looked_up and capsys.readouterr().err.startswith("shown: 5/5 (100%)"), "the fake tqdm.auto was used"


def _loop(acc, model, loader, desc=None, skip=0):
    """(batch, sync_gradients) of every step of epoch 0, with a bar when ``desc`` is given."""
    loader.set_epoch(0)
    loader.skip_first_batches(skip)
    steps = []
    for (x,) in acc.progress(loader, desc=desc) if desc else loader:
        with acc.accumulate(model):
            steps.append((x.flatten().tolist(), acc.sync_gradients))
    return steps


def _bars_over_a_prepared_loader(acc):
    model = acc.prepare(torch.nn.Linear(1, 1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20.0).unsqueeze(1)), batch_size=2, shuffle=True))
    runs = {
        "bare": _loop(acc, model, loader),
        "tqdm": _loop(acc, model, loader, "tqdm"),
        "bare resumed": _loop(acc, model, loader, skip=2),
        "resumed": _loop(acc, model, loader, "resumed", skip=2),
    }
    for i, _ in enumerate(acc.progress(loader, desc="break")):
        if i == 1:
            break
    acc.print("after the break", file=sys.stderr)
    for name in [m for m in sys.modules if m.split(".")[0] == "tqdm"]:
        sys.modules[name] = None  # from here on, as if tqdm were not installed
    runs["fallback"] = _loop(acc, model, loader, "fallback")
    for i, _ in enumerate(acc.progress(loader, desc="fallback break")):
        if i == 1:
            break
    return runs


def test_rank_0_shows_bars_over_prepared_loaders_and_the_steps_stay_the_same(capfd):
    """A real launch; rank_prefix tells whose lines are whose. 10 batches of 2 over 2 ranks: 5 steps per rank,
    accumulating 2: gradients sync on steps 2, 4 and on the epoch's last step."""
    component.module("tqdm")
    acc = Accelerator(
        nprocs=2,
        compute_setup="cpu",
        gradient_accumulation_steps=2,
        rank_prefix=True,
        timeout=60,
        use_seedable_sampler=True,
    )  # so that set_epoch(0) repeats epoch 0's order
    for runs in acc.distribute(_bars_over_a_prepared_loader, all_results=True)(acc):
        assert [sync for _, sync in runs["bare"]] == [False, True, False, True, True]
        assert runs["tqdm"] == runs["bare"] and runs["fallback"] == runs["bare"]
        assert runs["resumed"] == runs["bare resumed"]
        assert [b for b, _ in runs["resumed"]] == [b for b, _ in runs["bare"]][2:]
    out, err = capfd.readouterr()
    assert "[rank 1]" not in out + err, "rank 1 prints nothing"
    assert re.search(r"\[rank 0\] tqdm: 100%\|[^\r\n]*\| 5/5 \[", err)
    assert re.search(r"\[rank 0\] resumed:  40%\|[^\r\n]*\| 2/5 \[", err), "a resumed epoch's bar starts at 2"
    assert re.search(r"\[rank 0\] resumed: 100%\|[^\r\n]*\| 5/5 \[", err)
    assert re.search(r"\[rank 0\] break:  20%\|[^\r\n]*\| 1/5 \[[^\r\n]*\n\[rank 0\] after the break\n", err), (
        "the bar is closed at the break"
    )
    fallback = re.findall(r"\[rank 0\] fallback: [^\n]*\n", err)
    assert len(fallback) == 1 and re.fullmatch(rf"\[rank 0\] fallback: 5/5 \(100%\), {STATUS}\n", fallback[0]), err
    assert re.search(rf"\[rank 0\] fallback break: 1/5 \(20%\), {STATUS}\n", err)
