"""Numba's on-disk kernel cache, made to follow every source a kernel module compiles in.

Numba (`cache=True`) keys a cached function on the stamp of the file that defines it and nothing else: the
decode kernels' machine code also holds the functions of the other stage modules of their package, cpu/numerics.py
and the LLVM IR that cpu/simd.py, fma.py, vnni.py and amx.py emit, and the prefill kernels' holds cpu/numerics.py's
functions and cpu/gemm.py's IR. An edit to one of those files alone
-- or an upgrade of FIA that changes only them, with the old `__pycache__` left in place -- would load stale
kernels. `install()` (called by each kernel module before it defines its functions) puts a cache locator in
front of Numba's own: for a kernel module listed in DEPENDENCIES (or a module of a kernel package listed there,
"folder/": every module of the folder counts as a dependency) it keeps Numba's folder choice (NUMBA_CACHE_DIR,
`__pycache__`, the user-wide fallback for a read-only tree) and adds the hash of the dependencies' bytes to the
source stamp, so a cached index written for other sources reads as stale and the kernels are rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parent.parent          # src/fia

# kernel module or package ("folder/", path in the package) -> the files whose code its compiled functions embed;
# each kernel module declares its own (install)
DEPENDENCIES: dict = {}


def _files(module: str, root: Path) -> list:
    """A DEPENDENCIES key's dependencies: for a package, its own modules first (sorted)."""
    own = sorted(p.relative_to(root).as_posix() for p in (root / module).glob("*.py")) if module.endswith("/") else []
    return own + list(DEPENDENCIES[module])


@functools.lru_cache(maxsize=None)
def sources_sha(module: str, root: Optional[Path] = None) -> str:
    """The first 16 hex digits of the SHA-256 of a kernel module's dependencies (line endings normalized), read
    from the package (or from `root`) once per process."""
    root = PACKAGE if root is None else root
    h = hashlib.sha256()
    for name in _files(module, root):
        h.update(name.encode() + b"\0" + (root / name).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]


def module_of(py_file: str):
    """The DEPENDENCIES key of a source file, or None for a file that is not one of FIA's kernel modules."""
    try:
        rel = Path(os.path.realpath(py_file)).relative_to(PACKAGE).as_posix()
    except ValueError:
        return None
    if rel in DEPENDENCIES:
        return rel
    folder = rel.rsplit("/", 1)[0] + "/"
    return folder if folder in DEPENDENCIES else None


def install(module: Optional[str] = None, dependencies: tuple = ()) -> None:
    """Put the locator in front of Numba's (idempotent); with `module` (a kernel module's path in the package, or a
    kernel package's "folder/"), declare the files its compiled functions embed."""
    from numba.core.caching import CacheImpl, _CacheLocator

    if module is not None:
        DEPENDENCIES[module] = tuple(dependencies)

    if any(getattr(c, "_fia", False) for c in CacheImpl._locator_classes):
        return

    class SourcesLocator(_CacheLocator):
        """Numba's own locator for the file, with the dependencies' hash in the source stamp."""
        _fia = True

        def __init__(self, inner, sha: str):
            self._inner, self._sha = inner, sha

        def ensure_cache_path(self):
            self._inner.ensure_cache_path()

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_source_stamp(self):
            return (self._inner.get_source_stamp(), self._sha)

        def get_disambiguator(self):
            return self._inner.get_disambiguator()

        @classmethod
        def from_function(cls, py_func, py_file):
            module = module_of(py_file)
            if module is None:
                return None
            for other in CacheImpl._locator_classes:
                if other is not cls:
                    inner = other.from_function(py_func, py_file)
                    if inner is not None:
                        return cls(inner, sources_sha(module))
            return None

    CacheImpl._locator_classes.insert(0, SourcesLocator)
