"""Tests that need a real component: a local SLURM (marker ``slurm``), two simulated hosts (marker ``two_hosts``),
a small file system that fills up (marker ``small_disk``), Open MPI's mpirun (marker ``mpi``) or a second unix account
(marker ``other_user``, support/other_user.py).

Whether the component can run here, installing what it needs with apt-get when root, and what happens when it
cannot: the test is skipped with the reason, or fails under CI=true, so that CI never passes without it.
Not a test module; tests/conftest.py applies it to every marked test.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import NoReturn

import pytest

Announce = Callable[[str], None]

SLURM_NEEDS_ROOT = (
    "SLURM is not installed, and installing it (apt-get) needs root; -m 'not slurm' leaves these tests out"
)
MPI_NEEDS_ROOT = (
    "Open MPI (mpirun) is not installed, and installing it (apt-get install openmpi-bin) needs root; "
    "-m 'not mpi' leaves these tests out"
)
TWO_HOSTS_NEED_ROOT = "two simulated hosts need root (network namespaces); -m 'not two_hosts' leaves these tests out"
TWO_HOST_TOOLS = {"ip": "iproute2", "unshare": "util-linux"}
SMALL_DISK_NEEDS_ROOT = (
    "a small file system that fills up (tmpfs) needs root to mount; -m 'not small_disk' leaves these tests out"
)


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """CI=true, as GitHub Actions, GitLab CI and most other CI services set it."""
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str, environ: Mapping[str, str] = os.environ) -> NoReturn:
    """The test's real component cannot run here: skip, saying ``reason``, or fail in CI. Every skip of the suite
    goes through here (tests/test_suite_rules.py checks), but no_gpu's."""
    __tracebackhide__ = True
    if in_ci(environ):
        pytest.fail(f"{reason} [CI=true: a test whose real component cannot run fails]", pytrace=False)
    pytest.skip(reason)


def module(name: str, extra: str = "test") -> ModuleType:
    """``import name``, a test dependency; unavailable() if it is not installed (it comes with ``extra``)."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        unavailable(f"{name} is not installed ({exc}): it comes with pip install -e '.[{extra}]'")


def installed(name: str, extra: str = "test") -> None:
    """Like module(), for a test that runs ``name`` only in scripts it starts: found, not imported (an import of
    transformers or Lightning costs seconds in the test process)."""
    __tracebackhide__ = True
    if importlib.util.find_spec(name) is None:
        unavailable(f"{name} is not installed: it comes with pip install -e '.[{extra}]'")


def no_gpu(reason: str) -> NoReturn:
    """Skip a module that needs a CUDA GPU, also under CI=true: CI runs on machines without one (the GPU tests run
    on a lent GPU machine, see docs/contributing.md). The one skip unavailable() does not decide."""
    pytest.skip(reason, allow_module_level=True)


def not_yet(reason: str) -> pytest.MarkDecorator:
    """A strict xfail, for a test of what qaccel does not do yet (``reason`` names it): the test runs, and fails
    the moment its feature lands, so that the mark is taken off then. Never for a missing component (that is
    unavailable()'s), nor to pass a test that ought to."""
    return pytest.mark.xfail(strict=True, reason=reason)


def slurm_missing(announce: Announce) -> str | None:
    """None when SLURM is installed (as root, after installing it), else why the slurm tests cannot run."""
    from .slurm_cluster import SlurmError, ensure_installed, missing_binaries  # here: slurm_cluster imports this module

    if not missing_binaries():
        return None
    if os.geteuid() != 0:
        return SLURM_NEEDS_ROOT
    try:
        ensure_installed(announce=announce)
    except SlurmError as e:
        return f"SLURM could not be installed: {e}"
    return None


def mpi_missing(announce: Announce) -> str | None:
    """None when Open MPI's mpirun is installed (as root, after installing it), else why the mpi tests cannot run."""
    if shutil.which("mpirun") is not None:
        return None
    if os.geteuid() != 0:
        return MPI_NEEDS_ROOT
    try:
        apt_get_install(["openmpi-bin"], lambda: [] if shutil.which("mpirun") else ["mpirun"], announce)
    except RuntimeError as e:
        return f"Open MPI could not be installed: {e}"
    return None


def two_hosts_missing(announce: Announce) -> str | None:
    """None when two hosts can be simulated (as root, after installing ip and unshare), else why not."""
    if os.geteuid() != 0:
        return TWO_HOSTS_NEED_ROOT

    def missing() -> list[str]:
        return [tool for tool in TWO_HOST_TOOLS if shutil.which(tool) is None]

    try:
        apt_get_install(sorted({TWO_HOST_TOOLS[tool] for tool in missing()}), missing, announce)
    except RuntimeError as e:
        return f"cannot simulate two hosts: {e}"
    probe = f"qaccelprobe{os.getpid()}"  # root in a container may still be refused network namespaces
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False)
    if made.returncode != 0:
        return f"cannot simulate two hosts: `ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30, check=False)
    return None


def small_disk_missing(announce: Announce) -> str | None:
    """None when a small tmpfs can be mounted here (root), else why the small_disk tests cannot run."""
    if os.geteuid() != 0:
        return SMALL_DISK_NEEDS_ROOT
    with tempfile.TemporaryDirectory(prefix="qaccel-tests-tmpfs-probe-") as probe:
        try:
            with small_disk(probe, 64 * 1024):
                return None
        except RuntimeError as e:
            return f"cannot mount a small file system: {e}"


@contextlib.contextmanager
def small_disk(path: str | os.PathLike, size: int) -> Iterator[str]:
    """A tmpfs of ``size`` bytes mounted on ``path`` (created if needed) for the block; root only."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if mounted.returncode != 0:
        raise RuntimeError(f"mount -t tmpfs failed: {mounted.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


def report(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Lines for pytest's header: what the slurm and two_hosts tests will find, before they run."""
    from .slurm_cluster import missing_binaries

    root = os.geteuid() == 0
    cannot = "they fail (CI=true)" if in_ci(environ) else "they are skipped"
    if not missing_binaries():
        slurm = "SLURM installed"
    elif root:
        slurm = "SLURM not installed: installing it with apt-get (root) before the first test"
    else:
        slurm = f"SLURM not installed and not root: {cannot}"
    tools = [tool for tool in TWO_HOST_TOOLS if shutil.which(tool) is None]
    if not root:
        hosts = f"not root: {cannot}"
    elif tools:
        hosts = f"root; {', '.join(tools)} missing: installing with apt-get before the first test"
    else:
        hosts = "root, ip and unshare found"
    disk = "root: mounts a tmpfs" if root else f"not root: {cannot}"
    mpi = (
        "mpirun found"
        if shutil.which("mpirun")
        else (
            "Open MPI not installed: installing it with apt-get (root) before the first test"
            if root
            else f"Open MPI not installed and not root: {cannot}"
        )
    )
    other = "root: makes a second unix account (useradd)" if root else f"not root: {cannot}"
    return [
        f"slurm tests: {slurm}",
        f"two_hosts tests: {hosts}",
        f"small_disk tests: {disk}",
        f"mpi tests: {mpi}",
        f"other_user tests: {other}",
    ]


def apt_get_install(
    packages: Sequence[str], missing: Callable[[], list[str]], announce: Announce, timeout: float = 600.0
) -> None:
    """Install ``packages`` with apt-get if ``missing()`` names anything, saying so first through ``announce``.

    pytest-xdist workers may all get here: one installs while the others wait on a lock, then find nothing missing.
    ``apt-get update`` runs only if the first attempt fails. Raises RuntimeError if apt-get cannot install them.
    """
    if not missing():
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"{', '.join(missing())} missing and no apt-get to install {' '.join(packages)}")
    with _install_lock():
        if not missing():
            return  # another worker installed them while this one waited
        announce(f"installing {' '.join(packages)} with apt-get (root) for the tests that need them ...")
        start = time.monotonic()
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if r.returncode != 0:
            u = subprocess.run(
                ["apt-get", "update"], env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout, check=False)
            if r.returncode != 0:
                out = r.stdout + r.stderr
                raise RuntimeError(
                    f"{' '.join(install)} failed (rc={r.returncode}) after apt-get update "
                    f"(rc={u.returncode}):\n{out if len(out) <= 3000 else '...' + out[-3000:]}"
                )
        announce(f"apt-get install {' '.join(packages)}: done in {time.monotonic() - start:.0f} s")


@contextlib.contextmanager
def _install_lock() -> Iterator[None]:
    """One installing process at a time on this machine."""
    path = os.path.join(tempfile.gettempdir(), "qaccel-tests-apt-get.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
