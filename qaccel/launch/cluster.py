"""distribute() onto a SLURM cluster, through submitit: one job whose tasks are the ranks.

submitit writes the sbatch script, pickles the function and collects every task's result; qaccel runs the
function in each task through the srun path (in place, the rendezvous on the job's first node), and in the
caller follows the job: its state changes and rank 0's output appear, Ctrl-C cancels it, and a rank's exception
comes back with its rank, node and remote traceback, as from a local launch.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from qaccel.environment import Environment, node_name, slurm_job_state
from qaccel.errors import ErrorReport, Preempted, RankError
from qaccel.launch import pickling
from qaccel.launch.protocol import HandBack, Runner
from qaccel.options import JobOutput, SlurmCluster, minutes, on_node

if TYPE_CHECKING:
    from qaccel.options import Config

POLL_S = 0.5
# a job in one of these has ended (scontrol's states; a requeued job goes back to PENDING)
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "UNKNOWN",
)  # UNKNOWN: SLURM forgot the job, long ended


class ClusterJob(Runner):
    """The ranks are the tasks of one SLURM job, submitted from here: the runner for a plain process given
    ``cluster=``."""

    def __init__(self, config: Config, env: Environment, hand_back: HandBack) -> None:
        super().__init__(config, env, hand_back)
        self.starts_ranks = config.nprocs > 1

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_results: bool) -> Any:
        """Submit, wait (following the job), and return rank 0's result or every rank's."""
        cluster = cast(SlurmCluster, self.config.cluster)  # set: runners.choose picks this runner only then
        job = submit(fn, args, kwargs, self.config, cluster, self.hand_back.in_place)
        return job.results() if all_results else job.result()


# ---- in the job: each task is a rank ----


class _Rank:
    """What each task of the job runs: ``fn`` as this task's rank, in place. It returns what happened instead of
    raising, so that the caller sees every rank's outcome and raises the cause's own exception. A stop after a
    signal (Preempted) is a SystemExit: submitit then writes no result, and the requeued job writes it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Config,
        plain: Callable[[Any], Any],
    ) -> None:
        # pickled here, not by submitit's cloudpickle: the task's tracebacks then name the caller's files and lines
        self.call, self.config, self.plain = pickling.dumps_call(fn, args, kwargs), config, plain

    def __call__(self) -> tuple[str, Any]:
        from qaccel.environment import detect
        from qaccel.launch import in_place

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # submitit ignores it in its tasks; scancel must end them
        env = detect()
        try:
            config = on_node(self.config, env)  # the device, backend and precision: this node's to decide
            return "returned", in_place.run(_called, (self.call,), {}, config, env, False, self.plain)
        except Preempted:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            if hasattr(exc, "__notes__"):  # the caller names the rank itself
                exc.__notes__ = [n for n in exc.__notes__ if not n.startswith("[qaccel] raised on rank")]
            return "raised", (ErrorReport.of(env.rank, exc), node_name())


# ---- in the caller ----


class SlurmJob:
    """A submitted job (``Accelerator.submit``): ``job_id``, ``state``, ``result()``, ``results()``, ``cancel()``,
    ``logs()``. Waiting in ``result()`` shows the state changes and rank 0's output; Ctrl-C cancels the job."""

    def __init__(self, job: Any, cluster: SlurmCluster, show: bool = True) -> None:
        self._job = job
        self.cluster = cluster
        self.job_id: str = job.job_id
        self._show = show
        self._shown: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}  # a rank's last line, not finished yet (output="all")
        self._last_state: str | None = None
        self._restarts = 0

    def __repr__(self) -> str:
        return f"SlurmJob(job_id={self.job_id!r}, state={self.state!r})"

    @property
    def folder(self) -> Path:
        return Path(self._job.paths.folder)

    @property
    def state(self) -> str:
        """SLURM's state of the job now (PENDING, RUNNING, COMPLETED, ...)."""
        return self._poll()[0]

    def _poll(self) -> tuple[str, int]:
        """The job's state and how many times it was requeued."""
        state, restarts = slurm_job_state(self.job_id)
        if state is None:  # SLURM forgot the job: long ended
            state = "COMPLETED" if self._all_results_written() else "UNKNOWN"
        return state, restarts

    def cancel(self) -> None:
        """``scancel`` the job (every rank stops)."""
        subprocess.run(["scancel", self.job_id], capture_output=True, timeout=60, check=False)

    def logs(self, rank: int = 0) -> str:
        """Rank ``rank``'s output so far (its stdout, then its stderr)."""
        task = self._tasks()[rank]
        return "".join(p.read_text(errors="replace") for p in (task.paths.stdout, task.paths.stderr) if p.exists())

    def result(self) -> Any:
        """Wait for the job and return rank 0's result, or raise the failing rank's exception."""
        return self._outcomes()[0]

    def results(self) -> list[Any]:
        """Wait for the job and return every rank's result, by rank."""
        return self._outcomes()

    def wait(self) -> str:
        """Wait until the job ends (through requeues); its final state. Ctrl-C cancels it."""
        try:
            while True:
                state, restarts = self._poll()
                if restarts > self._restarts:
                    self._restarts = restarts
                    self._last_state = None  # the state shows again, after the requeue
                    if self._show:
                        print(f"qaccel: job {self.job_id} requeued (restart {restarts})", file=sys.stderr, flush=True)
                self._follow(state)
                if state in ENDED:
                    self._follow(state, ended=True)
                    return state
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self.cancel()
            _wait_gone(self.job_id)
            print(f"qaccel: job {self.job_id} cancelled", file=sys.stderr, flush=True)
            raise

    def _follow(self, state: str, ended: bool = False) -> None:
        """Show a new state, and what the ranks wrote since the last look (``cluster.output``)."""
        if not self._show:
            return
        if state != self._last_state:
            print(f"qaccel: job {self.job_id} {state}", file=sys.stderr, flush=True)
            self._last_state = state
        output = self.cluster.output
        tasks = [] if output is JobOutput.NONE else self._tasks()[:1] if output is JobOutput.RANK0 else self._tasks()
        for rank, task in enumerate(tasks):
            for path, stream in ((task.paths.stdout, sys.stdout), (task.paths.stderr, sys.stderr)):
                new = _read_from(path, self._shown.get(path, 0))
                self._shown[path] = self._shown.get(path, 0) + len(new)
                if output is JobOutput.ALL:  # whole lines only, each with its rank
                    *lines, self._partial[path] = (self._partial.get(path, b"") + new).split(b"\n")
                    if ended and self._partial[path]:
                        lines.append(self._partial.pop(path))
                    new = b"".join(b"[rank %d] %s\n" % (rank, line) for line in lines)
                if new:
                    stream.write(new.decode(errors="replace"))
                    stream.flush()

    def _tasks(self) -> list[Any]:
        return (
            [self._job.task(i) for i in range(self.cluster.world_size)] if self.cluster.world_size > 1 else [self._job]
        )

    def _all_results_written(self) -> bool:
        return all(task.paths.result_pickle.exists() for task in self._tasks())

    def _outcomes(self) -> list[Any]:
        """Every rank's result, by rank; or the exception of the rank that caused the failure."""
        from qaccel.launch import failures

        state = self.wait()
        outcomes: dict[int, tuple[str, Any]] = {}
        for rank, task in enumerate(self._tasks()):
            if task.paths.result_pickle.exists():
                outcomes[rank] = task.result()  # a failure of submitit's own (unpickling) raises here
        failed = [
            failures.RankFailure(rank, outcomes[rank][1][0] if rank in outcomes else None)
            for rank in range(self.cluster.world_size)
            if outcomes.get(rank, ("raised",))[0] == "raised"
        ]
        if not failed:
            return [outcomes[rank][1] for rank in range(self.cluster.world_size)]
        cause = failures.root_cause(failed)
        if cause.report is None:  # died without a result: killed, os._exit, or a folder the nodes do not share
            log = self._tasks()[cause.rank].paths.stderr
            raise RankError(
                f"rank {cause.rank} of SLURM job {self.job_id} ended ({state}) without a result in "
                f"{self.folder}: killed, os._exit(), or a folder the compute nodes do not share; its "
                f"log: {log}",
                cause.rank,
            )
        exc, rank = failures.cause_exception(failed, self.cluster.world_size, launched=True)
        exc.add_note(
            f"[qaccel] rank {rank} ran on node {outcomes[rank][1][1]} in SLURM job {self.job_id} (its files: "
            f"{self.folder})"
        )
        raise exc


def _called(call: bytes) -> Any:
    """The call, unpickled in the task's session (what it holds may set itself up for the rank: caller_state.py) and
    made; a job takes no settings of the caller."""
    _, fn, args, kwargs = pickle.loads(call)
    return fn(*args, **kwargs)


def submit(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: Config,
    cluster: SlurmCluster,
    plain: Callable[[Any], Any],
    show: bool = True,
) -> SlurmJob:
    """Submit ``fn(*args, **kwargs)`` as one SLURM job of ``cluster.world_size`` tasks, each a rank; each task's
    result is made ``plain`` (protocol.HandBack.in_place)."""
    import submitit

    task = _Rank(fn, args, kwargs, config, plain)  # an argument that cannot be pickled fails here, before any job
    executor = submitit.SlurmExecutor(folder=Path(cluster.folder).absolute() / "%j", max_num_timeout=0)
    sbatch = {"signal": "USR1@180", "requeue": True, **cluster.sbatch}
    executor.update_parameters(
        nodes=cluster.nodes,
        ntasks_per_node=cluster.tasks_per_node,
        time=minutes(cluster.time),
        setup=list(cluster.setup),
        additional_parameters=sbatch,
        **{
            name: value
            for name in ("partition", "account", "gpus_per_node", "cpus_per_task")
            if (value := getattr(cluster, name)) is not None
        },
    )
    job = executor.submit(task)
    if show:
        print(
            f"qaccel: submitted SLURM job {job.job_id} ({cluster.nodes} node(s) x {cluster.tasks_per_node} "
            f"task(s)); its files are in {job.paths.folder}",
            file=sys.stderr,
            flush=True,
        )
    return SlurmJob(job, cluster, show)


def _wait_gone(job_id: str, timeout: float = 60.0) -> None:
    """Wait until the cancelled job has ended (its processes are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and slurm_job_state(job_id)[0] not in (None, *ENDED):
        time.sleep(POLL_S)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
