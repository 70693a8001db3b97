import pytest

from slurm_cluster import LocalSlurm, ensure_installed


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
