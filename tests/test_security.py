"""What docs/security.md promises, tried for real by a second unix account (tests/support/other_user.py) against
runs of this account: another local user can neither stop, read nor steer a run, nor make it run their code."""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import other_user
from support.procs import marked_pids, result_lines, script_env, script_file, signal_when, torchrun_cmd
from support.states import Counter

from qaccel import Accelerator, CheckpointError
from qaccel.trainer import saveload

pytestmark = [pytest.mark.other_user, pytest.mark.timeout(180)]

ATTACKED = script_file("attacked_run.py")
SECRET = "sk-attacked-run-0123456789"


def _open_to_all(path: Path) -> Path:
    """``path``, a folder, made writable by every user (sticky, as /tmp: each may remove only their own entries)."""
    path.mkdir(parents=True, exist_ok=True)
    for folder in [path, *path.parents]:
        if folder == Path("/"):
            break
        folder.chmod(folder.stat().st_mode | 0o011)  # searchable by all, on the way down
    path.chmod(0o1777)
    return path


def _attacked(cmd: list[str], tmp_path: Path, attack, env: dict | None = None):
    """Run ``cmd`` (attacked_run.py) until its ranks wait at their first step, ``attack(port)`` meanwhile, then let
    them go on; the finished run, with the attack's result as ``.attack``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    release, found = tmp_path / "release", {}

    def attack_then_release(_signal) -> None:
        ready = (tmp_path / "signalled.err").read_text()
        found["attack"] = attack(ready.split("READY ", 1)[1].split()[0])
        release.touch()

    done = signal_when(
        [*cmd, str(tmp_path / "ckpt"), str(release)],
        0,
        "READY ",
        env=env or script_env(),
        cwd=tmp_path,
        timeout=180,
        send=attack_then_release,
    )
    done.attack = found.get("attack")
    return done


def _store_values(dump: dict) -> str:
    return " ".join(base64.b64decode(v).decode("latin-1") for v in dump.values() if not v.startswith("<"))


def _unharmed(done) -> dict:
    """The run finished as if no one had touched it: every step taken, no stop, its result."""
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = result_lines(done.stdout)
    assert result["steps"] == 8, result
    assert "Preempted" not in done.stderr and "where rank" not in done.stderr, done.stderr
    return result


def test_the_second_account_holds_no_privilege():
    me = other_user.run("whoami")
    assert me["uid"] == me["euid"] == other_user.ids()[0] != 0
    assert me["groups"] == [] and not me["root_readable"]


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_another_user_on_the_rendezvous_store_can_neither_stop_nor_read_nor_steer_the_run(launcher, tmp_path):
    if launcher == "python":
        cmd = [sys.executable, str(ATTACKED)]
    else:
        cmd = [*torchrun_cmd(tmp_path / "logs", "--standalone", "--nproc_per_node", "2"), str(ATTACKED)]
    done = _attacked(cmd, tmp_path, lambda port: other_user.run("store", port, "2"))
    _unharmed(done)
    seen = _store_values(done.attack["before"]) + _store_values(done.attack["after"])
    assert SECRET not in seen and "attacked_run" not in seen, "the store told another user where the ranks were"
    if launcher == "torchrun":  # the stranger's keys reached the ranks, and were refused
        assert done.attack["done"], done.attack
        assert done.stderr.count("not written by this run") == 2, done.stderr  # once per rank
    else:  # a plain launch's ranks meet in a store no other user can open: nothing of theirs is there
        assert not [k for k in done.attack["before"] if "qaccel" in k], done.attack["before"]


def test_a_umask_set_after_the_accelerator_reaches_the_ranks_and_their_files(tmp_path):
    done = _attacked([sys.executable, str(ATTACKED), "--umask", "077"], tmp_path, lambda port: None)
    result = _unharmed(done)
    modes = result["modes"]
    assert modes and all(mode in ("0o600", "0o700") for mode in modes.values()), modes
    checkpoint = tmp_path / "ckpt"
    _open_to_all(tmp_path)  # even with every folder above open, the files stay the user's
    newest = max(checkpoint.iterdir())
    assert other_user.run("read", str(newest / "model_0.pt")) == {"error": "EACCES"}


def test_no_secret_of_the_environment_reaches_output_or_files_also_when_a_rank_fails(tmp_path):
    secrets = {"WANDB_API_KEY": "wandb-0123456789abcdef", "HF_TOKEN": "hf_0123456789abcdef"}
    env = script_env(**secrets)
    ok = _attacked([sys.executable, str(ATTACKED)], tmp_path / "ok", lambda port: None, env=env)
    _unharmed(ok)
    failed = _attacked([sys.executable, str(ATTACKED), "--fail"], tmp_path / "failed", lambda port: None, env=env)
    assert failed.returncode == 1 and "rank 1 fails on purpose" in failed.stderr, failed.stderr
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("signalled.")]
    assert written, "the runs wrote their checkpoints"
    for value in secrets.values():
        for done in (ok, failed):
            assert value not in done.stdout + done.stderr
        assert not [data for data in written if value.encode() in data]


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # /proc/net/tcp*


def _listening(pids: list[int]) -> set[str]:
    """The local addresses (as /proc/net/tcp and tcp6 write them) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                if (target := os.readlink(fd)).startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].split(":")[0])
    return found


def test_a_launch_listens_on_loopback_only_and_its_forkserver_socket_stays_private(tmp_path):
    mark = f"QACCEL_TEST_MARK_{os.getpid()}_{tmp_path.name}"

    def look(port: str) -> dict:
        return {**other_user.run("sockets"), "listening": sorted(_listening(marked_pids(mark)))}

    done = _attacked([sys.executable, str(ATTACKED)], tmp_path, look, env=script_env(**{mark: "1"}))
    _unharmed(done)
    sockets = done.attack["sockets"]
    assert sockets and "connected" not in sockets.values(), sockets
    assert done.attack["listening"] and set(done.attack["listening"]) <= LOOPBACK, done.attack["listening"]


def test_a_run_root_another_user_squatted_costs_nothing(tmp_path):
    shared = _open_to_all(tmp_path / "shared")
    squatted = other_user.run("squat", str(shared), str(os.getuid()))["made"]
    done = subprocess.run(
        [sys.executable, str(script_file("rank_sum.py")), "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=script_env(TMPDIR=str(shared)),
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0 and "sum 3" in done.stdout, done.stdout + done.stderr
    other = other_user.ids()[0]
    for path in squatted:  # left as the other user made them
        assert os.lstat(path).st_uid == other and os.listdir(path) == []
    mine = [p for p in shared.iterdir() if p.stat().st_uid == os.getuid()]
    assert not [p for p in mine if p.name.startswith("qaccel-runs")], "a fallback run root left behind"


def _saved(acc, ckpt: Path, register: bool) -> None:
    def save(acc, ckpt, register):
        acc.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
        if register:
            acc.register_for_checkpointing(Counter())
        acc.save_state(ckpt)

    acc.distribute(save)(acc, str(ckpt), register)


def _load(acc, ckpt: Path, register: bool):
    def load(acc, ckpt, register):
        acc.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
        if register:
            acc.register_for_checkpointing(Counter())
        return acc.load_state(ckpt)

    return acc.distribute(load)(acc, str(ckpt), register)


def test_a_file_another_user_planted_in_a_checkpoint_is_never_unpickled(acc, tmp_path):
    """On every rank: each reads the checkpoint, and all raise the same error."""
    ckpt = _open_to_all(tmp_path / "open") / "ckpt"
    _saved(acc, ckpt, register=False)
    ckpt.chmod(0o777)
    proof = tmp_path / "proof"
    other_user.run("plant", str(ckpt / "registered_0.pt"), str(proof))
    assert _load(acc, ckpt, register=False) == str(ckpt)  # nothing registered: the stray file is not read
    assert not proof.exists(), "loading a checkpoint ran another user's code"

    other_user.run("list", str(ckpt))  # now the marker lists it, with its checksum, and the run registers one
    with pytest.raises(CheckpointError) as raised:
        _load(acc, ckpt, register=True)
    assert not proof.exists(), "loading a checkpoint ran another user's code"
    text = str(raised.value)
    assert "registered_0.pt" in text and other_user.NAME in text and "allow_pickle" in text, text


def test_a_checkpoint_of_the_users_own_private_folder_loads_what_needs_pickling(tmp_path):
    """The user's own objects still come back, from a folder no one else can write; when one rank may not read them,
    every rank raises the same error, and none is left in a collective."""

    class Remembers:  # its state holds an object of a class of the user's: only full unpickling reads it
        def __init__(self):
            self.value = None

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    def run(acc, ckpt, save):
        acc.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
        remembers = Remembers()
        acc.register_for_checkpointing(remembers)
        if save:
            remembers.value = Counter()
            remembers.value.n = 7
            acc.save_state(ckpt)
            return None
        acc.load_state(ckpt, allow_pickle=None if save is None else acc.rank == 0)
        return remembers.value.n

    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    acc.distribute(run)(acc, str(private / "ckpt"), True)
    assert acc.distribute(run, all_results=True)(acc, str(private / "ckpt"), None) == [7, 7]
    with pytest.raises(CheckpointError, match=r"registered_0\.pt.*allow_pickle=False") as raised:
        acc.distribute(run)(acc, str(private / "ckpt"), False)  # rank 0 allows it, rank 1 never: both raise
    assert "raised on rank" in "".join(getattr(raised.value, "__notes__", []))
    (private / "ckpt").chmod(0o777)  # now another user could have replaced the file: refused, saying how to allow it
    with pytest.raises(CheckpointError, match="can be written by every user.*allow_pickle=True"):
        acc.distribute(run)(acc, str(private / "ckpt"), None)


def test_qadence_checkpoints_another_user_planted_are_never_unpickled(tmp_path):
    folder = _open_to_all(tmp_path / "qadence")
    model, optimizer = torch.nn.Linear(2, 1), torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
    proof = tmp_path / "proof"
    other_user.run("plant", str(folder / "model_Linear_ckpt_999_device_cpu.pt"), str(proof))
    other_user.run("plant", str(folder / "opt_Adam_ckpt_999_device_cpu.pt"), str(proof))
    with pytest.raises(CheckpointError) as raised:
        saveload.load_checkpoint(folder, model, optimizer)
    assert not proof.exists(), "loading a qadence checkpoint ran another user's code"
    assert other_user.NAME in str(raised.value) and "allow_pickle" in str(raised.value), raised.value


def test_qadence_checkpoints_of_the_users_own_folder_load(tmp_path):
    folder = tmp_path / "own"
    folder.mkdir(mode=0o700)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saveload.write_checkpoint(folder, model, optimizer, 3)
    fresh = torch.nn.Linear(2, 1)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    loaded, loaded_opt, iteration = saveload.load_checkpoint(folder, fresh, fresh_opt)
    assert iteration == 3 and torch.equal(loaded.weight, model.weight)
    assert loaded_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
