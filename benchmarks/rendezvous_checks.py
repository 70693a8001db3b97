"""What a rank run in place pays for the checks of its rendezvous address and of its GPU, against what torch does
anyway at that point (open a TCPStore client to rank 0's store), in one invocation.

    rank 0     resolve MASTER_ADDR and bind a socket to it (is it this machine?): comm/rendezvous.check
    rank N     resolve MASTER_ADDR and connect once to rank 0's store (is it up?), then torch's own client
    gpu        the GPU rule of environment/gpus.py (a rank's device, asked on each access to its context)

    python benchmarks/rendezvous_checks.py            # 301 runs each
    python benchmarks/rendezvous_checks.py --quick    # 51

Prints medians and the ratio of "the check + torch's client" to "torch's client" for rank N. The target: the checks
cost a rank at most 5 ms per process (they run once, where a session's start takes 100 ms or more: launch.py); the
ratio is printed beside it, and on a machine whose cores are busy it scatters from run to run by 2 x.
No OMP_NUM_THREADS is set unless you export it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch.distributed as dist

from qaccel.comm import rendezvous
from qaccel.environment import gpus


def _median_ms(body, runs: int) -> float:
    times = []
    for _ in range(runs):
        rendezvous.check.cache_clear()  # once per process in a run; every time here
        started = time.perf_counter()
        body()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    runs = 51 if parser.parse_args().quick else 301
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; {runs} runs each")
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    port = server.port

    def client() -> None:
        dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)

    def checked_client() -> None:
        rendezvous.check("127.0.0.1", port, "MASTER_ADDR", 1, False, 30.0)
        client()

    rank_0 = _median_ms(lambda: rendezvous.check("127.0.0.1", port, "MASTER_ADDR", 0, True, 30.0), runs)
    probe = _median_ms(lambda: rendezvous.check("127.0.0.1", port, "MASTER_ADDR", 1, False, 30.0), runs)
    alone, checked = _median_ms(client, runs), _median_ms(checked_client, runs)
    rule = _median_ms(lambda: gpus.choose(1, 2, 2, gpus.node_gpus()), runs * 10)
    print(f"{'what':<34}{'median':>12}")
    print(f"{'rank 0: resolve + bind':<34}{rank_0:>9.3f} ms")
    print(f"{'rank N: resolve + probe':<34}{probe:>9.3f} ms")
    print(f"{'rank N: torch client':<34}{alone:>9.3f} ms")
    print(f"{'rank N: check + torch client':<34}{checked:>9.3f} ms   {checked / alone:.2f} x")
    print(f"{'gpu rule':<34}{rule * 1e3:>9.2f} us")
    worst = max(rank_0, probe, checked - alone)  # the probe also delays the client that follows it
    verdict = "PASS" if worst <= 5.0 else "MISS"
    print(
        f"{verdict}: the checks cost at most {worst:.3f} ms per process (target <= 5 ms; {checked / alone:.2f} x "
        "torch's client)"
    )


if __name__ == "__main__":
    main()
