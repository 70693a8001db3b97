"""The servers the ranks of a plain launch are forked from: multiprocessing's forkserver, started the fast way when
that is provably safe.

Ranks need torch, and forking a process with torch loaded costs ~20 ms where a new interpreter importing torch
costs a second or more. The caller has torch loaded, but forking it is only safe while it runs a single thread
and has not initialised CUDA: a child forked beside a running thread inherits whatever locks that thread held
(an OpenMP pool that ran once makes the child hang in its first parallel region), and CUDA cannot be used in a
forked child at all. So when the server is started (``Accelerator()``, or the first launch):

- **forked from the caller** if, at that moment, the caller runs exactly one thread and CUDA is not initialised.
  Libraries keep pools of idle threads: OpenBLAS (numpy's) parks its own before every fork, and GNU OpenMP
  (torch's intra-op threads, after any parallel torch op) ends its pool on ``omp_pause_resource_all``. Both are
  asked first (_quiet_pools), so that the count can prove the process single-threaded; each starts its threads
  again when next needed. The forked server then imports ``torch._dynamo`` (which every optimizer and
  DistributedDataParallel need; nothing, when the caller had it) and serves the launches of the process. While a
  module is being imported (an Accelerator made at the top of an imported module) the fork waits for the launch:
  a server forked then would hold that module half made.
- **a fresh interpreter** otherwise, e.g. in a Jupyter kernel (it has threads), after ``torch.set_num_threads``
  (torch's pthreadpool keeps threads that nothing stops), or with CUDA initialised. It takes the caller's
  sys.path, imports torch and ``torch._dynamo`` once, then serves the same way. Like the forked one, it starts
  with the first Accelerator that launches (importing qaccel starts nothing), so its imports overlap later cells.

Both run multiprocessing's own forkserver loop, so its clients are unchanged, and both import with the garbage
collector off (a third of the imports' time otherwise) and freeze the result before serving.

**The first launch does not wait for that import** (serving): if the server has not finished it (and was not
forked from a caller that had it all: then it is ready in milliseconds), the caller is still safe to fork and
there is a core per rank, the launch is served by a *quick server* forked from the caller
at the call, with nothing to import, and the server is paused (SIGSTOP) until the launch ends, so that it takes
no core from the ranks. A function that needs no dynamo starts in ~0.15 s; ranks that do need it (they build an
optimizer or a DDP model) import it themselves, side by side, one core each, in about the time the server's own
import would have taken (unless the caller had imported it already, by building its optimizer: then the quick
server has it too). Their hidden costs: each such rank holds its own copy of dynamo's modules (memory pages not
shared), and the server's import resumes after the first launch, so a second launch right after it waits for
the rest of it (< 1 s). With more ranks than cores the per-rank imports would queue: the launch waits instead.
Only a forked server that has armed its death with the caller is paused (_Preloading.dies_with_caller).

The servers hold nothing of the caller's GPU state and never run the caller's code. A forked one dies with the
caller (a paused one could not notice); a fresh one ends when the caller does. What a forked one keeps of the
caller: the modules imported and the files open when it was forked. Ranks still receive fn and the caller's
settings by value at each launch.
"""

# pyright: reportAttributeAccessIssue=false
# - on purpose: multiprocessing's private state (ForkServer's, the process _config) and helpers, read and replaced

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from typing import NamedTuple, cast

import torch

from qaccel.environment import usable_cores
from qaccel.imports import import_quietly
from qaccel.launch import output
from qaccel.options import StartMethod

# torch._dynamo: every optimizer's and DistributedDataParallel's constructor imports it (with sympy, ~1 s);
# preloaded, a rank need not import it again. qaccel.launch.worker: the ranks' entry point.
PRELOAD = ["torch", "torch._dynamo", "qaccel.launch.worker"]
QUICK_PRELOAD = ["torch", "qaccel.launch.worker"]  # a quick server's: what the caller has loaded already
UNIX_PATH_MAX = 107  # sun_path's 108 bytes, less the terminating NUL
# the forkserver protocol this module speaks when it starts the server itself (multiprocessing.forkserver.main's)
_PROTOCOL = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_PR_SET_PDEATHSIG = 1  # prctl(2)
LEFT_CALLER, READY = b"l", b"r"  # what a preloading server writes to its ready pipe
QUICK_END_WAIT_S = 1.0  # how long the end of a quick-served launch waits for the quick server to exit
LEFT_CALLER_WAIT_S = 2.0  # how long a first launch waits for a forked server to be scheduled at all
# the pools _quiet_pools stops, in this order: the library (a part of its file name), the calls that stop its pool
_POOL_STOPS = {
    "openblas": (("blas_thread_shutdown_", ()),),  # OpenBLAS's own before-fork handler
    "libgomp": (("omp_pause_resource_all", (2,)),),  # GNU OpenMP; 2: omp_pause_hard
}
QUIET_WAIT_S = 0.01  # how long the stopped pools' threads may take to leave (they are gone within microseconds)


def warm_up(start_method: StartMethod, launching: bool = False) -> None:
    """Start the forkserver now, if it is not running, so that its imports overlap the caller's own set-up.
    ``launching``: called by a launch, which needs the server now."""
    if start_method is not StartMethod.FORKSERVER:
        return
    _fit_socket_dir()
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    server = multiprocessing.forkserver._forkserver
    multiprocessing.resource_tracker.ensure_running()  # outside the hold: its start unblocks SIGINT
    with _sigint_held():
        with server._lock:
            if _running(server):
                return
            if fork_is_safe():
                if not _importing():
                    _adopt(server, _start(fork=True))
                    return
                if not launching:
                    return  # made by a module being imported: fork once the import is over, at the launch
            if _protocol_known():
                _adopt(server, _start(fork=False))
                return
        multiprocessing.forkserver.ensure_running()  # a fresh interpreter, as multiprocessing starts it


@contextlib.contextmanager
def serving(start_method: StartMethod, nprocs: int) -> Iterator[None]:
    """The forkserver the ranks of one launch are forked from, for the launch's duration: a quick server for a
    first launch that would otherwise wait for the server's imports (see the module's docstring), else the
    server."""
    global _launched
    warm_up(start_method, launching=True)
    _reap()
    first, _launched = not _launched, True
    server = multiprocessing.forkserver._forkserver
    quick = preloading = None
    try:
        with _sigint_held(), server._lock:  # a Ctrl-C held back here is raised at its end: quick is then set
            if (
                first
                and start_method is StartMethod.FORKSERVER
                and _preloading is not None
                and _preloading.pid == server._forkserver_pid
                and not _preloading.has_all
                and not _preloading.done()
                and nprocs <= usable_cores()
                and not _importing()
                and fork_is_safe()
                and _preloading.dies_with_caller(LEFT_CALLER_WAIT_S)
            ):
                preloading = _preloading
                quick = _start(fork=True, quick=True)
                preloading.pause()
                _adopt(server, quick)
        yield
    finally:
        if quick is not None:
            _end_quick(server, quick, cast(_Preloading, preloading))  # set before quick


def _end_quick(server: multiprocessing.forkserver.ForkServer, quick: _Handle, preloading: _Preloading) -> None:
    """After the launch a quick server served: resume the server and make it the one clients connect to again."""
    preloading.resume()
    with server._lock:  # the quick server, or one multiprocessing started in its place if it died
        ending_alive_w, ending_pid = server._forkserver_alive_fd, server._forkserver_pid
        _adopt(server, preloading.handle)
    if ending_alive_w is not None:
        os.close(ending_alive_w)  # it ends with its last rank
    _exited.extend({quick.pid, ending_pid} - {None})
    _reap(QUICK_END_WAIT_S)  # it ends at once now: collected here, no zombie is left until the next launch


def fork_is_safe() -> bool:
    """True when this process may be forked and the child use torch, threads and OpenMP: Linux, a forkserver
    protocol this module knows, CUDA not initialised, and one thread once the idle pools that can be stopped
    were stopped (_quiet_pools)."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1 or torch.cuda.is_initialized():
        return False
    if not _protocol_known():
        return False
    return _thread_count() == 1 or _quiet_pools()


def _quiet_pools() -> bool:
    """Ask the libraries whose idle thread pools can be stopped to stop them, as they would themselves, and
    whether this process then runs one thread. Each starts its threads again when next needed.

    - OpenBLAS (numpy's) parks its pool before every fork, by its own fork handler: asked first.
    - GNU OpenMP (torch's intra-op threads, MKL's, oneDNN's): a child forked after its pool ran waits for ever in
      its first parallel region with more than one thread, for threads that are not in it. OpenMP 5's
      ``omp_pause_resource_all`` ends this thread's pool (another thread's stays, and is counted).

    torch's pthreadpool (XNNPACK's), which ``torch.set_num_threads(n)`` makes with n - 1 threads, has no call that
    ends them: after it, the count stays above one.
    """
    _call_in_loaded(_POOL_STOPS)
    return _threads_end()


def _threads_end(wait_s: float = QUIET_WAIT_S) -> bool:
    """Whether this process runs one thread within ``wait_s``: stopped threads leave the kernel's list a moment
    after they were told to end."""
    deadline = time.monotonic() + wait_s
    while _thread_count() > 1:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0002)
    return True


def _running(server: multiprocessing.forkserver.ForkServer) -> bool:
    """Whether ``server`` has a live server process (reaping a dead one, as multiprocessing does)."""
    if server._forkserver_pid is None:
        return False
    if os.waitpid(server._forkserver_pid, os.WNOHANG)[0] == 0:
        return True
    os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    return False


def _protocol_known() -> bool:
    return list(inspect.signature(multiprocessing.forkserver.main).parameters) == _PROTOCOL


class _Handle(NamedTuple):
    """A server this module started: what multiprocessing's ForkServer keeps of it."""

    address: str
    alive_w: int  # every client holds a copy: the server ends at EOF, when the last one is gone
    pid: int


@dataclasses.dataclass
class _Preloading:
    """The server importing PRELOAD. It writes to the ``ready_r`` pipe: LEFT_CALLER once it will die with the caller
    (a forked server, once it armed PR_SET_PDEATHSIG), then READY when its imports are done (EOF if it died)."""

    handle: _Handle
    ready_r: int
    forked: bool
    has_all: bool  # forked from a caller that had imported all of PRELOAD: ready within milliseconds
    said: bytes = b""
    ended: bool = False  # EOF: it died

    @property
    def pid(self) -> int:
        return self.handle.pid

    def done(self) -> bool:
        self._listen(0)
        return READY in self.said or self.ended

    def dies_with_caller(self, timeout: float) -> bool:
        """Whether it may be paused: a server stopped before it armed its death with the caller would outlive a
        killed caller, stopped for ever. A forked server arms it first thing; one not yet scheduled is waited for."""
        if self.forked and LEFT_CALLER not in self.said:
            self._listen(timeout)
        return LEFT_CALLER in self.said

    def _listen(self, timeout: float) -> None:
        poller = select.poll()  # not select(): the caller may hold over 1024 files
        poller.register(self.ready_r, select.POLLIN)
        if not self.ended and poller.poll(timeout * 1000):
            news = os.read(self.ready_r, 16)
            self.said += news
            self.ended = not news

    def pause(self) -> None:
        """Stop the server where it is, its imports half done: it takes no core from the ranks of a launch that
        did not wait for it. (It dies with the caller, stopped or not: see dies_with_caller.)"""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


_preloading: _Preloading | None = None  # the last server started with the whole PRELOAD
_launched = False  # a launch has been served in this process
_exited: list[int] = []  # quick servers to reap once they ended


def _adopt(server: multiprocessing.forkserver.ForkServer, handle: _Handle) -> None:
    """Make ``handle`` the server multiprocessing's clients connect to."""
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = handle


def _reap(wait_s: float = 0.0) -> None:
    """Collect the exit status of the quick servers that ended, so that none stays a zombie; wait up to ``wait_s``
    for those still ending (one that takes longer is collected at the next launch)."""
    deadline = time.monotonic() + wait_s
    for pid in list(_exited):
        if _collected(pid, deadline):
            _exited.remove(pid)


def _collected(pid: int, deadline: float) -> bool:
    """Whether the child ``pid`` ended and its status is collected (or it is no child of ours), by ``deadline``."""
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] != 0:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _start(fork: bool, quick: bool = False) -> _Handle:
    """Start a forkserver as multiprocessing's ensure_running does, either forked from this (single-threaded)
    process or as a fresh interpreter with this process's sys.path; either runs _serve. ``quick``: a quick server,
    forked, with nothing to import and nobody waiting for it to be ready. The resource tracker runs (warm_up)."""
    global _preloading
    if fork:
        output.flush_std_streams()  # else the server's copy of unwritten output is written twice
    with socket.socket(socket.AF_UNIX) as listener:
        address = multiprocessing.connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not multiprocessing.util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        ready_r, ready_w = (None, None) if quick else os.pipe()
        caller = os.getpid()
        try:
            # a quick server is always forked: a spawned one has its ready pipe
            pid = os.fork() if fork else _spawn(listener.fileno(), alive_r, cast(int, ready_w))
        except BaseException:
            for fd in (alive_r, alive_w, ready_r, ready_w):
                if fd is not None:
                    os.close(fd)
            raise
        if pid == 0:
            if ready_r is not None:
                os.close(ready_r)
            _serve(listener.fileno(), alive_r, ready_w, alive_w, caller, QUICK_PRELOAD if quick else PRELOAD)
        os.close(alive_r)
        if ready_w is not None:
            os.close(ready_w)
    handle = _Handle(address, alive_w, pid)
    if ready_r is not None:
        if _preloading is not None:
            os.close(_preloading.ready_r)
        has_all = fork and all(name in sys.modules for name in PRELOAD)
        _preloading = _Preloading(handle, ready_r, forked=fork, has_all=has_all)
    return handle


def _spawn(listener_fd: int, alive_r: int, ready_w: int) -> int:
    """A fresh interpreter running _serve, its garbage collector off from the first import (see _preload)."""
    code = (
        f"import gc; gc.disable(); import sys; sys.path[:] = {sys.path!r}; "
        f"from qaccel.launch.server import _serve; _serve({listener_fd}, {alive_r}, {ready_w})"
    )
    exe = multiprocessing.spawn.get_executable()
    args = [exe, *multiprocessing.util._args_from_interpreter_flags(), "-c", code]
    return multiprocessing.util.spawnv_passfds(
        exe,  # pyright: ignore[reportArgumentType] - typeshed says bytes; multiprocessing.forkserver passes a str too
        args,
        [listener_fd, alive_r, ready_w],
    )


def _serve(
    listener_fd: int,
    alive_r: int,
    ready_w: int | None,
    alive_w: int | None = None,
    caller: int = 0,
    preload: list[str] = PRELOAD,
) -> None:
    """The server's whole life: never returns into the caller's code, never runs its exit handlers."""
    code = 0
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held back at its start, ignored (_sigint_held)
        if alive_w is not None:  # forked: the caller's end of the pipe, std streams and Python signal handlers go
            _leave_caller(alive_w, caller)
            _say(ready_w, LEFT_CALLER)
        _preload(preload)
        _say(ready_w, READY)
        if ready_w is not None:
            os.close(ready_w)
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass  # every client is gone
    except BaseException:  # noqa: BLE001 - report, and end this process whatever happened
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _say(ready_w: int | None, news: bytes) -> None:
    if ready_w is not None:
        with contextlib.suppress(BrokenPipeError):  # the caller no longer asks
            os.write(ready_w, news)


def _leave_caller(alive_w: int, caller: int) -> None:
    """In a server forked from the caller: drop what is the caller's, as a fresh interpreter would not have it, and
    die with the caller (a paused server could not read the EOF that ends the others)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != caller:  # it died before the line above
        os._exit(0)
    os.close(alive_w)
    server = multiprocessing.forkserver._forkserver
    server._lock = threading.Lock()  # held by the caller's thread at the fork; ranks may start servers
    if server._forkserver_alive_fd is not None:  # the caller's client end of another server
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    if _preloading is not None:
        with contextlib.suppress(OSError):
            os.close(_preloading.ready_r)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # a tee or capture the caller put there is its own
    for signum in signal.valid_signals():  # as after exec: the caller's handlers do not apply here
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(signum)) and signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)


def _preload(names: list[str]) -> None:
    """Import what the ranks need with the garbage collector off, then freeze what exists: the imports create
    hundreds of thousands of objects, and collections that find no garbage cost a third of their time (≈ 0.3 s of
    torch._dynamo's second, 0.5 s of torch's and torch._dynamo's together). Frozen, those objects are never
    scanned again, in the server nor in the ranks forked from it, whose memory pages then stay shared. The few
    thousand objects of garbage the imports leave stay too: collecting them would cost a quarter of a second."""
    gc.disable()
    try:
        import_quietly(names)
    finally:
        gc.freeze()
        gc.enable()


def _importing() -> bool:
    """Whether a module is being imported: a fork now would hold it half made, and a rank would find it so."""
    modules = list(sys.modules.values())
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False) for module in modules)


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _call_in_loaded(calls: dict[str, tuple[tuple[str, tuple[int, ...]], ...]]) -> None:
    """For each library of ``calls`` (a part of a file name), in order, call its functions (name, arguments) in
    every loaded library whose file name contains it."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/" in line})
    for library_name, functions in calls.items():
        for path in paths:
            if library_name not in path.rsplit("/", 1)[-1].lower():
                continue
            with contextlib.suppress(OSError):
                library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                for name, args in functions:
                    if hasattr(library, name):
                        getattr(library, name)(*args)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while a server is started, so that it starts with SIGINT ignored, and deliver it after.

    A Ctrl-C reaches the whole foreground process group, the servers included; while one imports torch it would
    print a second KeyboardInterrupt traceback next to the caller's. Python installs no KeyboardInterrupt handler
    in a process that starts with SIGINT ignored. SIGINT is blocked first: Linux keeps a blocked signal pending even
    while it is ignored, so a Ctrl-C in this window reaches the caller when it ends. A server unblocks it (_serve).
    (Only this thread blocks it: in a caller with other threads, which only spawns a fresh interpreter, a Ctrl-C
    during those milliseconds may still go to another thread and be ignored.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change signal handlers
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _fit_socket_dir() -> None:
    """Keep the forkserver's socket path within the 107 bytes a Unix socket address holds.

    multiprocessing puts it in a ``pymp-*`` directory under TMPDIR, and a long TMPDIR (a scheduler's per-job
    one, pytest's) fails with "AF_UNIX path too long". The directory then moves to /tmp, cleaned up at exit
    like multiprocessing's own.
    """
    if len(os.path.join(multiprocessing.util.get_temp_dir(), "listener-xxxxxxxx")) <= UNIX_PATH_MAX:
        return
    short = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(short, True), exitpriority=-100)
    multiprocessing.current_process()._config["tempdir"] = short
