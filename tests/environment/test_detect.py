"""detect(): the first of the launchers that finds a rank decides; a process with no launcher's variables is plain."""

from __future__ import annotations

import os

import pytest
from support.launcher_variables import SRUN_TWO_NODES, TORCHRUN

from qaccel.environment import Environment, detect


def test_empty_environment_is_plain() -> None:
    env = detect({})
    assert env == Environment(kind="plain")
    assert env.is_launched is False
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (0, 1, None, None)


def test_torchrun_wins_over_slurm() -> None:
    env = detect({**SRUN_TWO_NODES, **TORCHRUN})
    assert env.kind == "torchrun"
    assert env.rank == 5


@pytest.mark.parametrize(
    ("environ", "name", "value"),
    [
        ({**SRUN_TWO_NODES, "SLURM_PROCID": "x"}, "SLURM_PROCID", "x"),
        ({**SRUN_TWO_NODES, "SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS", "four"),
        ({**SRUN_TWO_NODES, "MASTER_PORT": "http"}, "MASTER_PORT", "http"),
        ({**SRUN_TWO_NODES, "SLURM_NODEID": ""}, "SLURM_NODEID", ""),
        ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE", "8.0"),
        ({**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK", "one"),
    ],
)
def test_bad_integer_names_variable_and_value(environ: dict[str, str], name: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}='{value}' is not an integer$"):
        detect(environ)


def test_detect_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert detect().kind == "torchrun"
    assert detect().world_size == 8


def test_a_single_mpi_process_or_a_stray_variable_is_no_rank():
    assert detect({"PMI_RANK": "0", "PMI_SIZE": "1"}).kind == "plain", "mpirun -np 1: a plain process"
    assert detect({"PMI_RANK": "0"}).kind == "plain"
    assert detect({"RANK": "1", "WORLD_SIZE": "2"}).kind == "plain", "a leftover RANK, no rendezvous"
    assert detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}).kind == "plain"
    qaccel_rank = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "5",
        "QACCEL_RANK_OF": "9",
    }
    assert detect(qaccel_rank).kind == "plain", "a process a qaccel rank started"
    elastic = {"TORCHELASTIC_RUN_ID": "qaccel-run-ab12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert detect({**qaccel_rank, **elastic}).kind == "plain", "a qaccel rank's torchrun variables are no torchrun's"
    inside = {**qaccel_rank, **elastic, "TORCHELASTIC_RUN_ID": "none"}
    assert detect(inside).kind == "torchrun", "a torchrun a qaccel rank started: its workers are torchrun's"
    assert detect({"JSM_NAMESPACE_RANK": "0", "JSM_NAMESPACE_SIZE": "1"}).kind == "plain"


def test_every_launcher_kind_runs_in_place_and_exports_torchruns_variables():
    from qaccel.environment import DETECTORS, Kind

    assert [detector.kind for detector in DETECTORS] == [
        "initialized",
        "torchrun",
        "slurm",
        "mpi",
        "lsf",
        "flux",
        "env",
    ]
    for kind in ("mpi", "lsf", "flux", "env"):
        assert Kind(kind).started_by_launcher and Kind(kind).exports_rank_variables and not Kind(kind).creates_processes
