"""Code written for torchrun by other libraries, run unchanged inside distribute(): a transformers Trainer (its
TrainingArguments made at the top level and inside the function), an Accelerate loop that ends with
``end_training()``, a Lightning Fabric loop and Lightning's Trainer. Each script runs under torchrun (each process
a rank), and under ``python``, where qaccel starts 2 ranks for each of its two distribute() calls; and every run must
be the same training: a world of 2 on every rank, the ranks' shards disjoint in each epoch and covering the data,
equal weights on both ranks, and the same weights and shards under both launchers.

The three scripts run one after another in one process (run_scripts.py runs each as ``python SCRIPT`` would), once
under python, where each of the six distribute() calls starts its ranks afresh, and once under torchrun, where the
processes are the ranks and what a library leaves in them stays for the next code they run: the transformers
script makes the process group at its top (its first TrainingArguments), the Accelerate loop's ``end_training()``
destroys that group, and the calls after it make their own. So two launches serve the three tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support import component
from support.procs import once_per_session, result_lines, run_script, run_torchrun, script_file

pytestmark = pytest.mark.timeout(600)  # the first test waits for both launches
SCRIPTS = {"hf_trainer.py": "transformers", "accelerate_loop.py": "accelerate", "lightning_loops.py": "lightning"}
CALLS = {  # each script's distribute() calls, as its RESULT lines name them
    "hf_trainer.py": ["top_level", "inside"],
    "accelerate_loop.py": [0, 1],
    "lightning_loops.py": ["fabric_loop", "lightning_trainer"],
}


def _launch(tmp_path_factory, how: str) -> dict:
    """The scripts whose library is installed, in one process (under torchrun: in each of its two): the RESULT lines
    of their calls, and the folder that holds each script's OUTPUT_DIR (named by the script's stem)."""
    out = tmp_path_factory.mktemp(how)
    scripts = [script for script, library in SCRIPTS.items() if importlib.util.find_spec(library) is not None]
    run = run_torchrun if how == "torchrun" else run_script
    proc = run(script_file("third_party/run_scripts.py"), str(out), *scripts, cwd=out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    results = result_lines(proc.stdout)
    calls = [call for script in scripts for call in CALLS[script]]
    if how == "torchrun":  # every call once per process; the two processes' lines interleave
        assert sorted(str(r["call"]) for r in results) == sorted(str(call) for call in calls * 2), results
    else:
        assert [r["call"] for r in results] == calls, results
    return {"out": str(out), "results": results}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The scripts under python, run once for all pytest-xdist workers."""
    return once_per_session(tmp_path_factory, "third-party-scripts-plain", lambda: _launch(tmp_path_factory, "python"))


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """The scripts under torchrun, run once for all pytest-xdist workers."""
    return once_per_session(
        tmp_path_factory, "third-party-scripts-torchrun", lambda: _launch(tmp_path_factory, "torchrun")
    )


def _runs(script: str, plain: dict, torchrun: dict) -> tuple[list[dict], list[dict]]:
    """RESULT lines of ``script`` under python (one per call) and under torchrun (one per call and process)."""
    component.installed(SCRIPTS[script])

    def of_script(launch: dict) -> list[dict]:
        return [r for r in launch["results"] if r["call"] in CALLS[script]]

    return of_script(plain), of_script(torchrun)


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


def test_a_transformers_trainer_trains_on_all_ranks_with_its_arguments_made_outside_or_inside(plain, torchrun):
    results, launched = _runs("hf_trainer.py", plain, torchrun)
    _one_training(results, launched, samples=48)
    assert [r["call"] for r in results] == ["top_level", "inside"]
    for result in results:
        assert {r["wrapped"] for r in result["ranks"]} == {"DistributedDataParallel"}
        assert result["ranks"][0]["checkpoints"] == ["checkpoint-12", "checkpoint-6"], "a checkpoint every epoch"


def test_an_accelerate_loop_ending_with_end_training_runs_twice_in_a_process(plain, torchrun):
    results, launched = _runs("accelerate_loop.py", plain, torchrun)
    _one_training(results, launched, samples=32)
    assert {r["wrapped"] for result in results for r in result["ranks"]} == {"DistributedDataParallel"}
    for call in (0, 1):
        saved = Path(plain["out"], "accelerate_loop", f"call_{call}")
        assert sorted(p.name for p in saved.iterdir()) == ["epoch_0", "epoch_1"]


def test_a_lightning_fabric_loop_and_lightnings_trainer_run_on_the_ranks(plain, torchrun):
    results, launched = _runs("lightning_loops.py", plain, torchrun)
    _one_training(results, launched, samples=32)
    saved = Path(plain["out"], "lightning_loops")
    assert sorted(p.name for p in saved.iterdir()) == ["fabric_epoch_0.ckpt", "fabric_epoch_1.ckpt", "trainer"]
    assert [p.name for p in (saved / "trainer" / "checkpoints").iterdir()] == ["epoch=1-step=8.ckpt"]
