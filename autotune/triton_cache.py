"""Triton kernels built once per machine when several processes need the same one.

Triton's file cache lets every process that misses a kernel compile it: pytest-xdist workers, SGLang's
tensor-parallel ranks or the tuner's worker processes that start together each spend the same seconds of LLVM and
ptxas on the same kernel. `SharedBuildCache` is Triton's `FileCacheManager` with a per-kernel file lock around the
build: the first process to miss a kernel takes the lock and compiles, the others wait on it, then read the
finished files. A kernel already in the cache costs no lock.

Enable it with ``TRITON_CACHE_MANAGER=autotune.triton_cache:SharedBuildCache`` (`make test-gpu` does).

How it hooks in (Triton 3.x, triton/compiler/compiler.py): `compile` looks a kernel up with `get_group(name.json)`
and, after building it, writes that group last with `put_group`. A miss takes the lock; `put_group` releases it.
A build that raises leaves the lock to the OS, which releases it when the file is closed (the manager is dropped)
or the process ends; a waiter gives up after `WAIT_S` seconds and compiles on its own, so a lost lock costs time,
never a result.
"""

from __future__ import annotations

import os
import time

from triton.runtime.cache import FileCacheManager

WAIT_S = 900.0  # longer than any one kernel's build (the slowest measured: about 2 minutes under a full machine)
_POLL_S = 0.05


class SharedBuildCache(FileCacheManager):
    """`FileCacheManager` whose misses build under a per-kernel file lock (module docstring)."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._shared = not (override or dump)  # the dump and override folders are per process; never lock them
        self._held = None

    def get_group(self, filename: str):
        group = super().get_group(filename)
        if group is not None or not self._shared or self._held is not None:
            return group
        lock = _acquire(os.path.join(self.cache_dir, f"{filename}.lock"))
        group = super().get_group(filename)  # another process may have built it while this one waited
        if group is not None or lock is None:
            _release(lock)
            return group
        self._held = lock
        return None

    def put_group(self, filename: str, group):
        try:
            return super().put_group(filename, group)
        finally:
            held, self._held = self._held, None
            _release(held)


def _acquire(path: str):
    """The open lock file, locked; None where flock is missing or the wait ran past WAIT_S."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): every process compiles, as without this manager
        return None
    f = open(path, "a+")
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                return None
            time.sleep(_POLL_S)


def _release(f) -> None:
    if f is None:
        return
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        f.close()
