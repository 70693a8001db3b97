"""distribute() in a plain process: real ranks (gloo, CPU, world 2) started from this test process."""

from __future__ import annotations

import functools
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from support.procs import run_torchrun, script_env, script_file, wait_dead

from qaccel import Accelerator, RankError, RankKilledError

pytestmark = pytest.mark.timeout(120)


def _ranks(acc):
    return (acc.rank, acc.world_size)


def test_lambda_closure_and_plain_function(acc):
    offset = 10
    assert acc.distribute(lambda a, b: a + b + offset)(1, 2) == 13
    assert acc.distribute(_ranks, all_results=True)(acc) == [(0, 2), (1, 2)]


def test_closure_sees_its_rank_accelerator(acc):
    def body():
        return (acc.rank, acc.local_rank, acc.node_rank, acc.world_size, acc.is_main_process, str(acc.device))

    assert acc.distribute(body, all_results=True)() == [(0, 0, 0, 2, True, "cpu"), (1, 1, 0, 2, False, "cpu")]


class Trainer:
    def __init__(self, acc, scale):
        self.accelerator = acc
        self.scale = scale

    def fit(self, x):
        return x * self.scale + self.accelerator.rank


def test_bound_method(acc):
    assert acc.distribute(Trainer(acc, 3).fit, all_results=True)(2) == [6, 7]


def train(model, optimizer, accelerator):
    """Named like qadence's trigger: a function called `train` whose first argument is a model."""
    return (type(model).__name__, type(optimizer).__name__, accelerator.rank)


def test_function_named_train_taking_a_model_first(acc):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert acc.distribute(train)(model, optimizer, acc) == ("Sequential", "SGD", 0)


def test_decorator_and_kwargs(acc):
    @acc.distribute
    def scaled(x, *, factor):
        return x * factor

    assert scaled(4, factor=3) == 12
    assert scaled.__name__ == "scaled"


def test_rank0_result_and_all_results(acc):
    fn = functools.partial(lambda a, tag: {"rank": a.rank, "tag": tag}, acc)
    assert acc.distribute(fn)("x") == {"rank": 0, "tag": "x"}
    assert acc.distribute(fn, all_results=True)("y") == [{"rank": 0, "tag": "y"}, {"rank": 1, "tag": "y"}]


def test_64mb_result_no_deadlock(acc):
    def big(a):
        return torch.full((16 * 2**20,), float(a.rank + 1))

    start = time.monotonic()
    out = acc.distribute(big, all_results=True)(acc)
    assert [t.nbytes for t in out] == [64 * 2**20] * 2
    assert out[0][-1].item() == 1.0 and out[1][0].item() == 2.0
    assert time.monotonic() - start < 60


def test_cpu_parameters_are_not_shared_between_ranks(acc):
    """qadence anchor: spawn shares CPU storage, so 2 ranks step the same weight twice (w=-10 instead of -5)."""
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def steps(model, optimizer):
        for _ in range(5):
            optimizer.zero_grad()
            model.weight.sum().backward()
            optimizer.step()
            time.sleep(0.01)
        return model.weight.item()

    assert acc.distribute(steps, all_results=True)(model, optimizer) == [-5.0, -5.0]
    assert model.weight.item() == 0.0


def _pid_file(tmp_path, rank):
    return tmp_path / f"pid-{rank}"


def _record_pid(tmp_path, rank):
    """Atomically: a rank may be stopped mid-write, and an empty pid file is not a pid."""
    tmp = _pid_file(tmp_path, rank).with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, _pid_file(tmp_path, rank))


def _recorded_pids(tmp_path, n=2):
    return [int(_pid_file(tmp_path, r).read_text()) for r in range(n) if _pid_file(tmp_path, r).exists()]


class CustomError(Exception):
    pass


def test_exception_type_rank_and_remote_traceback(acc, tmp_path):
    def fail_on_rank1(a):
        _record_pid(tmp_path, a.rank)
        if a.rank == 1:
            raise CustomError("bad batch 17")
        return "ok"

    with pytest.raises(CustomError, match="bad batch 17") as info:
        acc.distribute(fail_on_rank1)(acc)
    notes = "\n".join(info.value.__notes__)
    assert "rank 1 of 2" in notes
    assert "fail_on_rank1" in str(info.value.__cause__)
    assert 'raise CustomError("bad batch 17")' in str(info.value.__cause__)
    assert wait_dead(_recorded_pids(tmp_path), timeout=5) == []


def test_peer_blocked_in_barrier_is_stopped_quickly(acc, tmp_path):
    """Rank 0 waits in a barrier that rank 1's death cannot break (on the caller's rendezvous store, as torch's
    store-based barriers wait, for the 60 s of the store's timeout): only the caller stopping it ends it in time.
    (A gloo barrier would raise by itself once rank 1's connection closed.)"""

    def fail_while_peer_waits(a):
        _record_pid(tmp_path, a.rank)
        if a.rank == 1:
            time.sleep(0.3)
            raise KeyError("missing-key")
        torch.distributed.distributed_c10d._get_default_store().wait(["a key no rank sets"])
        time.sleep(120)

    start = time.monotonic()
    with pytest.raises(KeyError, match="missing-key") as info:
        acc.distribute(fail_while_peer_waits)(acc)
    assert time.monotonic() - start < 15
    assert any("rank 1 of 2" in n for n in info.value.__notes__)
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 2 and wait_dead(pids, timeout=5) == []


def test_a_peer_that_notices_the_broken_group_first_is_not_taken_for_the_cause(acc):
    """Rank 1's error is the cause even when rank 0's "connection closed" is reported before it."""

    def fail_slowly(a):
        if a.rank == 1:
            try:
                raise KeyError("the real cause")
            finally:
                # torch's own: torch.distributed's name leaves the session's group to its end
                torch.distributed.distributed_c10d.destroy_process_group()  # rank 0's barrier breaks now...
                time.sleep(1.0)  # ...and rank 0 reports before this rank does
        a.wait_for_everyone()
        time.sleep(120)

    with pytest.raises(KeyError, match="the real cause") as info:
        acc.distribute(fail_slowly)(acc)
    assert any("rank 1 of 2" in n for n in info.value.__notes__)
    assert any("also failed after it: rank 0" in n for n in info.value.__notes__), info.value.__notes__


def test_rank_killed_by_signal(acc, tmp_path):
    def killed(a):
        _record_pid(tmp_path, a.rank)
        if a.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)

    start = time.monotonic()
    with pytest.raises(RankKilledError) as info:
        acc.distribute(killed)(acc)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    assert "rank 1 was killed by signal SIGKILL" in str(info.value)
    assert time.monotonic() - start < 15
    assert wait_dead(_recorded_pids(tmp_path), timeout=5) == []


def test_rank_exiting_without_result(acc):
    def bare_exit(a):
        if a.rank == 1:
            os._exit(3)
        time.sleep(120)

    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        acc.distribute(bare_exit)(acc)


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")

    def __reduce__(self):
        raise TypeError("no pickling")


def test_unpicklable_exception_becomes_rank_error(acc):
    def fail(a):
        if a.rank == 0:
            raise Unpicklable(1, 2)
        a.wait_for_everyone()

    with pytest.raises(RankError) as info:
        acc.distribute(fail)(acc)
    err = info.value
    assert err.rank == 0 and err.exc_type.endswith("Unpicklable")
    assert "1/2" in str(err) and "raise Unpicklable(1, 2)" in err.remote_traceback


def test_unpicklable_result_is_reported(acc):
    with pytest.raises(TypeError, match="rank 0's return value .* cannot be pickled"):
        acc.distribute(lambda: threading.Lock())()


def _train_and_return_prepared(a):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = a.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_prepared_model_and_optimizer_come_back_as_the_users_own(acc):
    """A DDP model cannot be unpickled where there is no process group; the caller gets the module it wraps."""
    model, optimizer = acc.distribute(_train_and_return_prepared)(acc)
    assert type(model) is torch.nn.Linear and type(optimizer) is torch.optim.SGD
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 1)
    assert torch.equal(model.weight, start.weight - 2.0) and torch.equal(model.bias, start.bias - 2.0)
    assert optimizer.param_groups[0]["params"][0] is model.weight, "the optimizer still steps the model"


def test_an_argument_that_cannot_be_pickled_is_named(acc):
    def train(model, lock, epochs=1):
        return epochs

    with pytest.raises(TypeError, match=r"distribute\(.*train\): argument 1 \('lock'\), a lock, cannot be pickled"):
        acc.distribute(train)(torch.nn.Linear(1, 1), threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'epochs', a lock, cannot be pickled"):
        acc.distribute(train)(torch.nn.Linear(1, 1), None, epochs=threading.Lock())
    assert acc.distribute(train)(torch.nn.Linear(1, 1), None, epochs=3) == 3


@pytest.mark.parametrize("into", ["pipe", "file"])
def test_everything_a_failing_rank_printed_reaches_the_caller(into, tmp_path):
    """Without PYTHONUNBUFFERED a rank's stdout into a pipe or a file is block-buffered; the caller stops the ranks
    as soon as one fails, before their exit would flush it."""
    script = script_file("failing_rank_output.py")
    env = script_env()
    env.pop("PYTHONUNBUFFERED", None)
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out_file:
        proc = subprocess.run(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE if into == "pipe" else out_file,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=90,
            check=False,
        )
    stdout = proc.stdout if into == "pipe" else out_path.read_text()
    assert "ValueError: rank 1 fails after printing" in proc.stderr
    for text in ("rank 1 printed a line", "rank 1 printed half a line", "rank 0 printed a line"):
        assert text in stdout, stdout
    assert "rank 1 wrote to stderr" in proc.stderr and "rank 0 wrote to stderr" in proc.stderr


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_lines_of_ranks_never_mix_unbuffered(launcher, tmp_path):
    """Ranks share the caller's (or torchrun's) fds 1 and 2; unbuffered, print writes a line's text and its newline
    separately."""
    env = script_env(PYTHONUNBUFFERED="1")
    if launcher == "python":
        proc = subprocess.run(
            [sys.executable, "-u", str(script_file("whole_lines.py"))],
            capture_output=True,
            text=True,
            env=env,
            timeout=90,
            check=False,
        )
    else:
        proc = run_torchrun(script_file("whole_lines.py"), cwd=tmp_path, env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr
    for stream, word, fill in ((proc.stdout, "line", "x"), (proc.stderr, "error", "y")):
        ours = [line for line in stream.splitlines() if line.startswith("rank ") or fill * 10 in line]
        mixed = [line for line in ours if not re.fullmatch(rf"rank [01] {word} \d+ {fill}{{100}}", line)]
        assert not mixed and len(ours) == 600, mixed[:5]


def test_system_exit_in_rank_propagates_as_system_exit(acc):
    def leave(a):
        if a.rank == 1:
            raise SystemExit(4)
        a.wait_for_everyone()

    with pytest.raises(SystemExit) as info:
        acc.distribute(leave)(acc)
    assert info.value.code == 4


def test_nested_distribute_runs_in_place(acc):
    def outer(a):
        return a.distribute(lambda: (os.getpid(), a.rank))(), os.getpid()

    (inner_pid, rank), outer_pid = acc.distribute(outer)(acc)
    assert inner_pid == outer_pid and rank == 0


def test_thread_budget_splits_cores():
    cores = len(os.sched_getaffinity(0))
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    threads = acc.distribute(torch.get_num_threads, all_results=True)()
    if "OMP_NUM_THREADS" in os.environ:
        assert threads == [torch.get_num_threads()] * 2
    else:
        assert threads == [max(1, cores // 2)] * 2


def test_concurrent_launches_from_threads(acc):
    results, errors = {}, []

    def one(i):
        try:
            results[i] = acc.distribute(
                lambda a, i: (i, a.all_reduce_dict({"r": a.rank}, op="sum")["r"]), all_results=True
            )(acc, i)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert errors == []
    assert results == {i: [(i, 1), (i, 1)] for i in range(3)}


def test_spawn_start_method_also_works():
    acc = Accelerator(nprocs=2, compute_setup="cpu", start_method="spawn")
    assert acc.distribute(lambda a: a.rank * 10, all_results=True)(acc) == [0, 10]


def test_single_process_runs_here_and_returns():
    acc = Accelerator(nprocs=1)
    assert acc.distribute(lambda: os.getpid())() == os.getpid()
    assert acc.distribute(lambda: 5, all_results=True)() == [5]
    assert (acc.rank, acc.world_size, acc.is_main_process) == (0, 1, True)


def test_caller_properties_before_launch():
    acc = Accelerator(nprocs=3, compute_setup="cpu")
    assert (acc.rank, acc.local_rank, acc.node_rank, acc.world_size) == (0, 0, 0, 3)
    assert acc.device == torch.device("cpu") and acc.backend == "gloo" and acc.dtype is None
    assert acc.is_main_process and acc.is_local_main_process
    assert pickle.loads(pickle.dumps(acc)).world_size == 3


def test_timeout_bounds_a_collective_waiting_for_a_stuck_peer():
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=2)

    def stuck(a):
        if a.rank == 1:
            time.sleep(60)
        a.wait_for_everyone()

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        acc.distribute(stuck)(acc)
    assert time.monotonic() - start < 20
    assert any("rank 0 of 2" in note for note in info.value.__notes__)


def _listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_rendezvous_listens_on_loopback_only(acc):
    def where(a):
        return (
            os.environ["MASTER_ADDR"],
            _listen_addresses(int(os.environ["MASTER_PORT"])),
            os.environ["GLOO_SOCKET_IFNAME"],
        )

    addr, listening, ifname = acc.distribute(where)(acc)
    assert addr == "127.0.0.1"
    assert listening == {"0100007F"}, "the store must listen on 127.0.0.1 and nowhere else"
    assert ifname.startswith("lo")
