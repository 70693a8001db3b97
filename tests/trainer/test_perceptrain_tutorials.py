"""perceptrain's tutorials, run as code nobody here wrote: each page's Python blocks that use the Trainer, the
Accelerator, the callbacks or the data helpers, pasted in order into tests/scripts/perceptrain_tutorials/<page>.py
(perceptrain 0.1.0, commit 2ef328a; each script's docstring lists every change from its page), with the imports
changed to qaccel.perceptrain (perceptrain's models and ``perceptrain.types`` stay perceptrain's, qadence's QNN stays
qadence's). Each script runs in a fresh interpreter on qaccel. Where what the page makes depends on the library
(config defaults, callback classes, a loader's batches) it also runs on perceptrain in the same test and the two
RESULT lines must agree; where the RESULT line only repeats the page's own arguments and defaults config.md's test
compares (CPU.md, custom.md, trainer_callbacks.md, gradient.md, hooks.md, tracking.md) it is checked against them,
without the 6 s that importing perceptrain costs.

Pages whose training is not deterministic (single_cpu.md, multi_cpu.md, accelerator_doc.md, examples.md: unseeded
models, shuffled or infinite loaders, torch.randn data) are checked for what perceptrain's semantics give: max_iter
+ 1 epochs, the loss function called once per batch and validation pass, losses that went down.

Pages without a script: distributed/intro.md and GPU.md (configs made for GPUs, ``backend="nccl"``, which qaccel
refuses without CUDA; intro.md's Trainer block uses a model, optimizer and loader it never defines),
single_gpu.md, multi_gpu.md and multinode_gpu.md (a GPU, and SLURM for the last two); training/intro.md and
loss.md (their Trainer blocks start from ``model = ...``, a placeholder; loss.md's one runnable block defines a
loss function and imports nothing of perceptrain); callbacks/intro.md and dataconfig/intro.md (no code);
dataconfig/tracking.md (shell commands only).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
from support import component
from support.procs import script_file
from support.tutorials import accelerator_page_trained, run_page
from support.tutorials import close as _close
from support.tutorials import finite as _finite
from support.tutorials import ok as _ok

pytestmark = pytest.mark.timeout(300)

PAGES = (
    "single_cpu",
    "multi_cpu",
    "CPU",
    "accelerator_doc",
    "default",
    "custom",
    "trainer_callbacks",
    "gradient",
    "hooks",
    "tracking",
    "examples",
    "config",
    "data",
)
ALIASES = {"PlotMetrics": "WritePlots"}  # qaccel's class, under perceptrain's name too (docs/guides/trainer.md)


@pytest.fixture(scope="module")
def perceptrain() -> None:
    """perceptrain, which some scripts run on and others import a model or a type from; installed without its
    dependencies, which pin another pyqtorch than qadence's (docs/contributing.md)."""
    if importlib.util.find_spec("perceptrain") is None:
        component.unavailable(
            "perceptrain is not installed: pip install --no-deps perceptrain==0.1.0 (docs/contributing.md)"
        )


def _run(page: str, library: str, tmp_path):
    """Run the page's script on ``library`` in a folder of its own; (process, its RESULT, its output)."""
    return run_page("perceptrain_tutorials", page, library, tmp_path)


def _trained(fit: dict, epochs: int) -> None:
    """A fit of epochs 0..``epochs`` whose whole-dataset loss went down, each epoch's training loss recorded."""
    assert fit["current_epoch"] == fit["max_iter"] == epochs, fit
    assert len(fit["train_loss"]) == epochs + 1 and _finite(*fit["train_loss"]), fit
    assert _finite(fit["initial_loss"], fit["loss"]) and fit["loss"] < fit["initial_loss"], fit


def test_single_cpu_page_trains_in_one_process(tmp_path):
    """single_cpu.md on qaccel: 5 epochs of SGD on a shuffled loader of 7 batches. Not compared: shuffled and
    unseeded."""
    proc, result, output = _run("single_cpu", "qaccel", tmp_path)
    _ok(proc, output)
    _trained(result, 5)


@pytest.mark.timeout(200)
def test_multi_cpu_page_trains_on_two_ranks(tmp_path):
    """multi_cpu.md on qaccel: the page's example on 2 ranks (the page's 4, cut to the 2 cores here), 5 epochs of
    SGD. qaccel's fit() hands the ranks' training back to the caller's model: its loss went down."""
    proc, result, output = _run("multi_cpu", "qaccel", tmp_path)
    _ok(proc, output)
    _trained(result, 5)
    assert output.count("epoch 5: train_loss") == 1, "print_every=1: rank 0 prints each epoch once"


def test_cpu_page_makes_its_configs(tmp_path):
    """CPU.md's two configs: the page's fields, the others at the defaults perceptrain's have (config.md's test
    compares those with perceptrain's own) but the backend left to choose: qaccel's default backend is None (gloo
    on CPUs), perceptrain's "gloo", as docs/guides/qadence.md says."""
    proc, result, output = _run("CPU", "qaccel", tmp_path)
    _ok(proc, output)
    defaults = {"compute_setup": "cpu", "nprocs": 1, "max_iter": 10000, "log_setup": "cpu", "all_reduce_metrics": False}
    assert result["configs"] == [{**defaults, "backend": None}, {**defaults, "backend": "gloo", "nprocs": 4}]


@pytest.mark.timeout(200)
def test_accelerator_page_trains_on_two_ranks(tmp_path):
    """accelerator_doc.md on qaccel: its training function distributed on 2 ranks (the page's 4); each rank prints
    its last batch's loss every epoch. Each rank prints every epoch once and its loss went down (the same last
    batch every epoch: the loader is not shuffled). Not compared with perceptrain: the data is torch.randn,
    unseeded."""
    proc, result, output = _run("accelerator_doc", "qaccel", tmp_path)
    _ok(proc, output)
    accelerator_page_trained(proc, result, output)


def test_default_callbacks_page_makes_perceptrains_callbacks(perceptrain, tmp_path):
    """default.md trains nothing: each built-in callback in a config. Each callback's class (``WritePlots`` is
    qaccel's ``PlotMetrics``), stage and frequency, and each config's max_iter, as perceptrain's; the last block
    makes an ``R3Sampling`` callback from an ``R3Dataset``."""
    proc, result, output = _run("default", "qaccel", tmp_path)
    reference_proc, reference, reference_output = _run("default", "perceptrain", tmp_path)
    _ok(reference_proc, reference_output)
    configs = [
        {**c, "callbacks": [[ALIASES.get(name, name), *rest] for name, *rest in c["callbacks"]]}
        for c in result["configs"]
    ]
    _ok(proc, output)
    assert len(reference["configs"]) == 16
    assert configs == reference["configs"]
    assert result["arrange"] == reference["arrange"]


def test_custom_callbacks_page_makes_its_two_callbacks(tmp_path):
    """custom.md: a callback from a function and one from a subclass, with the page's stage and frequency (the
    function's: perceptrain's default, 1), each printing its line when run."""
    proc, result, output = _run("custom", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["example_1"] == ["Callback", "train_end", 1, "Executing custom callback.\n"]
    assert result["example_2"] == ["CustomCallback", "train_batch_end", 10, "Custom behavior in run_callback method.\n"]


def test_trainer_callbacks_page_makes_its_config_and_trainer_subclass(tmp_path):
    """trainer_callbacks.md: a config with two callbacks, and a subclass of ``qaccel.perceptrain.trainer.Trainer``
    (not made: the page only defines it)."""
    proc, result, output = _run("trainer_callbacks", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["config"] == {
        "max_iter": 10000,
        "callbacks": [["SaveCheckpoint", "val_epoch_end", 50], ["PrintMetrics", "train_epoch_end", 100]],
    }
    assert result["custom_trainer"] == ["CustomTrainer", "Trainer"]
    assert result["custom_trainer_module"] == "qaccel.perceptrain.trainer"


def test_gradient_page_switches_every_new_trainer(tmp_path):
    """gradient.md: after ``Trainer.set_use_grad(True)`` a Trainer made then trains with gradients, after
    ``set_use_grad(False)`` without."""
    proc, result, output = _run("gradient", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["use_grad"] == [True, False]


def test_hooks_page_subclasses_the_trainer(tmp_path):
    """hooks.md: the training hooks the page lists exist, and its subclass overrides ``on_train_epoch_end``."""
    proc, result, output = _run("hooks", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["custom_trainer"] == ["CustomTrainer", "Trainer"]
    assert len(result["hooks"]) == 6 and result["overridden"] == ["on_train_epoch_end"]


def test_tracking_page_takes_perceptrains_tracking_tools(perceptrain, tmp_path):
    """tracking.md: qaccel's TrainConfig takes perceptrain's ``ExperimentTrackingTool`` members."""
    proc, result, output = _run("tracking", "qaccel", tmp_path)
    _ok(proc, output)
    assert result["configs"] == [[100, "tensorboard"], [100, "mlflow"]]


def test_examples_page_fits_a_qnn_with_a_best_checkpoint(perceptrain, tmp_path):
    """examples.md on qaccel: example 2 fits qadence's QNN (4 qubits, 30 epochs cut from 300) from an infinite
    loader, validating every 10 epochs and keeping the best checkpoint; example 4's imports. Not compared with
    perceptrain: the QNN's parameters are unseeded, and the infinite loaders are ordered by each library's own
    RNG."""
    component.installed("qadence")
    proc, result, output = _run("examples", "qaccel", tmp_path)
    fitted = result["2"]
    assert fitted["current_epoch"] == fitted["max_iter"] == 30, output
    assert _finite(fitted["initial_loss"], fitted["final_loss"]) and fitted["final_loss"] < fitted["initial_loss"]
    # validation before training and after every epoch that val_every divides, epoch 0 included: 5 passes, as on
    # perceptrain (the page's own counter of loss_fn calls)
    assert fitted["loss_fn_calls"] == 31 + 5, fitted
    assert "best" in fitted["entries"], "checkpoint_best_only with val_every: the best checkpoint"
    assert result.get("4") == "imported", f"example 4's imports:\n{output}"
    _ok(proc, output)


def test_config_page_gives_perceptrains_configs(perceptrain, tmp_path):
    """config.md: the configs' fields and the custom callback's, as perceptrain's, but for the Accelerator's
    defaults, which differ as docs/guides/qadence.md says: compute_setup "auto" and backend None (perceptrain:
    "cpu", "gloo"); the page's last config sets both, and must be perceptrain's whole. Its
    ``checkpoint_best_only=True`` without ``val_every`` is accepted with a warning saying no best checkpoint will
    be saved (perceptrain accepts it silently, and then saves none)."""
    proc, result, output = _run("config", "qaccel", tmp_path)
    _ok(proc, output)
    reference_proc, reference, reference_output = _run("config", "perceptrain", tmp_path)
    _ok(reference_proc, reference_output)

    def fields(config):
        return {k: v for k, v in config.items() if k not in ("compute_setup", "backend")}

    assert len(result["configs"]) == len(reference["configs"]) == 6
    assert [fields(c) for c in result["configs"]] == [fields(c) for c in reference["configs"]]
    assert result["configs"][-1] == reference["configs"][-1]
    assert result["callback"] == reference["callback"] == ["train_end", 10, 1]
    assert result["criterion"] == reference["criterion"] == [True, False]
    assert "checkpoint_best_only keeps the best validation, and val_every=0 validates never" in proc.stderr, output


def test_data_page_gives_perceptrains_batches(perceptrain, tmp_path):
    """data.md: the loaders' batches, as perceptrain's. The standard loader's batches agree within 1e-6: on
    perceptrain they are float64 (importing perceptrain makes float64 torch's default dtype), on qaccel float32.
    An infinite loader's order is random on both (perceptrain shuffles with Python's random, qaccel with torch's),
    and the DictDataLoader's points are torch.rand: their structure is compared."""
    proc, result, output = _run("data", "qaccel", tmp_path)
    _ok(proc, output)
    reference_proc, reference, reference_output = _run("data", "perceptrain", tmp_path)
    _ok(reference_proc, reference_output)

    assert _close(result["standard"], reference["standard"]), (result["standard"], reference["standard"])
    points = sorted(v for x, _ in reference["standard"] for v in x)
    for batches in (result["infinite"], reference["infinite"]):
        assert len(batches) == 5 and all(len(x) == len(y) == 2 for x, y in batches)
        assert _close(sorted(v for x, _ in batches[:3] for v in x), points), "a first pass sees every point once"
        assert all(_close(y, [math.sin(v) for v in x]) for x, y in batches)
    for dicts in (result["dict"], reference["dict"]):
        assert sorted(dicts) == ["y1", "y2"]
        for (x, y), shape in dicts.values():
            assert shape == [5, 1] and all(0 <= v <= 1 for v in x) and _close(y, [math.sin(v) for v in x])


def test_the_scripts_say_where_they_come_from():
    """Each script names its page, perceptrain's version and commit, and lists its changes from the page."""
    for page in PAGES:
        text = script_file(f"perceptrain_tutorials/{page}.py").read_text()
        doc = " ".join(text.split('"""')[1].split())
        assert f"{page}.md" in doc and "perceptrain 0.1.0" in doc and "2ef328a" in doc, page
        assert "Changes from the page:" in doc and "imports:" in doc, page
