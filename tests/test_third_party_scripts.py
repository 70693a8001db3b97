"""Code written for torchrun by other libraries, run unchanged inside distribute(): a transformers Trainer (its
TrainingArguments made at the top level and inside the function), an Accelerate loop that ends with
``end_training()``, a Lightning Fabric loop and Lightning's Trainer. Each script runs under ``python`` (qaccel
starts 2 ranks, two distribute() calls in one process) and under torchrun (each process a rank), and every run must
be the same training: a world of 2 on every rank, the ranks' shards disjoint in each epoch and covering the data,
equal weights on both ranks, and the same weights and shards under both launchers."""

from __future__ import annotations

import pytest
from support import component
from support.procs import result_lines, run_script, run_torchrun, script_file

pytestmark = pytest.mark.timeout(240)


def _runs(script: str, tmp_path) -> tuple[list[dict], list[dict]]:
    """RESULT lines of ``script`` under python (one per call) and under torchrun (one per call and process)."""
    path = script_file(f"third_party/{script}")
    plain = run_script(path, str(tmp_path / "plain"), cwd=tmp_path, timeout=200)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-6000:]
    torchrun = run_torchrun(path, str(tmp_path / "torchrun"), cwd=tmp_path, timeout=200)
    assert torchrun.returncode == 0, torchrun.stdout[-2000:] + torchrun.stderr[-6000:]
    return result_lines(plain.stdout), result_lines(torchrun.stdout)


def _one_training(plain: list[dict], torchrun: list[dict], samples: int, epochs: int = 2) -> None:
    calls = len(plain)
    assert calls == 2 and len(torchrun) == 2 * calls, (plain, torchrun)
    for call, result in enumerate(plain):
        assert [r for r in torchrun if r["call"] == result["call"]] == [result, result], (
            f"call {call}: torchrun's processes trained what the plain launch trained"
        )
        ranks = result["ranks"]
        assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)], "one world of 2, seen by the library"
        assert ranks[0]["weights"] == ranks[1]["weights"], "DDP kept the ranks' weights equal"
        per_epoch = samples // 2
        for epoch in range(epochs):
            shards = [set(r["seen"][epoch * per_epoch : (epoch + 1) * per_epoch]) for r in ranks]
            assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(samples)), (
                f"call {call}, epoch {epoch}: each rank trained on its own half of the data"
            )
    assert plain[0]["ranks"][0]["weights"] == plain[1]["ranks"][0]["weights"], "both calls trained the same model"


def test_a_transformers_trainer_trains_on_all_ranks_with_its_arguments_made_outside_or_inside(tmp_path):
    component.installed("transformers")
    plain, torchrun = _runs("hf_trainer.py", tmp_path)
    _one_training(plain, torchrun, samples=48)
    assert [r["call"] for r in plain] == ["top_level", "inside"]
    for result in plain:
        assert {r["wrapped"] for r in result["ranks"]} == {"DistributedDataParallel"}
        assert result["ranks"][0]["checkpoints"] == ["checkpoint-12", "checkpoint-6"], "a checkpoint every epoch"


def test_an_accelerate_loop_ending_with_end_training_runs_twice_in_a_process(tmp_path):
    component.installed("accelerate")
    plain, torchrun = _runs("accelerate_loop.py", tmp_path)
    _one_training(plain, torchrun, samples=32)
    assert {r["wrapped"] for result in plain for r in result["ranks"]} == {"DistributedDataParallel"}
    for call in (0, 1):
        assert sorted(p.name for p in (tmp_path / "plain" / f"call_{call}").iterdir()) == ["epoch_0", "epoch_1"]


def test_a_lightning_fabric_loop_and_lightnings_trainer_run_on_the_ranks(tmp_path):
    component.installed("lightning")
    plain, torchrun = _runs("lightning_loops.py", tmp_path)
    _one_training(plain, torchrun, samples=32)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        "fabric_epoch_0.ckpt",
        "fabric_epoch_1.ckpt",
        "trainer",
    ]
    assert [p.name for p in (tmp_path / "plain" / "trainer" / "checkpoints").iterdir()] == ["epoch=1-step=8.ckpt"]
