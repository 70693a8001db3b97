"""A warnings filter on a library's warning class, set after the Accelerator: each rank of the second launch reports
whether the library was imported when fn started, and whether the filter ("error") applies once fn imports it. Run by
tests/launch/test_inherit.py with the directory holding libwarn.py (class LibWarning(UserWarning)).

    python library_warning_filter.py DIR
"""

import json
import sys
import warnings

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu")  # the server is forked now, before the library is imported
sys.path.insert(0, sys.argv[1])
import libwarn

warnings.filterwarnings("error", category=libwarn.LibWarning)


def fn():
    imported_at_start = "libwarn" in sys.modules
    import libwarn

    try:
        warnings.warn("the library warns", libwarn.LibWarning)
    except libwarn.LibWarning:
        return imported_at_start, "raised"
    return imported_at_start, "not raised"


if __name__ == "__main__":
    acc.distribute(fn, all_results=True)()  # a first launch may come from a quick server forked now, with libwarn
    print("RANKS " + json.dumps(acc.distribute(fn, all_results=True)()))  # from the server forked before it
