"""Settings made at a script's top level reach the ranks of a plain launch as they reach torchrun's workers, which
run that code themselves: logging, warnings filters, the default dtype and the global RNG states."""

from __future__ import annotations

import json
import logging
import logging.handlers
import multiprocessing
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from support.procs import once_per_session, result_lines, run_script, run_torchrun, script_env, script_file

from qaccel.launch import inherit

pytestmark = pytest.mark.timeout(180)


def _runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inherit")
    script = script_file("top_level_settings.py")
    out = {}
    for name, run in (("python", run_script), ("torchrun", run_torchrun)):
        log_file = tmp / f"{name}.log"
        proc = run(script, str(log_file), cwd=tmp, timeout=150)
        assert proc.returncode == 0, proc.stderr
        [result] = result_lines(proc.stdout)
        out[name] = (proc.stderr, result, log_file.read_text())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script under a plain launch and under torchrun: (stderr, result, log file) for each; run once for all
    pytest-xdist workers."""
    return once_per_session(tmp_path_factory, "inherit_runs", lambda: _runs(tmp_path_factory))


def test_rank_logging_looks_as_under_torchrun(runs):
    for launcher, (stderr, _, _) in runs.items():
        for rank in (0, 1):
            assert f"INFO|app|rank {rank} says hello" in stderr, (launcher, stderr)
        assert "must not be heard" not in stderr and "below the root level" not in stderr, launcher
        assert "silenced at the top" not in stderr, launcher


def test_a_file_handler_set_at_the_top_gets_every_ranks_records(runs):
    _, _, text = runs["python"]
    assert sorted(text.splitlines()) == ["TAG app:rank 0 says hello", "TAG app:rank 1 says hello"]


def test_library_loggers_keep_their_own_handlers(runs):
    _, result, _ = runs["python"]
    assert [r["torch_handlers"] for r in result["ranks"]] == [result["torch_handlers"]] * 2, "no duplicated handler"


def test_default_dtype_and_seeded_rngs_match_torchrun(runs):
    plain = [{k: v for k, v in r.items() if k != "torch_handlers"} for r in runs["python"][1]["ranks"]]
    torchrun = [{k: v for k, v in r.items() if k != "torch_handlers"} for r in runs["torchrun"][1]["ranks"]]
    assert plain == torchrun
    assert plain[0]["dtype"] == "torch.float64"
    assert plain[0] == plain[1], "every rank starts from the caller's state, as every torchrun worker ran the same code"


def test_capture_then_apply_restores_the_rng_states_and_leaves_handlers_alone():
    torch_handlers = list(logging.getLogger("torch").handlers)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    settings = inherit.capture()
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    inherit.apply(settings)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    assert logging.getLogger("torch").handlers == torch_handlers


def test_handlers_that_cannot_travel_are_reported_once_in_one_warning():
    """A QueueHandler on a multiprocessing queue (a common multi-process logging set-up) cannot be pickled, nor a
    StreamHandler on a stream that is no longer sys.stderr (a library's, after stderr was redirected)."""
    queue = multiprocessing.get_context("spawn").Queue()
    unpicklable = open(os.devnull, "w")  # noqa: SIM115 - a stream other than sys.stderr, open while logging holds it
    handlers = {"qaccel-test-queue": logging.handlers.QueueHandler(queue)}
    handlers.update({f"qaccel-test-stream-{i}": logging.StreamHandler(unpicklable) for i in range(6)})
    for name, handler in handlers.items():
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inherit.capture()
        ours = [str(w.message) for w in caught if "cannot be copied into the ranks" in str(w.message)]
        assert len(ours) == 1, ours
        assert "the QueueHandler of logger 'qaccel-test-queue' (" in ours[0]
        assert "the StreamHandler of logger 'qaccel-test-stream-0' (Cannot pickle files" in ours[0]
        assert ours[0].count("the StreamHandler of logger") == 4 and "; and 2 more: cannot be copied" in ours[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            inherit.capture()  # the same set: not again
    finally:
        for name, handler in handlers.items():
            logging.getLogger(name).removeHandler(handler)
        unpicklable.close()
        queue.close()


def test_settings_that_cannot_travel_do_not_stop_the_launch(tmp_path):
    script = script_file("unsendable_settings.py")
    proc = run_script(script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OUT [0, 1]" in proc.stdout
    assert "top-level settings (logging, warnings filters, RNG states, ...) cannot be sent" in proc.stderr


def _ranks(script: str, folder) -> list:
    """What each rank of ``script``'s second launch reported (its RANKS line), the script given ``folder``, which
    holds the libraries it imports after the Accelerator."""
    proc = subprocess.run(
        [sys.executable, str(script_file(script)), str(folder)],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RANKS "))[6:])


def test_a_filter_on_a_library_warning_applies_in_ranks_that_have_not_imported_the_library(tmp_path):
    """The category travels by name: a rank does not import the library to unpickle the filter (in a Jupyter
    kernel, IPython's completer warning made each rank import all of IPython), and the filter applies once the
    rank imports it."""
    (tmp_path / "libwarn.py").write_text("class LibWarning(UserWarning):\n    pass\n")
    ranks = _ranks("library_warning_filter.py", tmp_path)
    assert ranks == [[False, "raised"], [False, "raised"]], ranks


LIBLOG = """import logging


class LibFormatter(logging.Formatter):
    pass


for name in ("liblog", "otherlog"):  # its own logger, and one of a library it uses
    handler = logging.StreamHandler()
    handler.setFormatter(LibFormatter("LIB %(message)s"))
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).propagate = False
"""


def test_loggers_a_library_set_up_with_its_classes_are_left_to_its_import_in_ranks_that_have_not_imported_it(tmp_path):
    """Copying them would import the library into every rank at every launch (mlflow: about 1 s a rank) for loggers
    nothing there uses before that import, which sets them up again; the level the script gave stays. The root
    logger's handler travels whatever library its formatter comes from."""
    (tmp_path / "liblog.py").write_text(LIBLOG)
    (tmp_path / "libfmt.py").write_text("import logging\n\n\nclass PlainFormatter(logging.Formatter):\n    pass\n")
    ranks = _ranks("library_loggers.py", tmp_path)
    assert (
        ranks
        == [
            {
                "imported_at_start": {"liblog": False, "libfmt": True},
                "loggers": {"liblog": ["LibFormatter"], "otherlog": ["LibFormatter"]},
                "liblog_level": logging.WARNING,
                "root": ["PlainFormatter"],
                "library": "liblog",
            }
        ]
        * 2
    ), ranks
