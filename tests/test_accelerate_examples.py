"""Accelerate's own examples (huggingface/accelerate, examples/ at commit 16cb6eb8), ported in
tests/scripts/accelerate_examples/ with their imports changed (``accelerate`` to ``qaccel``, the downloads to the
offline stand-ins of standins.py), run the ways their users run them: under ``torchrun --standalone
--nproc-per-node 2`` (gloo on the CPU) and from ``python`` through ``distribute()`` or ``notebook_launcher`` with 2
ranks; and the same files with Accelerate's import put back, under torchrun, where Accelerate is installed.

run.py runs several examples one after another in one launch (each as its ``__main__`` would: ``main()`` with
its command line), which keeps the launches few. Every example prints its metrics per epoch, and the runner a
digest of the trained weights on every rank.

- qaccel under torchrun and from python: the same printed lines and bitwise the same weights (same seed, same
  shuffling order, same DDP training), and the checkpointing example resumed from an epoch's or a step's
  checkpoint ends with the weights of the uninterrupted run.
- qaccel and Accelerate: the examples' files as they are train other weights than under Accelerate, for a reason
  on the "Coming from Accelerate" page: LR schedulers are stepped as Accelerate's only with
  ``step_scheduler_with_optimizer=True``, and these examples size theirs on the unprepared loader. With the
  examples' learning rate (2e-5, 100 warmup steps) the tiny model predicts one class throughout, under both, so
  the printed metrics agree; the weights do not. A diagnostic launch takes that difference out
  (``step_scheduler_with_optimizer=True`` in qaccel's copy): then every example trains bitwise as under
  Accelerate, its loaders shuffled, without the stand-in BERT's dropout and with it, and cv_example with its
  random crops (the loader workers' seeds). A resumed run is the exception, on purpose: qaccel's checkpoint holds
  the shuffling generator's state, so the resumed run goes on in the interrupted run's order (and ends with its
  weights, checked above); Accelerate's draws a new order.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from support import component
from support.procs import once_per_session, run_script, run_torchrun, script_file

RUN = script_file("accelerate_examples/run.py")
PORTS = RUN.parent
PREFIX = re.compile(r"^\[(?:default(\d+)\]:|rank (\d+)\] )(.*)$")
# An example run: (file stem, command line, variables); {pets} is the cv_example's image folder.
MAIN = [
    ("nlp_example", ["--cpu"], {}),
    ("cv_example", ["--cpu", "--data_dir", "{pets}"], {}),
    ("checkpointing", ["--cpu", "--checkpointing_steps", "epoch", "--output_dir", "ck_epoch"], {}),
    ("checkpointing", ["--cpu", "--resume_from_checkpoint", "ck_epoch/epoch_0"], {}),
    ("checkpointing", ["--cpu", "--checkpointing_steps", "4", "--output_dir", "ck_step"], {}),
    ("checkpointing", ["--cpu", "--resume_from_checkpoint", "ck_step/step_4"], {}),
    ("gradient_accumulation", ["--cpu", "--gradient_accumulation_steps", "2"], {}),
    # the stand-in device holds training batches of 8: the example's 16 runs out of memory, the retries go down
    ("memory", ["--cpu"], {"STANDINS_DEVICE_BATCH": "8"}),
    ("multi_process_metrics", ["--cpu"], {}),
    ("early_stopping", ["--cpu"], {}),
    # Accelerate's own file cannot run on the CPU (see the port's header); qaccel's FSDP2 on gloo
    ("fsdp_with_peak_mem_tracking", ["--model_name_or_path", "bert-base-cased"], {}),
    ("profiler", ["--cpu"], {}),  # prints a table of the epoch's timings: only its metrics are compared
    ("ddp_comm_hook", ["--cpu", "--ddp_comm_hook", "fp16"], {}),
]
IDS = [
    "nlp",
    "cv",
    "checkpointing-epoch",
    "resume-epoch_0",
    "checkpointing-steps",
    "resume-step_4",
    "gradient_accumulation",
    "memory",
    "multi_process_metrics",
    "early_stopping",
    "fsdp",
    "profiler",
    "ddp_comm_hook",
]
ON_ACCELERATE = [0, 1, 2, 6, 7, 8, 9, 11, 12]  # its resumes are its own business; fsdp does not run there
NO_DROPOUT = {"STANDINS_NO_DROPOUT": "1"}
DIAGNOSTIC = [
    ("nlp_example", ["--cpu"], NO_DROPOUT),
    ("checkpointing", ["--cpu", "--checkpointing_steps", "epoch", "--output_dir", "ck_epoch"], NO_DROPOUT),
    ("checkpointing", ["--cpu", "--resume_from_checkpoint", "ck_epoch/epoch_0"], NO_DROPOUT),
    ("gradient_accumulation", ["--cpu", "--gradient_accumulation_steps", "2"], NO_DROPOUT),
    ("memory", ["--cpu"], {**NO_DROPOUT, "STANDINS_DEVICE_BATCH": "8"}),
    ("multi_process_metrics", ["--cpu"], NO_DROPOUT),
    ("early_stopping", ["--cpu"], NO_DROPOUT),
    ("nlp_example", ["--cpu"], {}),  # with dropout
    ("cv_example", ["--cpu", "--data_dir", "{pets}"], {}),  # random crops in the loader workers
]


def _compared(run: dict) -> list[str]:
    """The lines of a run that another launch must print alike: all but the profiler's table of timings."""
    if run["example"] == "profiler":
        return [line for line in run["lines"] if line.startswith("epoch ")]
    return run["lines"]


def _accelerates(text: str) -> str:
    """The port with Accelerate's imports back: each changed import line keeps the original after ``# was:``."""
    return re.sub(r"^from (?:qaccel|standins)\S* import .*# (?:.*; )?was: (.*)$", r"\1", text, flags=re.MULTILINE)


def _files(folder: Path, accelerate: bool, diagnostic: bool = False) -> Path:
    """The ported examples, written to ``folder``: as they are, with Accelerate's import, or the diagnostic copy
    (qaccel's with ``step_scheduler_with_optimizer=True``, Accelerate's default)."""
    folder.mkdir(parents=True, exist_ok=True)
    for port in PORTS.glob("*.py"):
        if port.name in ("run.py", "standins.py"):
            continue
        text = port.read_text()
        if diagnostic and not accelerate:
            text = text.replace(
                "accelerator = Accelerator(", "accelerator = Accelerator(step_scheduler_with_optimizer=True, "
            )
        (folder / port.name).write_text(_accelerates(text) if accelerate else text)
    return folder


def _plan(runs, files: Path, pets: Path, out: Path) -> Path:
    plan = [
        {"file": str(files / f"{stem}.py"), "args": [a.format(pets=pets) for a in args], "env": env}
        for stem, args, env in runs
    ]
    path = out / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _examples(stdout: str, count: int) -> list[dict]:
    """Per example run: the lines rank 0 printed, and every rank's weights digest (in rank order)."""
    runs: list[dict] = []
    results: dict[int, list] = {}
    for line in stdout.splitlines():
        match = PREFIX.match(line)
        if match is None:
            continue
        rank, text = int(match[1] or match[2]), match[3]
        if text.startswith("RESULT "):
            results.setdefault(rank, []).append(json.loads(text.split(" ", 1)[1])["weights"])
        elif rank == 0 and text.startswith("EXAMPLE "):
            runs.append({"example": text.split()[1], "lines": []})
        elif rank == 0 and runs:
            runs[-1]["lines"].append(text)
    assert len(runs) == count and all(len(r) == count for r in results.values()), stdout[-3000:]
    for i, run in enumerate(runs):
        run["weights"] = [results[rank][i] for rank in sorted(results)]
    return runs


def _launch(how: str, runs, files: Path, pets: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    plan = _plan(runs, files, pets, out)
    if how == "torchrun":
        proc = run_torchrun(RUN, str(plan), cwd=out, torchrun_args=("--tee", "1"), timeout=300)
    else:
        proc = run_script(RUN, str(plan), f"--{how}", cwd=out, timeout=300)
    assert proc.returncode == 0, f"{how}: " + proc.stdout[-2000:] + proc.stderr[-5000:]
    return _examples(proc.stdout, len(runs))


def _pets(tmp_path_factory) -> Path:
    sys.path.insert(0, str(PORTS))
    try:
        import standins
    finally:
        sys.path.remove(str(PORTS))
    pets = tmp_path_factory.mktemp("pets")
    standins.make_pets(pets)
    return pets


@pytest.fixture(scope="module")
def main_runs(tmp_path_factory):
    """The MAIN examples under qaccel, torchrun and python (distribute), and under Accelerate (torchrun)."""
    component.installed("transformers")

    def compute():
        base = tmp_path_factory.mktemp("main")
        pets = _pets(tmp_path_factory)
        runs = {how: _launch(how, MAIN, PORTS, pets, base / how) for how in ("torchrun", "distribute")}
        runs["accelerate"] = None
        if importlib.util.find_spec("accelerate") is not None:
            files = _files(base / "accelerate_files", accelerate=True)
            runs["accelerate"] = _launch("torchrun", [MAIN[i] for i in ON_ACCELERATE], files, pets, base / "accelerate")
        return runs

    return once_per_session(tmp_path_factory, "accelerate-examples-main", compute)


@pytest.fixture(scope="module")
def diagnostic_runs(tmp_path_factory):
    """The DIAGNOSTIC copies under qaccel and Accelerate, both under torchrun."""
    component.installed("transformers")
    component.installed("accelerate")

    def compute():
        base = tmp_path_factory.mktemp("diagnostic")
        pets = _pets(tmp_path_factory)
        return {
            name: _launch(
                "torchrun", DIAGNOSTIC, _files(base / f"{name}_files", name == "accelerate", True), pets, base / name
            )
            for name in ("qaccel", "accelerate")
        }

    return once_per_session(tmp_path_factory, "accelerate-examples-diagnostic", compute)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(MAIN)), ids=IDS)
def test_an_example_trains_the_same_under_torchrun_and_from_python(main_runs, index):
    torchrun, plain = main_runs["torchrun"][index], main_runs["distribute"][index]
    assert torchrun["example"] == MAIN[index][0]
    assert [line for line in torchrun["lines"] if line.startswith("epoch ")], "metrics printed every epoch"
    assert _compared(plain) == _compared(torchrun), "the same metrics printed"
    assert plain["weights"] == torchrun["weights"], "bitwise the same training"
    if MAIN[index][0] != "fsdp_with_peak_mem_tracking":
        assert len(set(torchrun["weights"])) == 1, "DDP kept the ranks' weights equal"
    else:
        assert "FSDP" in torchrun["lines"] and len(set(torchrun["weights"])) == 2, "each rank holds its shard"


@pytest.mark.timeout(600)
def test_the_checkpointing_example_resumed_from_an_epoch_or_a_step_ends_as_the_uninterrupted_run(main_runs):
    for how in ("torchrun", "distribute"):
        full, from_epoch, steps, from_step = main_runs[how][2:6]
        assert steps == full, "saving every 4 steps trains as saving every epoch"
        assert from_epoch["lines"][0] == "Resumed from checkpoint: ck_epoch/epoch_0"
        assert from_step["lines"][0] == "Resumed from checkpoint: ck_step/step_4"
        epochs = [line for line in full["lines"] if line.startswith("epoch ")]
        for resumed in (from_epoch, from_step):
            assert [line for line in resumed["lines"] if line.startswith("epoch ")] == epochs[1:]
            assert resumed["weights"] == full["weights"], f"{how}: resumed bitwise"


@pytest.mark.timeout(600)
def test_accelerate_prints_the_same_metrics_for_the_examples_as_they_are(main_runs):
    """The files as they are: the weights differ from Accelerate's (documented: the scheduler
    stepping), but the tiny model predicts the one class
    throughout, under both, so every printed line (metrics per epoch, nlp_example's gathered predictions of every
    evaluation step: all 70 samples once) is the same. cv_example's accuracy is not: its classifier learns at
    lr 3e-2, and its schedule is stepped otherwise."""
    if main_runs["accelerate"] is None:
        component.unavailable("accelerate is not installed: it comes with pip install -e '.[test]'")
    for ours, theirs in zip([main_runs["torchrun"][i] for i in ON_ACCELERATE], main_runs["accelerate"]):
        assert ours["example"] == theirs["example"]
        if ours["example"] == "cv_example":
            assert [line.split(":")[0] for line in ours["lines"]] == [line.split(":")[0] for line in theirs["lines"]]
        else:
            assert _compared(ours) == _compared(theirs), ours["example"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [0, 1, 3, 4, 5, 6], ids=[f"{DIAGNOSTIC[i][0]}-{i}" for i in (0, 1, 3, 4, 5, 6)])
def test_without_dropout_an_example_trains_bitwise_as_under_accelerate(diagnostic_runs, index):
    ours, theirs = diagnostic_runs["qaccel"][index], diagnostic_runs["accelerate"][index]
    assert ours["example"] == theirs["example"] == DIAGNOSTIC[index][0]
    assert ours["lines"] == theirs["lines"]
    assert ours["weights"] == theirs["weights"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [7, 8], ids=["nlp_example-dropout", "cv_example-crops"])
def test_with_dropout_or_random_crops_an_example_trains_bitwise_as_under_accelerate(diagnostic_runs, index):
    ours, theirs = diagnostic_runs["qaccel"][index], diagnostic_runs["accelerate"][index]
    assert ours["example"] == theirs["example"] == DIAGNOSTIC[index][0]
    assert ours["weights"] == theirs["weights"]


ALONE = [
    pytest.param(
        "automatic_gradient_accumulation",
        ["--cpu"],
        {"STANDINS_DEVICE_BATCH": "32"},
        id="automatic_gradient_accumulation",
    ),
    pytest.param("schedule_free", ["--cpu"], {}, id="schedule_free"),
    # log_with="all": TensorBoard, MLflow (a file store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE:
    # mlflow-skinny has no SQLite), W&B (offline)
    pytest.param(
        "tracking",
        ["--cpu", "--with_tracking", "--project_dir", "logs"],
        {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "file:./mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"},
        id="tracking",
    ),
]


@pytest.fixture(scope="module")
def alone_runs(tmp_path_factory):
    """The ALONE examples one after another in one launch each: under torchrun, through notebook_launcher, and
    under Accelerate (torchrun) where it is installed."""
    component.installed("transformers")
    component.installed("schedulefree")
    runs = [tuple(param.values) for param in ALONE]

    def compute():
        base = tmp_path_factory.mktemp("alone")
        out = {how: _launch(how, runs, PORTS, base, base / how) for how in ("torchrun", "notebook")}
        out["accelerate"] = None
        if importlib.util.find_spec("accelerate") is not None:
            files = _files(base / "accelerate_files", accelerate=True)
            out["accelerate"] = _launch("torchrun", runs, files, base, base / "accelerate")
        return out

    return once_per_session(tmp_path_factory, "accelerate-examples-alone", compute)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(ALONE)), ids=[param.id for param in ALONE])
def test_an_example_runs_under_torchrun_and_the_notebook_launcher_as_under_accelerate(alone_runs, index):
    """Under torchrun and through notebook_launcher: the same training under qaccel's two launches, the same printed
    metrics as Accelerate's."""
    torchrun, notebook = alone_runs["torchrun"][index], alone_runs["notebook"][index]
    assert torchrun["example"] == notebook["example"] == ALONE[index].values[0]
    epochs = [line for line in torchrun["lines"] if line.startswith("epoch ")]
    assert epochs, "metrics printed every epoch"
    assert [line for line in notebook["lines"] if line.startswith("epoch ")] == epochs
    assert notebook["weights"] == torchrun["weights"] and len(set(torchrun["weights"])) == 1
    component.installed("accelerate")
    theirs = alone_runs["accelerate"][index]
    assert [line for line in theirs["lines"] if line.startswith("epoch ")] == epochs
