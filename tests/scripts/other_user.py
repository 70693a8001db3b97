"""What another local user can do to a run: started as root by tests/support/other_user.py, it drops to that user
(``UID GID``) before anything else, then runs one command and prints what it found as one line of JSON.

    other_user.py UID GID whoami
    other_user.py UID GID store PORT WORLD      # everything the run's rendezvous store lets a stranger do
    other_user.py UID GID sockets               # connect() to every forkserver socket of the machine
    other_user.py UID GID squat TMPDIR VICTIM_UID
    other_user.py UID GID plant FILE PROOF      # a torch file whose unpickling creates PROOF
    other_user.py UID GID list CHECKPOINT       # make CHECKPOINT's marker list every .pt file in it, checksums new
    other_user.py UID GID read FILE

The store command is what a user who read qaccel's source would try, on 127.0.0.1:PORT: list and read every key;
announce a stop (SIGTERM) on every stop key; ask every rank of WORLD where it is, on every session prefix seen,
then read the keys again (the ranks' answers, if they gave any); overwrite the batch-size search's keys.
"""

import base64
import datetime
import errno
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.utils.serialization  # torch.save imports it, later than the account could

from qaccel import storage  # imported as root: the account may not read the interpreter's folders


class Proof:
    """Pickled, it is a call that creates a file: what a planted checkpoint file runs when it is unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mknod, (self.path,))


def drop_to(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    assert os.getuid() == os.geteuid() == uid and os.getgid() == gid
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise AssertionError("the second account could take root back")


def whoami():
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "groups": os.getgroups(),
        "root_readable": os.access("/root", os.R_OK),
    }


def _dump(store):
    keys = store.list_keys()
    values = {}
    for key in keys:
        try:
            values[key] = base64.b64encode(store.get(key)).decode()
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile
            values[key] = f"<{exc}>"
    return values


def store_attack(port: str, world: str):
    store = dist.TCPStore("127.0.0.1", int(port), None, False, timeout=datetime.timedelta(seconds=10))
    before = _dump(store)
    prefixes = set()  # where a process group's keys live: the keys of gloo's rendezvous give it away
    for key in before:
        for mark in ("qaccel_stop/", "qaccel_where/", "cpu//", "cuda//"):
            if mark in key:
                prefixes.add(key[: key.index(mark)])
    done = []
    for prefix in sorted(prefixes):
        for session in (1, 2):
            for number in range(3):  # the session's uses of the store, numbered in order
                key = f"{prefix}qaccel_stop/{session}/{number}/signal"
                store.set(key, "15")
                done.append(key)
            for rank in range(int(world)):
                key = f"{prefix}qaccel_where/{session}/wake/{rank}"
                store.set(key, "another user asks")
                done.append(key)
    for key in before:
        if "batch_size" in key:
            store.set(key, "out of memory")
            done.append(key)
    time.sleep(3.0)  # the ranks' answers, and their stop, if they take it
    return {"before": before, "after": _dump(store), "done": done}


def sockets():
    """Every listening unix socket of the machine that a forkserver (pymp-*) or qaccel made, and what connect() gave."""
    found = {}
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and ("pymp-" in fields[7] or "qaccel" in fields[7]):
                path = fields[7]
                with socket.socket(socket.AF_UNIX) as s:
                    try:
                        s.connect(path)
                        found[path] = "connected"
                    except OSError as exc:
                        found[path] = errno.errorcode.get(exc.errno, str(exc.errno))
    return {"sockets": found}


def squat(tmpdir: str, victim_uid: str):
    base = os.path.join(tmpdir, f"qaccel-runs-{victim_uid}")
    made = []
    for path in [base] + [f"{base}.{i}" for i in range(1, 11)]:
        os.mkdir(path, 0o700)
        made.append(path)
    return {"made": made}


def plant(path: str, proof: str):
    torch.save(Proof(proof), path)
    return {"planted": path}


def relist(checkpoint: str):
    """Rewrite the marker so that it lists every .pt file of the folder with its size and checksum now."""
    marker_path = os.path.join(checkpoint, "qaccel_state.json")
    with open(marker_path) as f:
        marker = json.load(f)
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".pt"):
            marker["files"][name] = storage.sums(os.path.join(checkpoint, name)).to_json()
    os.remove(marker_path)  # the folder is writable, the file may not be
    with open(marker_path, "w") as f:
        json.dump(marker, f)
    return {"listed": sorted(marker["files"])}


def read(path: str):
    try:
        with open(path, "rb") as f:
            return {"read": len(f.read())}
    except OSError as exc:
        return {"error": errno.errorcode.get(exc.errno, str(exc.errno))}


COMMANDS = {
    "whoami": whoami,
    "store": store_attack,
    "sockets": sockets,
    "squat": squat,
    "plant": plant,
    "list": relist,
    "read": read,
}

if __name__ == "__main__":
    drop_to(int(sys.argv[1]), int(sys.argv[2]))
    result = COMMANDS[sys.argv[3]](*sys.argv[4:])
    print(json.dumps(result), flush=True)
