"""Shared by the kernel-level tests (test_decode_simd.py, test_decode_vnni.py, ...). Those modules run once, not per
backend: `pytestmark = pytest.mark.backend_independent` (see conftest)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def compiling_with(module, name, value):
    """module.name = value while fresh (uncached) wrappers are compiled: the flag decides the emitted IR.
    Compile the wrappers inside it, then `frozen(...)` them: a later call with other argument types would
    otherwise compile again, after the flag's restore."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def frozen(*wrappers):
    """The numba wrappers, compiled already, with any further compilation refused (see compiling_with)."""
    for f in wrappers:
        f.disable_compile()
    return wrappers

