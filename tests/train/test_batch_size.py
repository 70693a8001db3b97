"""find_executable_batch_size: Accelerate's sequence in one process, and one size agreed by every rank when only
rank 1 runs out of memory (a plain launch and torchrun).

One launch per launcher, each with several searches: the plain launch searches in two distribute() calls, then in a
third where rank 1 raises another error; torchrun searches at the top of the script (nothing joins the ranks
before it), then in a distribute() call, in place. A search under srun needs no launch of its own: srun's ranks
join in place as torchrun's do, and the ranks agree through their session's rendezvous store whoever hosts it
(srun's in-place sessions, their store hosted by rank 0, run tests/scripts/real_train.py in
tests/launch/test_real_script.py)."""

from __future__ import annotations

import time

import pytest
import torch
from support.procs import result_lines, run_script, run_torchrun, script_file

from qaccel import find_executable_batch_size, should_reduce_batch_size

SCRIPT = script_file("batch_size_search.py")
TRIED = [64, 57, 51]  # 0.9x each time, down to the first size that fits (51) on rank 1: two retries


def _oom_above(limit, tried):
    def train(batch_size, scale=1):
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return batch_size * scale

    return train


def test_one_process_retries_at_nine_tenths_and_keeps_the_size_for_the_next_call():
    tried = []
    train = find_executable_batch_size(_oom_above(120, tried), starting_batch_size=128)
    assert train(scale=2) == 230 and tried == [128, 115]
    assert train() == 115 and tried == [128, 115, 115], "the next call starts at the size reached"


def test_the_decorator_form_a_reducer_of_yours_and_running_out_at_zero():
    tried = []
    train = find_executable_batch_size(
        starting_batch_size=8, reduce_batch_size_fn=lambda: len(tried) and 8 >> len(tried)
    )(_oom_above(1, tried))
    assert train() == 1 and tried == [8, 4, 2, 1]
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        find_executable_batch_size(_oom_above(0, []), starting_batch_size=3)()


def test_errors_name_what_is_wrong():
    with pytest.raises(TypeError, match="passes the batch size to train"):
        find_executable_batch_size(_oom_above(8, []), starting_batch_size=4)(1, 2)
    with pytest.raises(ValueError, match="starting_batch_size must be a positive int"):
        find_executable_batch_size(lambda batch_size: 0, starting_batch_size=0)

    def fails(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        find_executable_batch_size(fails)()


@pytest.mark.parametrize(
    ("error", "reduce"),
    [
        (torch.OutOfMemoryError("anything"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried"),
            True,
        ),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed"), True),
        (RuntimeError("CUDA out of memory.", "a second argument"), False),
        (ValueError("CUDA out of memory."), False),
        (RuntimeError("Connection closed by peer"), False),
    ],
)
def test_which_errors_mean_out_of_memory(error, reduce):
    assert should_reduce_batch_size(error) is reduce


def _agreed(proc, calls=1, returncode=0):
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = result_lines(proc.stdout)
    assert len(results) == calls and all(r == results[0] for r in results), "every search agrees alike"
    result = results[0]
    assert result["world"] == 2
    assert [r["tried"] for r in result["ranks"]] == [TRIED, TRIED], "every rank tried the same sizes"
    assert {r["size"] for r in result["ranks"]} == {TRIED[-1]}
    assert {r["hash"] for r in result["ranks"]} == {result["reference"]}, (
        "the retried run trains as one started at 51: nothing of the failed attempts is left"
    )


@pytest.mark.timeout(240)
def test_ranks_agree_on_the_size_in_a_plain_launch_twice_then_another_error_on_one_rank_ends_a_search_with_it(tmp_path):
    proc = run_script(SCRIPT, str(tmp_path / "out"), "--twice", "--then-raise", "ValueError", cwd=tmp_path, timeout=200)
    ended = time.monotonic()
    _agreed(proc, calls=2, returncode=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["epoch_0", "epoch_1", "reference"]
    _, mark, last = proc.stderr.partition("batch_size_search: the last search starts at ")
    assert mark, proc.stderr[-6000:]
    assert "ValueError: CUDA out of memory. Tried to allocate 2.00 GiB at batch size 64" in last
    assert "raised on rank 1 of 2" in last
    assert "trying batch size 64" in last and "trying batch size 57" not in last, (
        "no retry after an error that is not about memory"
    )
    started = float(last.split(maxsplit=1)[0])
    assert ended - started < 60, "rank 0, waiting in a collective for rank 1, was stopped"


@pytest.mark.timeout(240)
def test_ranks_agree_under_torchrun_when_the_search_is_the_first_thing_on_the_ranks_and_in_a_distribute_call(tmp_path):
    """Accelerate's memory example: the Accelerator made at the top, nothing joins the ranks before the search
    (the function prepares everything itself); qaccel.utils' find_executable_batch_size joins them first. The
    script then searches again in a distribute() call, in place."""
    _agreed(run_torchrun(SCRIPT, str(tmp_path / "out"), "--top-level", cwd=tmp_path, timeout=200), calls=2)
