"""A real, private SLURM cluster for tests (munge + slurmctld + slurmd on localhost).

Not a test module. Typical use::

    with LocalSlurm(nodes=2) as cluster:
        r = cluster.srun(["-N2", "-n2", "hostname"], timeout=30)
        job_id, out = cluster.sbatch_wait("job.sbatch", timeout=60)

Everything (config, munge key and socket, state, spool, logs, job output) lives in one
private temp dir.  Ports are chosen free at bring-up (retried with new ports if a daemon
cannot bind), the ClusterName is unique, and ``SLURM_CONF`` only ever appears in the env
of the commands this module runs (``cluster.env``), never in ``os.environ``, so several
pytest-xdist workers can each run their own cluster side by side.

``nodes=N`` gives fake nodes ``n1..nN``: all 127.0.0.1 (``NodeHostname=localhost``), one
slurmd each on its own port, CPUs=2 each, so ``srun -N2 -n2`` runs one task per "node"
with ``SLURM_NODELIST=n[1-2]`` and ``SLURM_NODEID`` 0/1.

Timing (Debian slurm 22.05, 2 cores): bring-up ~0.15 s, teardown ~0.05-0.25 s, a
trivial ``srun`` ~0.05 s.  Batch jobs start on slurmctld's 1 s scheduler tick, so
``sbatch_wait`` of a trivial job takes ~1 s (~3 s for the first job right after bring-up).
The fake node names do not resolve: give ``MASTER_ADDR=127.0.0.1`` (``env=``) to code that
derives the rendezvous host from the node list.

Every process that belongs to the cluster (daemons, slurmstepd, job tasks) carries
``SLURM_CONF=<private conf>`` in its environment; teardown uses that marker to find and
kill (by pid) anything left over and verifies that nothing remains.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Self

from .component import apt_get_install
from .procs import alive, free_port, wait_dead

__all__ = ["LocalSlurm", "SlurmError", "ensure_installed", "missing_binaries"]

DAEMON_BINARIES = ("slurmctld", "slurmd", "munged")
CLIENT_BINARIES = ("srun", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
APT_PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# Prefixes of variables that would make client commands think they run inside some
# other allocation or change their defaults; stripped from the env we hand out.
_STRIP_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCONTROL_")
_QUEUED_STATES = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "RESV_DEL_HOLD",
}


class SlurmError(RuntimeError):
    """The local cluster could not be installed, started, used or stopped."""


def _which(name: str) -> str | None:
    """shutil.which, also looking in the sbin dirs (often missing from PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN_DIRS:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def missing_binaries() -> list[str]:
    """The SLURM and munge programs the cluster needs that are not installed."""
    return [b for b in (*DAEMON_BINARIES, *CLIENT_BINARIES, "mungekey") if _which(b) is None]


def ensure_installed(timeout: float = 600.0, announce: Callable[[str], None] = print) -> None:
    """Install SLURM + munge with apt if any binary is missing, saying so first through ``announce`` (one process
    at a time; ``apt-get update`` only if the first install attempt fails).  Raises SlurmError if still missing."""
    try:
        apt_get_install(APT_PACKAGES, missing_binaries, announce, timeout)
    except RuntimeError as e:
        raise SlurmError(str(e)) from None
    missing = missing_binaries()
    if missing:
        raise SlurmError(f"after apt install, still missing: {missing}")


def _tail(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _file_tail(path: Path, n: int = 2000) -> str:
    try:
        return _tail(path.read_text(errors="replace"), n)
    except OSError as e:
        return f"<unreadable: {e}>"


def _listening(port: int, pid: int | None = None) -> bool:
    """True if a socket is in LISTEN state on ``port`` (per /proc/net/tcp*), and, if
    ``pid`` is given, that socket is one of that process's file descriptors."""
    needle = f":{port:04X}"
    inodes = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f) as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A" and parts[1].endswith(needle):
                        inodes.add(parts[9])
        except OSError:
            pass
    if pid is None or not inodes:
        return bool(inodes)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def _env_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


class LocalSlurm:
    """A private SLURM cluster.  ``start()``/``stop()`` or use as a context manager.

    Attributes after start: ``root`` (temp dir), ``conf`` (slurm.conf path),
    ``cluster_name``, ``node_names`` (["n1", "n2", ...]), ``ctld_port``, ``node_ports``,
    ``bringup_s``/``teardown_s`` (seconds), ``log_dir``.
    """

    BIN_CHECK = (*DAEMON_BINARIES, "srun")

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 2,
        *,
        gpus_per_node: int = 2,
        startup_timeout: float = 30.0,
        attempts: int = 3,
        keep_dir: bool = False,
        die_with_parent: bool = True,
    ):
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        # GPUs SLURM hands out (GRES gpu): links to /dev/null stand in for /dev/nvidiaN, so a job asks for GPUs, gets them
        # and their CUDA_VISIBLE_DEVICES as on a GPU node, while this machine's torch sees none
        self.gpus_per_node = gpus_per_node
        self.startup_timeout = startup_timeout
        self.attempts = attempts
        self.keep_dir = keep_dir
        # Daemons get PR_SET_PDEATHSIG (via setpriv) so they die if the creating thread
        # dies without teardown (e.g. pytest killed).  Start from a long-lived thread.
        self.die_with_parent = die_with_parent
        self.user = getpass.getuser()
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.root: Path | None = None
        self.conf: Path | None = None
        self.cluster_name = ""
        self.ctld_port = 0
        self.node_ports: list[int] = []
        self.bringup_s = float("nan")
        self.teardown_s = float("nan")
        self._procs: dict[str, subprocess.Popen] = {}
        self.killed_leftovers: dict[int, str] = {}  # what stop() had to SIGKILL
        self._env: dict[str, str] | None = None
        self._finalizer = None

    # ----------------------------------------------------------------- public API
    @classmethod
    def is_available(cls) -> bool:
        """True if slurmctld, slurmd, munged and srun are installed."""
        return all(_which(b) for b in cls.BIN_CHECK)

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands: a copy of os.environ without inherited
        SLURM_*/SBATCH_*/SRUN_*... variables, plus SLURM_CONF for this cluster and the
        sbin dirs on PATH."""
        if self._env is None:
            raise SlurmError("cluster not started")
        return dict(self._env)

    @property
    def log_dir(self) -> Path:
        assert self.root is not None
        return self.root / "log"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalSlurm:
        if self._procs:
            raise SlurmError("already started")
        missing = missing_binaries()
        if missing:
            raise SlurmError(f"SLURM binaries missing: {missing} (see ensure_installed())")
        t0 = time.monotonic()
        base = "/tmp" if os.path.isdir("/tmp") else None  # short path: munge socket <108 chars
        self.root = Path(tempfile.mkdtemp(prefix="qslurm-", dir=base))
        self.cluster_name = "q" + uuid.uuid4().hex[:10]
        self.conf = self.root / "slurm.conf"
        self._marker = f"SLURM_CONF={self.conf}".encode()
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        path = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join(path + [d for d in _SBIN_DIRS if d not in path])
        self._env = env
        # runs at interpreter exit (or GC) if stop() was never called
        self._finalizer = weakref.finalize(self, LocalSlurm._emergency_stop, self._procs, self._marker)
        try:
            self._start_munge()
            last_err = None
            for attempt in range(1, self.attempts + 1):
                try:
                    self._start_slurm()
                    break
                except _RetryablePortError as e:
                    last_err = e
                    self._stop_slurm_daemons(grace=0.0)
                    self._reset_slurm_dirs(attempt)
            else:
                raise SlurmError(f"SLURM bring-up failed {self.attempts} times (port clashes?):\n{last_err}")
        except BaseException:
            with contextlib.suppress(Exception):  # the start's own error is the one to raise
                self.stop()
            raise
        self.bringup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Cancel jobs, stop every daemon by pid (SIGTERM, then SIGKILL), kill any
        leftover process of this cluster and verify nothing remains; remove the temp
        dir unless keep_dir.  Idempotent."""
        if self.root is None:
            return
        t0 = time.monotonic()
        problems = []
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                self._cancel_all_jobs(timeout=8.0)
            except Exception as e:  # noqa: BLE001 - keep going: the daemons must die regardless
                problems.append(f"cancelling jobs: {e}")
        self._stop_slurm_daemons()
        self._terminate("munged")
        leftovers = self.leftover_pids()
        self.killed_leftovers = {p: _cmdline(p) for p in leftovers}
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leftovers = wait_dead(leftovers, timeout=5)
        if leftovers:
            problems.append(f"processes still alive after SIGKILL: {leftovers}")
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if not self.keep_dir and not problems:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        self._env = None
        self.teardown_s = time.monotonic() - t0
        if problems:
            raise SlurmError("LocalSlurm teardown: " + "; ".join(problems))

    def leftover_pids(self) -> list[int]:
        """Pids of live processes carrying this cluster's SLURM_CONF in their
        environment (daemons, slurmstepd, job tasks, client commands)."""
        me = os.getpid()
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != me and _env_has(int(d), self._marker) and alive(int(d)):
                out.append(int(d))
        return out

    def run(
        self,
        cmd: list[str],
        timeout: float = 60.0,
        *,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run any command with this cluster's env (plus ``env`` overrides)."""
        full_env = self.env
        if env:
            full_env.update(env)
        try:
            r = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise SlurmError(
                f"{cmd} timed out after {timeout}s\nstdout: "
                f"{_tail(_s(e.stdout))}\nstderr: {_tail(_s(e.stderr))}\n" + self.log_tails()
            ) from None
        if check and r.returncode != 0:
            raise SlurmError(
                f"{cmd} failed rc={r.returncode}\nstdout: {_tail(r.stdout)}\n"
                f"stderr: {_tail(r.stderr)}\n" + self.log_tails()
            )
        return r

    def srun(
        self, args: list[str], timeout: float = 60.0, *, env: dict | None = None, cwd: str | os.PathLike | None = None
    ) -> subprocess.CompletedProcess:
        """``srun *args`` (text stdout/stderr captured; not checked)."""
        return self.run(["srun", *args], timeout, env=env, cwd=cwd)

    def sbatch(
        self,
        script_path: str | os.PathLike,
        args: list[str] = (),
        *,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        script_args: list[str] = (),
    ) -> int:
        """Submit a batch script; output goes to ``<root>/jobs/<jobid>.out`` (stdout and
        stderr together) unless ``args`` give --output.  ``args`` are sbatch options,
        ``script_args`` the batch script's own arguments (after its path).  Returns the job id."""
        assert self.root is not None, "cluster not started"
        jobs = self.root / "jobs"
        jobs.mkdir(exist_ok=True)
        cmd = ["sbatch", "--parsable", f"--output={jobs}/%j.out", *args, str(script_path), *script_args]
        r = self.run(cmd, 30.0, env=env, cwd=cwd, check=True)
        return int(r.stdout.strip().split(";")[0])

    def sbatch_wait(
        self,
        script_path: str | os.PathLike,
        timeout: float = 60.0,
        args: list[str] = (),
        *,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        script_args: list[str] = (),
    ) -> tuple[int, str]:
        """Submit, poll ``squeue`` every 0.2 s until the job has left the queue, and
        return ``(job_id, output_text)``.  On timeout the job is cancelled and
        SlurmError is raised with the daemons' log tails."""
        job_id = self.sbatch(script_path, args, env=env, cwd=cwd, script_args=script_args)
        self.wait_job(job_id, timeout)
        return job_id, self.job_output(job_id)

    def wait_job(self, job_id: int, timeout: float = 60.0) -> None:
        """Poll ``squeue`` every 0.2 s until the job has left the queue."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.run(["squeue", "-h", f"--jobs={job_id}", "-o", "%T"], 15.0)
            state = r.stdout.strip()
            if r.returncode == 0 and state not in _QUEUED_STATES:
                return  # finished (any terminal state)
            if r.returncode != 0 and "Invalid job id" in r.stderr:
                return  # finished and already purged
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                raise SlurmError(f"while waiting for job {job_id}: {dead} died\n" + self.log_tails())
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)], 15.0)
                raise SlurmError(
                    f"job {job_id} still {state} after {timeout}s\n"
                    f"output so far:\n{_tail(self.job_output(job_id))}\n" + self.log_tails()
                )
            time.sleep(0.2)

    def job_output(self, job_id: int) -> str:
        """Text of the job's output file (per ``scontrol show job`` StdOut, or the
        default path sbatch() uses); '' if missing."""
        assert self.root is not None
        path = self.root / "jobs" / f"{job_id}.out"
        info = self.job_info(job_id)
        if info.get("StdOut"):
            path = Path(info["StdOut"])
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job ID`` parsed into a dict (e.g. JobState, ExitCode,
        StdOut); {} if slurmctld no longer knows the job."""
        r = self.run(["scontrol", "-o", "show", "job", str(job_id)], 15.0)
        if r.returncode != 0:
            return {}
        info = {}
        for m in re.finditer(r"(\S+?)=(\S*)", r.stdout.strip()):
            info.setdefault(m.group(1), m.group(2))
        return info

    def health(self) -> str:
        """One line: each daemon alive or its exit code, and whether the munge socket
        exists (goes into every error message)."""
        parts = []
        for name, p in self._procs.items():
            rc = p.poll()
            parts.append(f"{name}(pid {p.pid}): " + ("alive" if rc is None else f"EXITED rc={rc}"))
        sock = getattr(self, "munge_socket", None)
        if sock is not None:
            parts.append(f"munge socket {'present' if sock.exists() else 'MISSING'}")
        return "; ".join(parts)

    def log_tails(self, n: int = 1500) -> str:
        if self.root is None:
            return "<no cluster dir>"
        parts = [f"--- daemons: {self.health()}"]
        for f in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {f.name} ---\n{_file_tail(f, n)}")
        return "\n".join(parts)

    # ----------------------------------------------------------------- internals
    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        if self.die_with_parent and shutil.which("setpriv"):
            cmd = ["setpriv", "--pdeathsig", "TERM", "--", *cmd]
        with open(self.log_dir / f"{name}.stdout", "ab") as out:  # the daemon keeps its own copy of the fd
            p = subprocess.Popen(
                cmd,
                env=env or self._env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
            )
        self._procs[name] = p
        return p

    def _start_munge(self) -> None:
        assert self.root is not None
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o755)
        os.chmod(mdir, 0o755)  # 700 gives "Socket is inaccessible"
        os.chmod(self.root, 0o755)
        self.log_dir.mkdir()
        key = mdir / "munge.key"
        r = subprocess.run(
            [_which("mungekey"), "-c", "-k", str(key)], capture_output=True, text=True, timeout=30, check=False
        )
        if r.returncode != 0:
            raise SlurmError(f"mungekey failed: {r.stdout}{r.stderr}")
        os.chmod(key, 0o600)
        self.munge_socket = mdir / "munge.socket.2"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "-F",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={mdir / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={mdir / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmError("munged did not start:\n" + self.log_tails())
            time.sleep(0.02)

    @staticmethod
    def _first_job_id() -> int:
        """Where this cluster's job ids start: 100 apart for each pytest-xdist worker (one cluster each). A job
        without MASTER_PORT rendezvouses on 15000 + its id's last four digits, so two workers' clusters both
        counting from 1 gave their concurrent jobs the same port (a rank then met the other job's store)."""
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker[2:].isdigit() else 0
        return 10000 + 100 * (index % 99) + 1

    def _write_conf(self) -> None:
        assert self.root is not None and self.conf is not None
        R = self.root
        ports: list[int] = []
        while len(ports) < 1 + self.nodes:  # a clash with another process at bring-up is retried with new ports
            port = free_port("0.0.0.0")
            if port not in ports:
                ports.append(port)
        self.ctld_port, self.node_ports = ports[0], ports[1:]
        (R / "state").mkdir(exist_ok=True)
        for n in self.node_names:
            (R / "spool" / n).mkdir(parents=True, exist_ok=True)
        gres = f"Gres=gpu:{self.gpus_per_node} " if self.gpus_per_node else ""
        if self.gpus_per_node:
            (R / "dev").mkdir(exist_ok=True)
            for i in range(self.gpus_per_node):  # SLURM wants character devices: /dev/null's name will do
                (R / "dev" / f"gpu{i}").symlink_to("/dev/null")
            (R / "gres.conf").write_text(
                "AutoDetect=off\n"
                + "".join(
                    f"NodeName={n} Name=gpu File={R}/dev/gpu[0-{self.gpus_per_node - 1}]\n" for n in self.node_names
                )
            )
        node_lines = [
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={p} {gres}"
            f"CPUs={self.cpus_per_node} Sockets=1 CoresPerSocket={self.cpus_per_node} "
            f"ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
            for n, p in zip(self.node_names, self.node_ports)
        ]
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName={self.cluster_name}",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmUser={self.user}",
                    f"SlurmdUser={self.user}",
                    f"SlurmctldPort={self.ctld_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={R}/state",
                    f"SlurmdSpoolDir={R}/spool/%n",
                    f"SlurmctldPidFile={R}/slurmctld.pid",
                    f"SlurmdPidFile={R}/slurmd-%n.pid",
                    f"SlurmctldLogFile={R}/log/slurmctld.log",
                    f"SlurmdLogFile={R}/log/slurmd-%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    # use the configured CPUs/memory even if this machine has fewer
                    "SlurmdParameters=config_overrides",
                    "MpiDefault=none",
                    *(["GresTypes=gpu"] if self.gpus_per_node else []),
                    "SwitchType=switch/none",
                    "ReturnToService=2",
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
                    "KillWait=2",
                    f"FirstJobId={self._first_job_id()}",
                    "MinJobAge=120",
                    "MailProg=/bin/true",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/none",
                    *node_lines,
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start_slurm(self) -> None:
        self._write_conf()
        deadline = time.monotonic() + self.startup_timeout
        ctld = self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        # slurmd/sinfo started before slurmctld listens back off ~1 s: wait for the port
        while ctld.poll() is None and not _listening(self.ctld_port, ctld.pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for n in self.node_names:
            self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", n])
        states = ""
        while True:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    logs = self.log_tails()
                    msg = f"{name} exited (rc={p.returncode}) during bring-up\n{logs}"
                    if re.search(r"Address already in use|Unable to bind|Error binding", logs):
                        raise _RetryablePortError(msg)
                    raise SlurmError(msg)
            try:  # short timeout: a port thief that accepts but never answers must not stall us
                r = subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%N %t"],
                    env=self._env,
                    capture_output=True,
                    text=True,
                    timeout=3,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                r = subprocess.CompletedProcess([], 1, "", "sinfo timed out")
            states = r.stdout.strip()
            got = dict(line.split() for line in states.splitlines() if len(line.split()) == 2)
            if r.returncode == 0 and all(got.get(n) == "idle" for n in self.node_names):
                return
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"nodes not idle after {self.startup_timeout}s; sinfo: {states!r} "
                    f"{r.stderr.strip()!r}\n{self.log_tails()}"
                )
            time.sleep(0.05)

    def _cancel_all_jobs(self, timeout: float) -> None:
        self.run(["scancel", "-u", self.user], 15.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run(["squeue", "-h", "-o", "%i"], 15.0)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.1)

    def _terminate(self, name: str, grace: float = 5.0) -> None:
        """SIGTERM (SIGKILL if grace == 0), wait up to ``grace`` s, then SIGKILL."""
        p = self._procs.pop(name, None)
        if p is None:
            return
        if p.poll() is None:
            p.terminate() if grace > 0 else p.kill()
            try:
                p.wait(grace if grace > 0 else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def _stop_slurm_daemons(self, grace: float = 5.0) -> None:
        names = [f"slurmd-{n}" for n in self.node_names] + ["slurmctld"]
        if grace > 0:
            for name in names:  # signal all first, then wait: faster than one by one
                p = self._procs.get(name)
                if p is not None and p.poll() is None:
                    p.terminate()
        for name in names:
            self._terminate(name, grace)

    def _reset_slurm_dirs(self, attempt: int) -> None:
        assert self.root is not None
        for d in ("state", "spool"):
            shutil.rmtree(self.root / d, ignore_errors=True)
        for f in self.root.glob("*.pid"):
            f.unlink(missing_ok=True)
        for f in self.log_dir.glob("slurm*"):
            if ".attempt" not in f.name:
                f.rename(f.with_name(f"{f.name}.attempt{attempt}"))

    @staticmethod
    def _emergency_stop(procs: dict, marker: bytes) -> None:
        """atexit / GC fallback when stop() was never called."""
        for p in list(procs.values()):
            if p.poll() is None:
                p.kill()
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid() and _env_has(int(d), marker):
                try:
                    os.kill(int(d), signal.SIGKILL)
                except OSError:
                    pass


class _RetryablePortError(SlurmError):
    pass


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _s(x) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x
