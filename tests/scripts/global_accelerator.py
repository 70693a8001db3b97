"""Launches through the Accelerator a module (trainlib.py, next to this script) holds as a global, and prints the
ranks' (rank, world size). Run by tests/launch/test_script_functions.py."""

import trainlib

if __name__ == "__main__":
    print(trainlib.acc.distribute(trainlib.train, all_results=True)())
