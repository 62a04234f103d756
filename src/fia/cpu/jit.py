"""Tiered execution: no call waits for a compiler.

FIA's fast CPU backends run Numba kernels, which a process compiles the first time it needs them unless Numba's
on-disk cache already holds them (a minute or two on a small machine). A *kernel set* names the compiled entry
points one backend calls from Python (`KERNEL_SETS`); each set is compiled as a whole: the kernels are
monomorphic, so one build serves every call of its backend.

`FIA_JIT` chooses what a call does when the kernels it would run are not compiled yet:

* ``background`` (default): the call runs on the next backend down whose kernels are ready (the torch backend:
  vectorized torch ops, no compiler), and a child process compiles the set into the shared on-disk cache, at a
  lower CPU priority. Later calls load the cached kernels as soon as the child is done and switch by themselves.
  One line is logged (Python `logging`, logger "fia") the first time a process starts such a build.
* ``sync``: compile in the calling process when first needed (the call waits).
* ``off``: never compile; kernels already in the cache are used, other calls stay on the torch backend.

A backend forced with `fia.use_backend` always runs (compiling synchronously if needed), so tests and
benchmarks measure what they ask for. `python -m fia warmup` / `fia.warmup()` build every set this CPU uses
ahead of time (CI images, containers).

What can go wrong ends at worst on the torch backend, never in a hang or a half-written cache entry: Numba writes
each cache file to a temporary name and renames it (atomic); a build that crashes, or one whose result cannot be
loaded (a read-only cache folder Numba cannot write to), marks the set failed for this process; two processes
building the same set serialize on a lock file beside the cache, the second one finding the kernels compiled.
"""
from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Tuple

log = logging.getLogger("fia")

BACKGROUND, SYNC, OFF = "background", "sync", "off"
_MODES = (BACKGROUND, SYNC, OFF)
NICE = int(os.environ.get("FIA_JIT_NICE", "10"))       # the build's niceness: the caller keeps its cores


def _env_mode() -> str:
    m = os.environ.get("FIA_JIT", BACKGROUND).strip().lower() or BACKGROUND
    return m if m in _MODES else BACKGROUND


_mode = _env_mode()


def mode() -> str:
    return _mode


def set_mode(m: str) -> None:
    """Switch the tier policy of this process (FIA_JIT sets it at import)."""
    global _mode
    if m not in _MODES:
        from ..errors import input_error
        raise input_error("mode", f"one of {_MODES}", repr(m))
    _mode = m


@dataclass(frozen=True)
class KernelSet:
    """The compiled entry points of one backend: `module`'s functions `entries`, built by `warmup`
    ("module:function", representative calls of the backend that compile every entry)."""
    name: str
    module: str
    entries: Tuple[str, ...]
    warmup: str
    variant: Optional[Callable] = None   # (function, sig) -> bool: the specializations this set needs (None: any)

    def dispatchers(self):
        mod = importlib.import_module(self.module)
        return [getattr(mod, e) for e in self.entries]


KERNEL_SETS: Dict[str, KernelSet] = {}


def register(ks: KernelSet) -> None:
    """Declare a kernel set (each compiled backend declares its own, where it is defined)."""
    KERNEL_SETS[ks.name] = ks


# ---------------------------------------------------------------------------------------------- state
class _Build:
    """One background build of a set: the child process, when it started, how it ended."""

    def __init__(self, proc: Optional[subprocess.Popen], started: float):
        self.proc, self.started = proc, started
        self.failed: Optional[str] = None


_READY: set = set()                   # sets whose every entry runs without compiling (see load)
_BUILDS: Dict[str, _Build] = {}
_NEXT_CHECK: Dict[str, float] = {}    # set -> when its cache may be read again (no build in flight)
_LOCK = threading.Lock()
_logged = False


def ready(names: Iterable[str]) -> bool:
    """Whether every set in `names` runs without compiling (checking the on-disk cache). Cheap once ready."""
    for n in names:
        if n not in _READY and not _refresh(n):
            return False
    return True


def _refresh(name: str) -> bool:
    if _mode == SYNC:                                              # the kernels compile when first called
        return True
    with _LOCK:
        if name in _READY:
            return True
        b = _BUILDS.get(name)
        if b is not None and (b.failed or (b.proc is not None and b.proc.poll() is None)):
            return False                                           # failed, or still building
        now = time.time()
        if b is None and now < _NEXT_CHECK.get(name, 0.0):         # nothing building (FIA_JIT=off): the cache's
            return False                                           # index is read at most once a second
        if load(KERNEL_SETS[name]):
            _READY.add(name)
            return True
        _NEXT_CHECK[name] = now + 1.0
        if b is not None and b.proc is not None:                   # the child ended without a loadable result
            code = b.proc.returncode
            b.failed = (f"the build process exited with status {code}" if code else
                        "the build finished but its kernels cannot be loaded (is the cache folder writable? "
                        "NUMBA_CACHE_DIR moves it)")
            log.warning("fia: %s kernels: %s; calls stay on the torch backend", name, b.failed)
        return False


def load(ks: KernelSet) -> bool:
    """Whether every entry of ks can run without compiling: compiled in this process, or in Numba's on-disk
    cache for this CPU and source (index entry and data file present; Numba then loads only the specializations
    a call uses, when it first runs them)."""
    try:
        from numba.core.compiler_lock import global_compiler_lock
        disps = ks.dispatchers()
    except Exception:                                              # numba missing or broken: never ready
        return False
    with global_compiler_lock:
        return all(_cached(d, ks.variant or _ANY) for d in disps)


def _ANY(fn, sig) -> bool:
    return True


def _cached(disp, variant) -> bool:
    if any(variant(disp.py_func, tuple(s)) for s in disp.signatures):
        return True
    cache = getattr(disp, "_cache", None)
    cf = getattr(cache, "_cache_file", None)
    if cf is None or not hasattr(cf, "_load_index"):               # caching disabled (NullCache)
        return False
    codegen = disp.targetctx.codegen()
    try:
        index = cf._load_index()                                   # {} when stale (another source or numba)
        # data files are written under a temporary name and renamed: present means complete
        return any(variant(disp.py_func, tuple(key[0])) and cache._index_key(key[0], codegen) == key
                   and os.path.exists(cf._data_path(name)) for key, name in index.items())
    except Exception:                                              # an unreadable index: rebuild
        return False


def request(names: Iterable[str]) -> None:
    """Start background builds of the sets in `names` that are neither ready nor building (mode background)."""
    if _mode != BACKGROUND:
        return
    for n in names:
        with _LOCK:
            if n in _READY or n in _BUILDS:
                continue
            _BUILDS[n] = _start(n)


def _start(name: str) -> _Build:
    global _logged
    env = dict(os.environ, FIA_JIT=SYNC)
    ks = KERNEL_SETS[name]
    cmd = [sys.executable, "-m", "fia.cpu.jit", name, ks.module, ",".join(ks.entries), ks.warmup]
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE if os.environ.get("FIA_JIT_DEBUG") else subprocess.DEVNULL,
                                preexec_fn=(lambda: os.nice(NICE)) if NICE and hasattr(os, "nice") else None,
                                start_new_session=True)
    except OSError as e:
        b = _Build(None, time.time())
        b.failed = f"the build process could not start ({e})"
        return b
    if not _logged:
        _logged = True
        log.warning("fia: compiling the %s CPU kernels in the background (pid %d, a minute or two on a small "
                    "machine); calls run on the torch backend meanwhile and switch by themselves. "
                    "`python -m fia warmup` builds them ahead of time.", name, proc.pid)
    return _Build(proc, time.time())


def describe(name: str) -> str:
    """This process's state of a set, for fia.explain."""
    if name in _READY:
        return f"{name} kernels compiled (in the cache)"
    b = _BUILDS.get(name)
    if b is None:
        m = mode()
        return (f"{name} kernels not compiled yet (FIA_JIT={m}: "
                + ("they compile in this process on first use)" if m == SYNC else
                   "they are never compiled; the torch backend runs)" if m == OFF else
                   "the first call starts their background build)"))
    if b.failed:
        return f"{name} kernels unavailable: {b.failed}"
    return (f"{name} kernels are being built in the background (pid {b.proc.pid}), started "
            f"{time.time() - b.started:.0f} s ago")


def wait(names: Iterable[str], timeout: float = 600.0) -> bool:
    """Block until the sets' background builds end (tests, benchmarks); True when all are ready."""
    end = time.time() + timeout
    names = list(names)
    while True:
        if ready(names):
            return True
        with _LOCK:
            building = [n for n in names if n not in _READY and n in _BUILDS and _BUILDS[n].failed is None
                        and _BUILDS[n].proc is not None and _BUILDS[n].proc.poll() is None]
        if not building:                               # nothing in flight: the state will not change by waiting
            return ready(names)
        if time.time() >= end:
            return False
        time.sleep(0.2)


def _forget() -> None:
    """(tests) forget this process's builds and ready sets."""
    with _LOCK:
        _READY.clear()
        _BUILDS.clear()
        _NEXT_CHECK.clear()


# ---------------------------------------------------------------------------------------------- the child
def build(name: str) -> int:
    """Compile set `name` into the on-disk cache (the child's work; also `fia.warmup`'s). Holds a lock file beside
    the cache so that two processes do not compile the same set at once; returns 0 when every entry compiled."""
    ks = KERNEL_SETS[name]
    with _file_lock(ks):
        if load(ks):                                   # another process built it meanwhile
            return 0
        mod, fn = ks.warmup.split(":")
        getattr(importlib.import_module(mod), fn)()
    if not all(d.signatures for d in ks.dispatchers()):
        return 3
    with _LOCK:
        _READY.add(name)                               # compiled in this process
    return 0


class _file_lock:
    def __init__(self, ks: KernelSet):
        self.path = None
        try:
            folder = ks.dispatchers()[0]._cache.cache_path
            os.makedirs(folder, exist_ok=True)
            self.path = os.path.join(folder, f"fia-build-{ks.module}.lock")     # sets of one module: one at a time
        except Exception:
            pass
        self.f = None

    def __enter__(self):
        if self.path is None:
            return self
        try:
            import fcntl
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        except (OSError, ImportError):
            self.f = None
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()                            # (closing releases the lock)


if __name__ == "__main__":          # python -m fia.cpu.jit <set> <module> <entries> <warmup>: a background build
    register(KernelSet(sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(",")), sys.argv[4]))
    sys.exit(build(sys.argv[1]))
