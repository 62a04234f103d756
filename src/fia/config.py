"""Validation mode: strict (default, every documented NPU constraint) or portable (SPEC 1.4).

Portable mode drops the constraints that exist only because of NPU hardware (float32/float64 inputs,
unaligned D, any block_size, larger limits); every semantic check stays. Switch it with
`fia.set_validation_mode("portable")`, the `fia.validation_mode("portable")` context manager, or the
environment variable FIA_VALIDATION=portable (read at import).
"""
from __future__ import annotations

import contextlib
import os
import threading

STRICT = "strict"
PORTABLE = "portable"
_MODES = (STRICT, PORTABLE)

_UNSET = object()


class _State(threading.local):
    """Per-thread settings; the class attributes stand for "not set in this thread" (a getattr with a default
    raised and caught AttributeError every call: ~1 us each on a slow host, twice in a replayed call)."""
    mode = _UNSET
    backend = _UNSET


_state = _State()
_default = os.environ.get("FIA_VALIDATION", STRICT).strip().lower() or STRICT
if _default not in _MODES:
    _default = STRICT


def get_validation_mode() -> str:
    m = _state.mode
    return _default if m is _UNSET else m


def set_validation_mode(mode: str) -> None:
    """Set the validation mode of the current thread ("strict" or "portable"). Other threads keep theirs; the
    process default (for threads that never set one) is FIA_VALIDATION, read at import."""
    if mode not in _MODES:
        from .errors import input_error
        raise input_error("mode", f"one of {_MODES}", repr(mode))
    _state.mode = mode


@contextlib.contextmanager
def validation_mode(mode: str):
    """Context manager: run the block in `mode`, then restore the previous mode."""
    if mode not in _MODES:
        from .errors import input_error
        raise input_error("mode", f"one of {_MODES}", repr(mode))
    prev = _state.mode
    _state.mode = mode
    try:
        yield
    finally:
        if prev is _UNSET:
            del _state.mode
        else:
            _state.mode = prev


def is_strict() -> bool:
    return get_validation_mode() == STRICT


# --- backend choice -------------------------------------------------------------------------------
# None = automatic (the registry's priority order). A name forces that backend; if it cannot run the
# problem, FiaUnsupportedError explains why. Tests use this to run one suite per backend.
_backend_default: str | None = os.environ.get("FIA_BACKEND") or None


def get_backend() -> str | None:
    b = _state.backend
    return _backend_default if b is _UNSET else b


def set_backend(name: str | None) -> None:
    """Force a backend by name for the current thread (None = automatic choice)."""
    _state.backend = name


@contextlib.contextmanager
def use_backend(name: str | None):
    """Context manager forcing a backend by name (None = automatic)."""
    prev = _state.backend
    _state.backend = name
    try:
        yield
    finally:
        if prev is _UNSET:
            del _state.backend
        else:
            _state.backend = prev
