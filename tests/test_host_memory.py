"""Host-memory helpers: the resident size, glibc's fixed mmap threshold and heap release."""

from __future__ import annotations

import mmap
import sys

import pytest

from spader_pipeline import host_memory


@pytest.fixture(autouse=True)
def _fresh_libc_lookup():
    host_memory._glibc.cache_clear()
    yield
    host_memory._glibc.cache_clear()


def test_rss_is_this_process_resident_size():
    # A fresh anonymous mapping, every page touched: new resident pages whatever the heap already
    # holds (a bytearray may reuse heap pages that earlier tests left resident).
    before = host_memory.rss_bytes()
    with mmap.mmap(-1, 64 << 20) as block:
        block[::4096] = b"x" * len(block[::4096])
        after = host_memory.rss_bytes()
    assert before is not None and after is not None and after - before > 32 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_the_threshold_is_set_unless_the_user_set_it_or_switched_the_helpers_off(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("SPADER_HEAP", raising=False)
    assert host_memory.bound_heap() is True
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "67108864")  # the user's trim threshold is kept
    assert host_memory.bound_heap() is True
    host_memory.release_free_heap()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # glibc read the user's own at start
    assert host_memory.bound_heap() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("SPADER_HEAP", "keep")
    host_memory._glibc.cache_clear()
    assert host_memory.bound_heap() is False
    host_memory.release_free_heap()  # a no-op, not an error
