"""Loggers a library sets up with its own classes at import (as mlflow does for its own and SQLAlchemy's loggers),
in the caller but not in the ranks: each rank of the second launch reports whether the library was imported when
fn started, its loggers once fn imports it, and the root logger, whose handler the script made with another
library's formatter. Run by tests/launch/test_inherit.py with the directory holding liblog.py and libfmt.py.

    python library_loggers.py DIR
"""

import importlib
import json
import logging
import sys

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu")  # the server is forked now, before the libraries are imported
sys.path.insert(0, sys.argv[1])
import libfmt
import liblog  # noqa: F401 - its import sets up its loggers

handler = logging.StreamHandler()
handler.setFormatter(libfmt.PlainFormatter("ROOT %(message)s"))
logging.root.addHandler(handler)
logging.getLogger("liblog").setLevel(logging.WARNING)


def fn():
    at_start = {name: name in sys.modules for name in ("liblog", "libfmt")}
    library = importlib.import_module("liblog")  # fn names no global module: cloudpickle would send it, imported

    loggers = {
        name: [type(h.formatter).__name__ for h in logging.getLogger(name).handlers] for name in ("liblog", "otherlog")
    }
    return {
        "imported_at_start": at_start,
        "loggers": loggers,
        "liblog_level": logging.getLogger("liblog").level,
        "root": [type(h.formatter).__name__ for h in logging.root.handlers],
        "library": library.__name__,
    }


if __name__ == "__main__":
    acc.distribute(fn, all_results=True)()  # a first launch may come from a quick server forked now, with the libraries
    print("RANKS " + json.dumps(acc.distribute(fn, all_results=True)()))  # from the server forked before them
