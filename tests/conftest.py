import pytest

from slurm_cluster import LocalSlurm, ensure_installed


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
    """A real 2-node SLURM (fake nodes n1, n2; see tests/slurm_cluster.py), one per
    pytest(-xdist) worker process.  Fails (never skips) if SLURM cannot be set up."""
    try:
        ensure_installed()  # no-op when everything is installed
        cluster = LocalSlurm(nodes=2).start()
    except Exception as e:  # noqa: BLE001 - any reason is a failure, with its message
        pytest.fail(f"cannot start a local SLURM cluster: {type(e).__name__}: {e}",
                    pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
