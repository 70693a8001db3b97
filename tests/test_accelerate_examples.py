"""Accelerate's own examples (huggingface/accelerate, examples/ at commit 16cb6eb8), ported in
tests/scripts/accelerate_examples/ with their imports changed (``accelerate`` to ``qaccel``, the downloads to the
offline stand-ins of standins.py), run the ways their users run them: under ``torchrun --standalone
--nproc-per-node 2`` (gloo on the CPU) and from ``python`` through ``distribute()`` or ``notebook_launcher`` with 2
ranks; and the same files with Accelerate's import put back, under torchrun, where Accelerate is installed.

run.py runs several examples one after another in one launch (each as its ``__main__`` would: ``main()`` with
its command line), which keeps the launches to four. One torchrun launch runs every qaccel run: the main examples
(MAIN), the three stand-alone ones (ALONE) and the diagnostic copy's runs (below). ``distribute()`` runs MAIN and
``notebook_launcher`` two of ALONE (NOTEBOOK says why not the third): two ways to start the ranks from python,
each compared with the same torchrun runs.
One torchrun launch with Accelerate's import runs MAIN's examples that run there (ON_ACCELERATE) and ALONE. Every
example prints its metrics per epoch, and the runner a digest of the trained weights on every rank.

- qaccel under torchrun and from python: the same printed lines and bitwise the same weights (same seed, same
  shuffling order, same DDP training), and the checkpointing example resumed from an epoch's or a step's
  checkpoint ends with the weights of the uninterrupted run.
- qaccel and Accelerate: the examples' files as they are train other weights than under Accelerate, for a reason
  on the "Coming from Accelerate" page: LR schedulers are stepped as Accelerate's only with
  ``step_scheduler_with_optimizer=True``, and these examples size theirs on the unprepared loader. With the
  examples' learning rate (2e-5, 100 warmup steps) the tiny model predicts one class throughout, under both, so
  the printed metrics agree; the weights do not. The diagnostic copy takes that difference out
  (``step_scheduler_with_optimizer=True`` in qaccel's copy): then every example that runs under Accelerate trains
  bitwise as Accelerate's run of the file as it is, its loaders shuffled, the stand-in BERT's dropout drawn, and
  cv_example's random crops (the loader workers' seeds); the profiler aside, whose training is nlp_example's. A
  resumed run is the exception, on purpose, and is compared only between qaccel's launches: qaccel's checkpoint
  holds the shuffling generator's state, so the resumed run goes on in the interrupted run's order (and ends with
  its weights, checked above); Accelerate's draws a new order.
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
# The diagnostic copy's runs, compared bitwise with Accelerate's: ON_ACCELERATE but the profiler, whose training is
# nlp_example's inside a profiling context (its printed metrics are compared with Accelerate's as the file is)
DIAGNOSTIC = [i for i in ON_ACCELERATE if MAIN[i][0] != "profiler"]


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


def _plan(runs, pets: Path, out: Path) -> Path:
    plan = [
        {"file": str(files / f"{stem}.py"), "args": [a.format(pets=pets) for a in args], "env": env}
        for files, stem, args, env in runs
    ]
    path = out / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _rank_lines(stdout: str) -> list[tuple[int, str]]:
    """Every rank's lines, each whole: torchrun's ``--tee`` tails the ranks' log files and prints what it read,
    prefixed, so a line a rank had written only in part (``print`` writes its arguments one by one) is cut there,
    the rest coming later as a prefixed line of its own, maybe after another rank's line in between."""
    lines: list[tuple[int, str]] = []
    unfinished: dict[int, str] = {}
    pieces = re.split(r"(\[default\d+\]:|\[rank \d+\] )", stdout)
    for marker, text in zip(pieces[1::2], pieces[2::2]):
        rank = int(re.search(r"\d+", marker)[0])
        head, ended, _ = text.partition("\n")  # what follows on other lines has no prefix: not a rank's
        head = unfinished.pop(rank, "") + head
        if ended:
            lines.append((rank, head))
        else:
            unfinished[rank] = head
    return lines + [(rank, rest) for rank, rest in unfinished.items()]


def test_rank_lines_are_put_back_together_where_torchruns_tee_cut_them():
    stdout = (
        "[default0]:EXAMPLE tracking\n[default0]:epoch 2:[default1]:RESULT {}\n[default0]: {'f1': 0.0}\n"
        "a line of no rank\n[default0]:RESULT {}\n"
    )
    assert _rank_lines(stdout) == [
        (0, "EXAMPLE tracking"),
        (1, "RESULT {}"),
        (0, "epoch 2: {'f1': 0.0}"),
        (0, "RESULT {}"),
    ]


def _examples(stdout: str, count: int) -> list[dict]:
    """Per example run: the lines rank 0 printed, and every rank's weights digest (in rank order)."""
    runs: list[dict] = []
    results: dict[int, list] = {}
    for rank, text in _rank_lines(stdout):
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


def _launch(how: str, sections: dict, pets: Path, out: Path, timeout: float = 300) -> dict:
    """One launch of run.py running every section's runs ``(files folder, stem, args, variables)`` in turn; per
    section, its runs' results."""
    runs = [run for section in sections.values() for run in section]
    out.mkdir(parents=True)
    plan = _plan(runs, pets, out)
    if how == "torchrun":
        proc = run_torchrun(RUN, str(plan), cwd=out, torchrun_args=("--tee", "1"), timeout=timeout)
    else:
        proc = run_script(RUN, str(plan), f"--{how}", cwd=out, timeout=timeout)
    assert proc.returncode == 0, f"{how}: " + proc.stdout[-2000:] + proc.stderr[-5000:]
    examples = _examples(proc.stdout, len(runs))
    results, start = {}, 0
    for name, section in sections.items():
        results[name] = examples[start : start + len(section)]
        start += len(section)
    return results


def _in(files: Path, runs) -> list:
    return [(files, *run) for run in runs]


def _pets(tmp_path_factory) -> Path:
    sys.path.insert(0, str(PORTS))
    try:
        import standins
    finally:
        sys.path.remove(str(PORTS))
    pets = tmp_path_factory.mktemp("pets")
    standins.make_pets(pets)
    return pets


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


STAND_ALONE = [tuple(param.values) for param in ALONE]
# Through notebook_launcher: schedule_free and tracking. automatic_gradient_accumulation is the memory example's
# batch-size search with the accumulation set in the loop: the search on ranks started from python runs in MAIN's
# memory example through distribute(), and the accumulation is set alike whatever started the ranks.
NOTEBOOK = [1, 2]


def _accelerate_installed() -> bool:
    return importlib.util.find_spec("accelerate") is not None


@pytest.fixture(scope="module")
def qaccel_torchrun(tmp_path_factory):
    """Every qaccel run under torchrun, in one launch: MAIN, ALONE and, where Accelerate is installed to compare
    with, the diagnostic copy's runs of MAIN's DIAGNOSTIC."""
    component.installed("transformers")
    component.installed("schedulefree")

    def compute():
        base = tmp_path_factory.mktemp("qaccel_torchrun")
        sections = {"main": _in(PORTS, MAIN), "alone": _in(PORTS, STAND_ALONE)}
        if _accelerate_installed():
            diagnostic = _files(base / "diagnostic_files", accelerate=False, diagnostic=True)
            # MAIN's checkpoints stay MAIN's: the diagnostic runs save into folders of their own
            own = [
                (stem, [f"diagnostic_{a}" if a.startswith("ck_") else a for a in args], env) for stem, args, env in MAIN
            ]
            sections["diagnostic"] = _in(diagnostic, [own[i] for i in DIAGNOSTIC])
        return _launch("torchrun", sections, _pets(tmp_path_factory), base / "out", timeout=450)

    return once_per_session(tmp_path_factory, "accelerate-examples-qaccel-torchrun", compute)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """MAIN from python, through distribute()."""
    component.installed("transformers")

    def compute():
        base = tmp_path_factory.mktemp("distribute")
        return _launch("distribute", {"main": _in(PORTS, MAIN)}, _pets(tmp_path_factory), base / "out")["main"]

    return once_per_session(tmp_path_factory, "accelerate-examples-distribute", compute)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """ALONE's NOTEBOOK runs from python, through notebook_launcher."""
    component.installed("transformers")
    component.installed("schedulefree")

    def compute():
        base = tmp_path_factory.mktemp("notebook")
        runs = _in(PORTS, [STAND_ALONE[i] for i in NOTEBOOK])
        return _launch("notebook", {"alone": runs}, base, base / "out")["alone"]

    return once_per_session(tmp_path_factory, "accelerate-examples-notebook", compute)


@pytest.fixture(scope="module")
def on_accelerate(tmp_path_factory):
    """The files with Accelerate's import under torchrun, in one launch: MAIN's ON_ACCELERATE runs and ALONE; None
    where Accelerate is not installed."""
    component.installed("transformers")
    component.installed("schedulefree")

    def compute():
        if not _accelerate_installed():
            return None
        base = tmp_path_factory.mktemp("accelerate")
        files = _files(base / "accelerate_files", accelerate=True)
        sections = {"main": _in(files, [MAIN[i] for i in ON_ACCELERATE]), "alone": _in(files, STAND_ALONE)}
        return _launch("torchrun", sections, _pets(tmp_path_factory), base / "out", timeout=450)

    return once_per_session(tmp_path_factory, "accelerate-examples-accelerate", compute)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(MAIN)), ids=IDS)
def test_an_example_trains_the_same_under_torchrun_and_from_python(qaccel_torchrun, distributed, index):
    torchrun, plain = qaccel_torchrun["main"][index], distributed[index]
    assert torchrun["example"] == MAIN[index][0]
    assert [line for line in torchrun["lines"] if line.startswith("epoch ")], "metrics printed every epoch"
    assert _compared(plain) == _compared(torchrun), "the same metrics printed"
    assert plain["weights"] == torchrun["weights"], "bitwise the same training"
    if MAIN[index][0] != "fsdp_with_peak_mem_tracking":
        assert len(set(torchrun["weights"])) == 1, "DDP kept the ranks' weights equal"
    else:
        assert "FSDP" in torchrun["lines"] and len(set(torchrun["weights"])) == 2, "each rank holds its shard"


@pytest.mark.timeout(600)
def test_the_checkpointing_example_resumed_from_an_epoch_or_a_step_ends_as_the_uninterrupted_run(
    qaccel_torchrun, distributed
):
    for how, runs in (("torchrun", qaccel_torchrun["main"]), ("distribute", distributed)):
        full, from_epoch, steps, from_step = runs[2:6]
        assert steps == full, "saving every 4 steps trains as saving every epoch"
        assert from_epoch["lines"][0] == "Resumed from checkpoint: ck_epoch/epoch_0"
        assert from_step["lines"][0] == "Resumed from checkpoint: ck_step/step_4"
        epochs = [line for line in full["lines"] if line.startswith("epoch ")]
        for resumed in (from_epoch, from_step):
            assert [line for line in resumed["lines"] if line.startswith("epoch ")] == epochs[1:]
            assert resumed["weights"] == full["weights"], f"{how}: resumed bitwise"


def _accelerates_runs(on_accelerate) -> dict:
    if on_accelerate is None:
        component.unavailable("accelerate is not installed: it comes with pip install -e '.[test]'")
    return on_accelerate


@pytest.mark.timeout(600)
def test_accelerate_prints_the_same_metrics_for_the_examples_as_they_are(qaccel_torchrun, on_accelerate):
    """The files as they are: the weights differ from Accelerate's (documented: the scheduler
    stepping), but the tiny model predicts the one class
    throughout, under both, so every printed line (metrics per epoch, nlp_example's gathered predictions of every
    evaluation step: all 70 samples once) is the same. cv_example's accuracy is not: its classifier learns at
    lr 3e-2, and its schedule is stepped otherwise."""
    theirs_all = _accelerates_runs(on_accelerate)["main"]
    for ours, theirs in zip([qaccel_torchrun["main"][i] for i in ON_ACCELERATE], theirs_all, strict=True):
        assert ours["example"] == theirs["example"]
        if ours["example"] == "cv_example":
            assert [line.split(":")[0] for line in ours["lines"]] == [line.split(":")[0] for line in theirs["lines"]]
        else:
            assert _compared(ours) == _compared(theirs), ours["example"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(DIAGNOSTIC)), ids=[IDS[i] for i in DIAGNOSTIC])
def test_with_the_scheduler_stepped_as_accelerates_an_example_trains_bitwise_as_under_accelerate(
    qaccel_torchrun, on_accelerate, index
):
    """The diagnostic copy (step_scheduler_with_optimizer=True) against Accelerate's run of the file as it is: the
    same printed lines and bitwise the same weights, the stand-in BERT's dropout and cv_example's random crops
    (drawn in the loader workers) included."""
    theirs = _accelerates_runs(on_accelerate)["main"][ON_ACCELERATE.index(DIAGNOSTIC[index])]
    ours = qaccel_torchrun["diagnostic"][index]
    assert ours["example"] == theirs["example"] == MAIN[DIAGNOSTIC[index]][0]
    assert ours["lines"] == theirs["lines"]
    assert ours["weights"] == theirs["weights"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(ALONE)), ids=[param.id for param in ALONE])
def test_an_example_runs_under_torchrun_as_under_accelerate(qaccel_torchrun, on_accelerate, index):
    """Under torchrun: metrics printed every epoch, the ranks' weights equal, the same printed metrics as
    Accelerate's."""
    torchrun = qaccel_torchrun["alone"][index]
    assert torchrun["example"] == ALONE[index].values[0]
    epochs = [line for line in torchrun["lines"] if line.startswith("epoch ")]
    assert epochs, "metrics printed every epoch"
    assert len(set(torchrun["weights"])) == 1
    theirs = _accelerates_runs(on_accelerate)["alone"][index]
    assert theirs["example"] == ALONE[index].values[0]
    assert [line for line in theirs["lines"] if line.startswith("epoch ")] == epochs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(NOTEBOOK)), ids=[ALONE[i].id for i in NOTEBOOK])
def test_an_example_trains_the_same_through_the_notebook_launcher_as_under_torchrun(qaccel_torchrun, notebook, index):
    """Through notebook_launcher: the same printed metrics and bitwise the same training as under torchrun."""
    torchrun, launched = qaccel_torchrun["alone"][NOTEBOOK[index]], notebook[index]
    assert torchrun["example"] == launched["example"] == ALONE[NOTEBOOK[index]].values[0]
    epochs = [line for line in torchrun["lines"] if line.startswith("epoch ")]
    assert epochs and [line for line in launched["lines"] if line.startswith("epoch ")] == epochs
    assert launched["weights"] == torchrun["weights"]
