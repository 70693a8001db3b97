"""qaccel's keys in a rendezvous store others can reach: sealed values come back, anything else is ignored and
counted (said once), secrets do not show, and every rank of a session holds the same key. The stores are real
TCPStores; the stranger is a second connection without the key (tests/test_security.py runs the same as another
unix user against whole runs)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from qaccel.comm import sealed, session

pytestmark = pytest.mark.timeout(120)


def _forge(stranger, key: str, value) -> None:
    """The stranger's write, once the store holds it (a set does not wait for the server; a get on the same
    connection does, after it)."""
    stranger.set(key, value)
    stranger.get(key)


@pytest.fixture
def stores():
    """A TCPStore on 127.0.0.1 (port 0), and a stranger's connection to it."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    stranger = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))
    yield server, stranger


def test_a_sealed_value_comes_back_and_a_strangers_is_ignored_counted_and_said_once(stores, capfd):
    store, stranger = stores
    mine = sealed.Sealed(store, sealed.new_key(), rank=1).under("qaccel_stop/1/0/")
    mine.set("signal", "15")
    assert mine.value("signal") == b"15" and mine.get("signal") == b"15"
    _forge(stranger, "qaccel_stop/1/0/signal", "15")  # what qaccel wrote there before values were sealed
    assert mine.value("signal") is None and mine.get("signal") is None
    _forge(stranger, "qaccel_stop/1/0/signal", b"15" + b"\0" * sealed.TAG_BYTES)
    assert mine.value("signal") is None
    assert mine.ignored == 2
    said = capfd.readouterr().err
    assert said.count("not written by this run") == 1 and "rank 1" in said and f":{store.port}" in said, said
    assert mine.value("missing") is None and mine.ignored == 2  # a key not there is no forgery


def test_a_value_moved_to_another_key_or_written_with_another_key_fails(stores):
    store, _ = stores
    key = sealed.new_key()
    mine = sealed.Sealed(store, key, rank=0)
    mine.set("a/next/0", "7")
    store.set("a/next/1", store.get("a/next/0"))  # the same bytes under another name
    assert mine.value("a/next/0") == b"7" and mine.value("a/next/1") is None
    other_launch = sealed.Sealed(store, sealed.new_key(), rank=0)
    assert other_launch.value("a/next/0") is None
    assert sealed.Sealed(store, key, rank=0).under("a/").value("next/0") == b"7", "a prefix is part of the name"


def test_a_secret_is_not_in_the_store_and_comes_back_whole(stores):
    store, stranger = stores
    mine = sealed.Sealed(store, sealed.new_key(), rank=0)
    text = 'File "train.py", line 7: api_key = "sk-0123456789"' * 20
    mine.set("report/0", text, secret=True)
    raw = stranger.get("report/0")
    assert b"sk-0123456789" not in raw and b"train.py" not in raw
    assert mine.get("report/0", secret=True) == text.encode()
    mine.set("report/1", text, secret=True)
    assert stranger.get("report/1")[:64] != raw[:64], "a fresh nonce each time"


def test_gather_waits_past_a_strangers_values_for_the_ranks_own(stores):
    store, stranger = stores
    mine = sealed.Sealed(store, sealed.new_key(), rank=0)
    _forge(stranger, "next/1", "99")

    def late() -> None:
        time.sleep(0.3)
        mine.set("next/1", "3")

    thread = threading.Thread(target=late)
    thread.start()
    mine.set("next/0", "2")
    got = mine.gather(["next/0", "next/1"], timeout=10)
    thread.join()
    assert got == {"next/0": b"2", "next/1": b"3"} and mine.ignored == 1
    start = time.monotonic()
    assert mine.gather(["next/0", "next/2"], timeout=0.3) == {"next/0": b"2"}, "after the timeout: what is there"
    assert time.monotonic() - start < 5
    assert mine.gather(["next/2"], timeout=30, stop=lambda: True) == {}


def test_set_first_keeps_the_first_of_this_runs_values_and_overwrites_a_strangers(stores):
    store, stranger = stores
    mine = sealed.Sealed(store, sealed.new_key(), rank=0)
    assert mine.set_first("signal", "15") == b"15"
    assert mine.set_first("signal", "10") == b"15", "the first announcement stands"
    _forge(stranger, "other", "2")
    assert mine.set_first("other", "10") == b"10" and mine.value("other") == b"10"


def test_a_connection_of_its_own_shares_the_key_and_the_count(stores):
    store, stranger = stores
    mine = sealed.Sealed(store, sealed.new_key(), rank=0).under("w/")
    other = mine.connection(datetime.timedelta(seconds=5))
    assert other is not None and other.store is not store
    mine.set("k", "v")
    assert other.value("k") == b"v"
    _forge(stranger, "w/bad", "x")
    assert other.value("bad") is None and mine.ignored == 1


def _keys_of_the_ranks(acc):
    run = session.current_run()
    made = sealed.from_rank_0(acc.rank, torch.device("cpu"))  # what ranks run in place agree on
    return {"launch": run.store.seal("probe", "x"), "from_rank_0": made}


def test_every_rank_of_a_session_holds_the_same_key_and_each_launch_a_new_one(acc):
    first, second = (acc.distribute(_keys_of_the_ranks, all_results=True)(acc) for _ in range(2))
    for one in (first, second):
        assert one[0] == one[1], "the same key on both ranks"
        assert len(one[0]["from_rank_0"]) == sealed.KEY_BYTES
    assert first[0]["launch"] != second[0]["launch"] and first[0]["from_rank_0"] != second[0]["from_rank_0"]
