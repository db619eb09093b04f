"""autotune.triton_cache.SharedBuildCache: one process builds a missed kernel, the others wait and read its files."""

import threading
import time

import pytest

from autotune import triton_cache
from autotune.triton_cache import SharedBuildCache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def _build(manager, name):
    """What triton.compile does after a miss: the kernel's files, then its group last."""
    path = manager.put(b"binary", f"{name}.cubin")
    meta = manager.put("{}", f"{name}.json", binary=False)
    manager.put_group(f"{name}.json", {f"{name}.cubin": path, f"{name}.json": meta})


def test_a_second_process_waits_for_the_first_build(cache_dir):
    builder = SharedBuildCache("k1")
    assert builder.get_group("kern.json") is None  # a miss: this one builds, holding the kernel's lock
    seen = {}

    def other():
        seen["group"] = SharedBuildCache("k1").get_group("kern.json")
        seen["at"] = time.monotonic()

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the second lookup did not wait for the build in progress"
    built_at = time.monotonic()
    _build(builder, "kern")
    t.join(5)
    assert not t.is_alive()
    assert seen["at"] >= built_at
    assert set(seen["group"]) == {"kern.cubin", "kern.json"}  # it read the first build's files: a hit
    assert builder._held is None


def test_hits_and_other_kernels_take_no_wait(cache_dir):
    a = SharedBuildCache("k2")
    assert a.get_group("one.json") is None
    start = time.monotonic()
    b = SharedBuildCache("k2")
    assert b.get_group("two.json") is None  # another kernel of the same key: its own lock
    assert SharedBuildCache("k3").get_group("one.json") is None  # the same name under another key
    assert time.monotonic() - start < 1.0
    _build(a, "one")
    _build(b, "two")
    assert set(SharedBuildCache("k2").get_group("one.json")) == {"one.cubin", "one.json"}


def test_a_lost_lock_costs_time_not_a_result(cache_dir, monkeypatch):
    """A builder that never finishes (it raised and kept its file open): a waiter gives up after WAIT_S and
    builds the kernel itself, without holding a lock."""
    monkeypatch.setattr(triton_cache, "WAIT_S", 0.2)
    stuck = SharedBuildCache("k4")
    assert stuck.get_group("kern.json") is None
    waiter = SharedBuildCache("k4")
    start = time.monotonic()
    assert waiter.get_group("kern.json") is None
    assert 0.2 <= time.monotonic() - start < 2.0
    assert waiter._held is None
    _build(waiter, "kern")
    assert set(SharedBuildCache("k4").get_group("kern.json")) == {"kern.cubin", "kern.json"}


def test_triton_resolves_the_manager_from_its_variable(monkeypatch):
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_MANAGER", "autotune.triton_cache:SharedBuildCache")
    assert knobs.cache.manager_class is SharedBuildCache
