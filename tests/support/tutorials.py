"""Running a peer's tutorial page pasted as a script (tests/scripts/<folder>/<page>.py, run as
``python <page>.py <library>``, printing one RESULT line), and the checks its tests share; used by the qadence and
perceptrain tutorial tests."""

from __future__ import annotations

import math
import re
from typing import Any

from .procs import result_lines, run_script, script_env, script_file

RUN_S = 120  # one script's run: the slowest take about 10 s here (two of them fit in a test's timeout)


def run_page(folder: str, page: str, library: str, tmp_path) -> tuple[Any, dict[str, Any], str]:
    """Run ``folder/page.py`` on ``library`` in a folder of its own; (process, its RESULT, its output)."""
    cwd = tmp_path / library
    cwd.mkdir()
    env = script_env(MLFLOW_DISABLE_TELEMETRY="true", MPLBACKEND="Agg")
    env.pop("MLFLOW_TRACKING_URI", None)  # the page's MLflow run goes to the run's folder, not a store of yours
    proc = run_script(script_file(f"{folder}/{page}.py"), library, cwd=cwd, timeout=RUN_S, env=env)
    output = f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    results = result_lines(proc.stdout)
    assert len(results) == 1, f"one RESULT line, printed last:\n{output}"
    assert results[0]["library"] == library
    return proc, results[0], output


def ok(proc, output: str) -> None:
    assert proc.returncode == 0, output


def finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def close(a, b, rel: float = 1e-6) -> bool:
    """Nested lists of numbers equal within ``rel`` (relative, or absolute near 0)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def accelerator_page_trained(proc, result: dict[str, Any], output: str) -> None:
    """The accelerator_doc page (qadence's and perceptrain's, the same) on 2 ranks, 10 epochs: ``distribute``
    returned None, each rank printed every epoch's loss once and it went down, rank 0 alone printed the model."""
    assert result["returned"] == "None" and result["n_epochs"] == 10
    losses: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for rank, epoch, loss in re.findall(
        r"^Rank:\s+(\d+)\s+\| Epoch:\s+(\d+)\s+\| Loss:\s+(\S+)$", proc.stdout, re.MULTILINE
    ):
        assert int(epoch) not in losses[int(rank)], f"rank {rank} printed epoch {epoch} twice:\n{output}"
        losses[int(rank)][int(epoch)] = float(loss)
    for rank, by_epoch in losses.items():
        assert sorted(by_epoch) == list(range(10)), f"rank {rank}:\n{output}"
        assert finite(*by_epoch.values()) and by_epoch[9] < by_epoch[0], (rank, by_epoch)
    assert proc.stdout.count("Prepared model of type:") == 1, "rank 0 only"
