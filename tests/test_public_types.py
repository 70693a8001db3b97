"""What a type checker and an IDE see of the public API: pyright (what VS Code's Pylance runs) on a user's script
reports a wrong option type, an unknown option, a value outside a closed set and an unknown member, and nothing in a
correct script (callbacks written as qadence's, annotated with the Trainer and TrainConfig, included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
import torch
from qaccel import Accelerator, TrainConfig, Trainer
from qaccel.callbacks import Callback


class Show(Callback):  # qadence's override, its parameters annotated with the classes a callback is handed
    def run_callback(self, trainer: Trainer, config: TrainConfig, writer) -> None:
        print(trainer.current_epoch, config.max_iter)


def show(trainer: Trainer, config: TrainConfig, writer) -> None:
    print(trainer.global_step)


CALLBACKS = [Show(on="train_epoch_end"), Callback(on="train_end", callback=show)]


def train(acc: Accelerator, width: int) -> float:
    model = torch.nn.Linear(width, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc.all_reduce_dict({"loss": 1.0})["loss"]


if __name__ == "__main__":
    acc = Accelerator(2, "cpu", timeout=60, strategy="fsdp", mixed_precision="bf16", project_dir="runs")
    result: float = acc.distribute(train)(acc, 4)
    print(acc.world_size, acc.device, acc.is_main_process, result)
"""

BAD = {  # line: what pyright must say about it
    'Accelerator(nprocs="four")': 'cannot be assigned to parameter "nprocs" of type "int"',
    "Accelerator(no_such_option=1)": 'parameter "no_such_option" of type "Never"',
    'Accelerator(compute_setup="tpu")': 'parameter "compute_setup"',
    "Accelerator().no_such_method()": 'Cannot access attribute "no_such_method" for class "Accelerator"',
}


def _pyright(tmp_path: Path, **scripts: str) -> list[tuple[str, int, str]]:
    """(file, line, message) of each error pyright reports on ``scripts``, qaccel read from this checkout."""
    pyright = shutil.which("pyright")
    if pyright is None:
        pytest.fail("pyright is a test dependency (pip install -e '.[test]')")
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(ROOT)]}))
    run = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, *(f"{n}.py" for n in scripts)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = json.loads(run.stdout)
    return [
        (Path(d["file"]).stem, d["range"]["start"]["line"] + 1, d["message"])
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]


def test_pyright_reports_a_users_mistakes_and_nothing_in_a_correct_script(tmp_path):
    bad = "from qaccel import Accelerator\n" + "\n".join(BAD)
    errors = _pyright(tmp_path, good=GOOD, bad=bad)
    assert [e for e in errors if e[0] == "good"] == [], "a correct script reports nothing"
    found = {line: message for file, line, message in errors if file == "bad"}
    assert sorted(found) == list(range(2, 2 + len(BAD))), errors
    for (code, said), line in zip(BAD.items(), range(2, 2 + len(BAD))):
        assert said in found[line], (code, found[line])


def test_the_package_says_it_is_typed():
    assert (ROOT / "qaccel" / "py.typed").is_file()
    assert "qaccel = py.typed" in (ROOT / "setup.cfg").read_text(), "installed with the package"
