"""The CPU backends' worker threads: one process-wide pool, and `launch`, which runs a compiled kernel over a
list of work items on several threads (the kernels release the GIL)."""
from __future__ import annotations

import os
import threading

import numpy as np

_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool on demand."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_pool)


def pool(n: int):
    """An executor of at least n workers. A larger one replaces the pool without shutting the old one down: a
    call in another thread may hold it and still submit to it (shutdown made that submit raise). The old pool's
    idle workers exit once the last reference to it is gone (ThreadPoolExecutor's weakref callback)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fia-cpu")
            _POOL_SIZE = n
        return _POOL


def launch(fn, items: np.ndarray, t: int, args: tuple) -> None:
    """Run fn(items, counter, *args) on t threads (the calling thread included).

    The threads take the items one at a time through a shared atomic counter (dynamic scheduling: on a
    shared machine a thread may lose its core for a while, e.g. to torch's OpenMP workers spinning after
    the previous op). fn releases the GIL."""
    counter = np.zeros(1, np.int64)
    if t <= 1:
        fn(items, counter, *args)
        return
    workers = pool(t - 1)
    futs = [workers.submit(fn, items, counter, *args) for _ in range(1, t)]
    try:
        fn(items, counter, *args)
    finally:
        for f in futs:
            f.result()
