"""qaccel.storage.release: a durable file's pages leave the page cache, and what it cannot open is passed over."""

from __future__ import annotations

import os

from support import component
from support.pagecache import cached_pages, droppable

from qaccel import storage


def test_release_drops_a_durable_files_pages_and_the_file_reads_back_the_same(tmp_path):
    if why := droppable(tmp_path):
        component.unavailable(why)
    data = os.urandom(4 << 20)
    path = tmp_path / "part.bin"
    written = storage.write_bytes(data, path)
    assert cached_pages(path) > 0, "a file just written is in the page cache"
    storage.release(path)
    assert cached_pages(path) == 0
    assert path.read_bytes() == data and storage.sums(path) == written


def test_release_of_a_folder_drops_every_file_under_it_and_ignores_what_it_cannot_open(tmp_path):
    if why := droppable(tmp_path):
        component.unavailable(why)
    (tmp_path / "sub").mkdir()
    for name in ("a.bin", "sub/b.bin"):
        storage.write_bytes(os.urandom(1 << 20), tmp_path / name)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    storage.release(tmp_path)
    assert cached_pages(tmp_path / "a.bin") == cached_pages(tmp_path / "sub" / "b.bin") == 0
    storage.release(tmp_path / "missing")  # only ever a hint: nothing raises
