"""Shared fixtures, and the rule for tests that need a real component (markers slurm, two_hosts, small_disk, mpi and
other_user, see support/component.py): they run only where the component can, else they are skipped saying why, or fail under
CI=true."""

import contextlib
import signal
import sys
from pathlib import Path

import pytest

# The tests import their helpers from tests/support (``from support.procs import ...``) and tests/scripts
# (``from scripts.sessions import ...``): tests/ is on sys.path under any of pytest's import modes.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from support import component, other_user
from support.slurm_cluster import LocalSlurm

# A shell starts a background job (`cmd &`) with SIGINT ignored, and an ignored signal stays ignored across fork and
# exec: every script the tests start would inherit it, and the Ctrl-C tests would wait for a KeyboardInterrupt that
# never comes. A handled signal goes back to its default in an exec'd child, so handle it here (in each xdist worker).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: nothing to do from here
        pass

_COMPONENTS = {
    "slurm": component.slurm_missing,
    "two_hosts": component.two_hosts_missing,
    "small_disk": component.small_disk_missing,
    "mpi": component.mpi_missing,
    "other_user": other_user.missing,
}
_WHY_NOT = pytest.StashKey[dict]()


def pytest_report_header(config):
    return component.report()


def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marker in (("slurm_cluster", "slurm"), ("small_disk", "small_disk")):
            if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None:
                raise pytest.UsageError(f"{item.nodeid} uses the {fixture} fixture: mark it {marker}")


def pytest_collection_finish(session):
    """Before the first test, once per process (each xdist worker): can the selected slurm / two_hosts tests run?
    As root this installs what they miss, outside any test's timeout."""
    if session.config.option.collectonly:
        return
    why_not = session.config.stash.setdefault(_WHY_NOT, {})
    for marker, missing in _COMPONENTS.items():
        if any(item.get_closest_marker(marker) is not None for item in session.items):
            why_not[marker] = missing(lambda line: _say(session.config, line))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before its fixtures: a marked test whose component cannot run is skipped saying why, or fails in CI. Always
    raised from here, so pytest -rs folds the skips of one cause into one line."""
    for marker, reason in item.config.stash.get(_WHY_NOT, {}).items():
        if reason is not None and item.get_closest_marker(marker) is not None:
            component.unavailable(reason)


def _say(config, line: str) -> None:
    """Show ``line`` on the terminal now, past output capturing, also from a pytest-xdist worker."""
    worker = getattr(config, "workerinput", None)
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if worker is None and reporter is not None:
            reporter.write_line(line)
        else:  # an xdist worker's own reporter is not shown; its stderr is the terminal's
            sys.stderr.write(f"[{worker['workerid']}] {line}\n" if worker else f"{line}\n")
            sys.stderr.flush()


@pytest.fixture(autouse=True)
def _default_dtype_kept():
    """Importing qadence sets torch's default dtype to float64 for the whole process: a test that imports it (the
    qadence comparisons) must not change the dtype of the next test run by the same worker."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_default_dtype() != torch.float32:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def acc():
    """A 2-rank CPU Accelerator shared by the tests of one module."""
    from qaccel import Accelerator  # here, not at the top: conftest must not import torch for every test module

    return Accelerator(nprocs=2, compute_setup="cpu", timeout=60)


@pytest.fixture
def single():
    """A fresh 1-process CPU Accelerator (no ranks started)."""
    from qaccel import Accelerator

    return Accelerator(nprocs=1, compute_setup="cpu")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real 2-node SLURM (fake nodes n1, n2; see tests/support/slurm_cluster.py), one per pytest(-xdist) worker process,
    for tests marked slurm (installed, or skipped, before this runs).  Fails (never skips) if it cannot start."""
    try:
        cluster = LocalSlurm(nodes=2).start()
    except Exception as e:  # noqa: BLE001 - any reason is a failure, with its message
        pytest.fail(f"cannot start a local SLURM cluster: {type(e).__name__}: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at ``tmp_path / "disk"`` for tests marked small_disk (root; others skip)."""
    with component.small_disk(tmp_path / "disk", 2 * 2**20) as path:
        yield path
