"""Shared by the kernel-level tests (test_decode_simd.py, test_decode_vnni.py)."""
from __future__ import annotations

import contextlib

import pytest


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


@pytest.fixture(autouse=True)
def once_under_decode(request):
    """Kernel-level tests: one run, whatever backend the suite's autouse fixture forces."""
    cs = getattr(request.node, "callspec", None)
    be = cs.params.get("fia_backend") if cs is not None else None
    if be is not None and be != "decode":
        pytest.skip("kernel tests run once, under be=decode")
