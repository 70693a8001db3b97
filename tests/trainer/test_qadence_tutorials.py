"""qadence's ml_tools tutorials, run as code nobody here wrote: each page's Python blocks that use the Trainer, the
Accelerator, the callbacks or the data helpers, pasted in order into tests/scripts/qadence_tutorials/<page>.py
(qadence 1.11.5, commit 5b6c7d2; each script's docstring lists every change from its page), with the imports
changed to qaccel and qadence's own models. Each script runs in a fresh interpreter on qaccel; where the page is
deterministic (no unseeded RNG, no shuffling, no infinite loader, one world size) it also runs on qadence in the
same test and the two RESULT lines must agree.

Pages that train nothing deterministic (trainer.md, CPU.md, accelerator_doc.md, classification.md: unseeded
models, shuffled or infinite loaders) are checked for what qadence's semantics give: max_iter + 1 epochs, the
loss function called once per batch and validation pass, finite losses that went down, the tracker's files.

Every page runs to its end on qaccel.
The pages qcl.md and dqc_1d.md (docs/tutorials/qml) train with loops of their own and use none of these helpers at
that commit: they have no script.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.component import module
from support.procs import script_file
from support.tutorials import accelerator_page_trained, run_page
from support.tutorials import close as _close
from support.tutorials import finite as _finite
from support.tutorials import ok as _ok

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def qadence():
    """qadence, whose models and types the pages use (about 5 s to import). Importing it sets torch's default
    dtype to float64 for the whole process: put back, for the other tests of this worker."""
    dtype = torch.get_default_dtype()
    try:
        return module("qadence")
    finally:
        torch.set_default_dtype(dtype)


def _run(page: str, library: str, tmp_path):
    """Run the page's script on ``library`` in a folder of its own; (process, its RESULT, its output)."""
    return run_page("qadence_tutorials", page, library, tmp_path)


def _mlflow_run(folder):
    """The only MLflow run in ``folder``'s file store (qaccel's: <run folder>/tracking/mlruns), read as files."""
    runs = [p.parent for p in (folder / "tracking" / "mlruns").glob("*/*/meta.yaml")]
    assert len(runs) == 1, runs
    return runs[0]


def test_trainer_page_trains_as_qadence_says_up_to_its_landscape_analysis(qadence, tmp_path):
    """trainer.md on qaccel: 6.1 (MLflow, checkpoints, plots, the model logged), 6.2 (a QNN fitted with a best
    checkpoint), 6.3 (TrainConfig beside a loop of its own), 6.4's landscape analysis (Trainer.get_ic_grad_bounds,
    computed by qadence's InformationContent) and 6.5's imports (get_writer and data_to_device).

    Not compared with qadence: every fit draws from an infinite loader (qadence orders it with Python's random,
    qaccel with torch's), 6.1's loss is against torch.rand targets, and 6.2 to 6.4 build their models from whatever
    the RNG holds after 6.1. qadence's own run of the page stops at 6.1 here anyway: its MLflow writer's log_model
    fails with MLflow 3.17 (input_example required)."""
    module("mlflow", "mlflow")
    proc, result, output = _run("trainer", "qaccel", tmp_path)
    assert "6.1" in result, output
    first = result["6.1"]  # max_iter=10, an infinite loader: one batch an epoch, epochs 0..10
    assert first["current_epoch"] == first["max_iter"] == 10, output
    assert first["loss_fn_calls"] == 11, "max_iter + 1 epochs of one batch, no validation"
    assert all(_finite(*values) for values in first["params"])
    folder = tmp_path / "qaccel" / first["log_folder"]
    assert any((folder / "checkpoints").iterdir()), "checkpoint_every=1"
    run = _mlflow_run(folder)
    steps = [int(line.split()[2]) for line in (run / "metrics" / "train_loss").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, 11)), "write_every=1: epochs 1..10 (epoch 0 is not written)"
    plots = sorted(p.name for p in (run / "artifacts").glob("ufa_prediction_epoch_*.png"))
    assert plots == sorted(f"ufa_prediction_epoch_{i}.png" for i in (0, 2, 4, 6, 8, 10)), (
        "plot_every=2: at the start and every 2 epochs"
    )
    assert {p.name for p in (run / "params").iterdir()} == {
        "seed",
        "batch_size",
        "n_qubits",
        "ansatz_depth",
        "observable",
    }, "hyperparams logged"
    assert any((run / "artifacts" / "model").iterdir()), "log_model=True"

    fitted = result["6.2"]  # max_iter=100 (cut from 300), val_every=10, checkpoint_best_only
    assert fitted["current_epoch"] == fitted["max_iter"] == 100
    assert _finite(fitted["initial_loss"], fitted["final_loss"])
    assert fitted["final_loss"] < 0.1 * fitted["initial_loss"], fitted
    # validation before training and after every epoch that val_every divides, epoch 0 included: 12 passes, as
    # qadence (the page's own counter of loss_fn calls)
    assert fitted["loss_fn_calls"] == 101 + 12, fitted
    assert (tmp_path / "qaccel" / fitted["log_folder"] / "best").is_dir(), "the best checkpoint"

    assert _finite(result["6.3"]["loss"])

    ela = result["6.4"]
    assert _finite(*ela["bounds"]) and ela["bounds"][0] <= ela["bounds"][1], ela
    assert ela["current_epoch"] == ela["max_iter"] == 100
    assert _finite(ela["initial_loss"], ela["final_loss"]) and ela["final_loss"] < ela["initial_loss"], ela
    assert "6.5" in result, output
    _ok(proc, output)


def test_callbacks_page_makes_the_same_callbacks_as_qadence(qadence, tmp_path):
    """callbacks.md trains nothing: every built-in callback, two custom ones and a Trainer subclass, in configs.
    Each callback's class, stage and frequency, and each config's max_iter, as qadence's."""
    proc, result, output = _run("callbacks", "qaccel", tmp_path)
    _ok(proc, output)
    reference_proc, reference, reference_output = _run("callbacks", "qadence", tmp_path)
    _ok(reference_proc, reference_output)
    assert len(result["configs"]) == 14
    assert {k: v for k, v in result.items() if k != "library"} == {k: v for k, v in reference.items() if k != "library"}


def test_data_and_config_page_gives_qadences_batches_and_configs(qadence, tmp_path):
    """data_and_config.md: the loaders' batches and the configs' fields, as qadence's.

    The standard loader's batches agree within 1e-6: on qadence they are float64 (importing qadence makes float64
    torch's default dtype), on qaccel float32 (the page imports nothing from qadence before them). An infinite
    loader's order is random on both (qadence shuffles with Python's random, qaccel with torch's), and the
    DictDataLoader's points are torch.rand: their structure is compared. The page's
    ``TrainConfig(..., checkpoint_best_only=True)`` without ``val_every`` is accepted, as qadence accepts it (and
    then never saves a best checkpoint), with a warning saying so."""
    proc, result, output = _run("data_and_config", "qaccel", tmp_path)
    reference_proc, reference, reference_output = _run("data_and_config", "qadence", tmp_path)
    _ok(reference_proc, reference_output)

    assert _close(result["standard"], reference["standard"]), (result["standard"], reference["standard"])
    points = sorted(reference["standard"][0][0] + reference["standard"][1][0] + reference["standard"][2][0])
    for batches in (result["infinite"], reference["infinite"]):
        assert len(batches) == 5 and all(len(x) == len(y) == 2 for x, y in batches)
        assert _close(sorted(v for x, _ in batches[:3] for v in x), points), "a first pass sees every point once"
        assert all(_close(y, [math.sin(v) for v in x]) for x, y in batches)
    for dicts in (result["dict"], reference["dict"]):
        assert sorted(dicts) == ["y1", "y2"]
        for (x, y), shape in dicts.values():
            assert shape == [5, 1] and all(0 <= v <= 1 for v in x) and _close(y, [math.sin(v) for v in x])

    # qaccel's Accelerator defaults differ, as its guide says: compute_setup "auto", backend None (qadence: "cpu",
    # "gloo"); the page's last config sets both, and every other field must be qadence's
    def qadence_fields(config):
        return {k: v for k, v in config.items() if k not in ("compute_setup", "backend")}

    assert len(result["configs"]) == len(reference["configs"]) == 6
    assert [qadence_fields(c) for c in result["configs"]] == [qadence_fields(c) for c in reference["configs"]]
    assert result["callback"] == reference["callback"] == ["train_end", 10, 1]
    assert "checkpoint_best_only keeps the best validation, and val_every=0 validates never" in proc.stderr, output
    _ok(proc, output)
    assert result["configs"][-1] == reference["configs"][-1]
    assert result["criterion"] == reference["criterion"] == [True, False]


def _trained(fit: dict, epochs: int) -> None:
    """A fit of epochs 0..``epochs`` whose whole-dataset loss went down, each epoch's training loss recorded."""
    assert fit["current_epoch"] == fit["max_iter"] == epochs, fit
    assert len(fit["train_loss"]) == epochs + 1 and _finite(*fit["train_loss"]), fit
    assert _finite(fit["initial_loss"], fit["loss"]) and fit["loss"] < fit["initial_loss"], fit


def test_cpu_page_trains_in_one_process_and_on_two_ranks(tmp_path):
    """CPU.md on qaccel: the single-process example, then the multi-process one on 2 ranks (the page's 4, cut to
    the 2 cores here), each 5 epochs of SGD on a shuffled loader. Not compared: shuffled (unseeded), and the 2-rank
    run takes a global batch of 32 where the single process takes 16. qaccel's fit() hands the ranks' training back
    to the caller's model: its loss went down."""
    proc, result, output = _run("CPU", "qaccel", tmp_path)
    _ok(proc, output)
    _trained(result["single"], 5)
    _trained(result["multi"], 5)


def test_accelerator_page_trains_on_two_ranks(tmp_path):
    """accelerator_doc.md on qaccel: its training function distributed on 2 ranks (the page's 4, cut to the 2 cores
    here); each rank prints its last batch's loss every epoch. Each rank prints every epoch once and its loss went
    down (the same last batch of 18 samples every epoch: the loader is not shuffled). Not compared with one process:
    the page's batch is a rank's, so the global batch grows with the ranks; nor with qadence: the data is
    torch.randn, unseeded."""
    proc, result, output = _run("accelerator_doc", "qaccel", tmp_path)
    _ok(proc, output)
    accelerator_page_trained(proc, result, output)


def test_classification_page_learns_iris(qadence, tmp_path):
    """classification.md on qaccel: the hybrid QNN (4 qubits, 3 layers, a linear head) trained on Iris with a
    shuffled loader of 5 batches, 50 epochs (cut from 1000), then its test accuracy. Not compared with qadence:
    shuffled, unseeded."""
    module("sklearn")
    proc, result, output = _run("classification", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["current_epoch"] == result["max_iter"] == 50
    assert len(result["train_loss"]) == 51 and _finite(*result["train_loss"])
    assert _finite(result["initial_loss"], result["final_loss"])
    assert result["final_loss"] < result["initial_loss"], result
    assert result["accuracy_test"] > 0.5, "three classes: chance is 1/3 (the page reaches 0.9 in 1000 epochs)"


def test_the_scripts_say_where_they_come_from():
    """Each script names its page, qadence's version and commit, and lists its changes from the page."""
    for page in ("trainer", "callbacks", "data_and_config", "CPU", "accelerator_doc", "classification"):
        text = script_file(f"qadence_tutorials/{page}.py").read_text()
        doc = " ".join(text.split('"""')[1].split())
        assert f"{page}.md" in doc and "qadence 1.11.5" in doc and "5b6c7d2" in doc, page
        assert "Changes from the page:" in doc and "imports:" in doc, page
