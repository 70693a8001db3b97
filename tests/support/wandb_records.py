"""Offline W&B runs read back with wandb's own reader of a run's transaction log (``wandb leet inspect --json``,
which prints the records of the ``.wandb`` file as JSON lines)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def offline_runs(wandb_dir: Path) -> list[dict[str, Any]]:
    """Every offline run under ``wandb_dir`` (the folder holding ``offline-run-*``), in the order they started:
    {"id", "resume": the run record's resume flag, "config": the config as updated, "history": [row, ...]}. A
    resumed attempt's folder ends with the id and a suffix (``-1``): the id is the run record's."""
    runs = []
    for folder in sorted(Path(wandb_dir).glob("offline-run-*"), key=lambda p: p.stat().st_mtime_ns):
        if not any(folder.glob("run-*.wandb")):  # an init the service refused ("run ID ... is in use") made it
            continue
        done = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        # a process killed within wandb's flush interval (15 s) leaves only the log's header: the id is the folder's
        run: dict[str, Any] = {"id": folder.name.split("-")[-1], "resume": False, "config": {}, "history": []}
        for line in done.stdout.splitlines():
            record = json.loads(line)
            if record.get("type") == "run":
                run["id"], run["resume"] = record["run"]["run_id"], record["run"].get("resume", False)
                run["config"].update(record["run"].get("config", {}).get("update", {}))
            elif record.get("type") == "config":
                run["config"].update(record["config"].get("update", {}))
            elif record.get("type") == "history":
                run["history"].append(record["history"]["item"])
        run["config"].pop("_wandb", None)
        runs.append(run)
    return runs


def curve(run: dict[str, Any], name: str, axis: str = "_step") -> list[tuple[int, Any]]:
    """``name``'s points (``axis`` value, value) in a run's history."""
    return [(row[axis], row[name]) for row in run["history"] if name in row]


@contextlib.contextmanager
def a_wandb_service() -> Iterator[str]:
    """A W&B service owned by another live process (as a notebook kernel that ran ``wandb.init`` owns one): yields
    its ``WANDB_SERVICE`` token, which processes started with it in their environment connect to."""
    code = "import os, sys, wandb; wandb.setup(); print(os.environ['WANDB_SERVICE'], flush=True); sys.stdin.read()"
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        token = owner.stdout.readline().strip()
        assert token.startswith("3-"), f"wandb.setup() printed {token!r}"
        yield token
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)
