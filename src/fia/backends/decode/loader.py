"""The decode kernel module (the kernels package), imported on first use: numba's import and the kernel cache load happen
when a decode problem first needs them, not when fia is imported."""
from __future__ import annotations

K = None                    # the kernel module once `kernels()` has loaded it (read directly where it must be)


def kernels():
    """The kernel module, imported the first time (deferred on purpose: numba import + cache load)."""
    global K
    if K is None:
        from . import kernels as module
        K = module
    return K


def numba_available() -> bool:
    try:
        import numba  # noqa: F401
        return True
    except Exception:  # pragma: no cover - numba is a dependency of this backend only
        return False
