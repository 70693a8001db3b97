"""A SIGTERM that reaches a child between its fork and its own handlers: with SIGTERM armed by qaccel.train.stopping, a
child that signals itself from an after-fork hook registered first must still die of it.

Prints whether SIGTERM was blocked in the child, then the child's exit status and whether SIGTERM is still blocked
in the parent. Run by tests/checkpoints/test_resume.py.
"""

import os
import signal


def early():  # registered before qaccel's hook, so it runs first in the child, as a signal sent at the fork would
    print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


os.register_at_fork(after_in_child=early)
from qaccel.train import stopping

stopping.arm({signal.SIGTERM})
pid = os.fork()
if pid == 0:
    for _ in range(100):  # bytecodes, where Python runs its handlers
        pass
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
