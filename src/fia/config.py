"""Validation mode: strict (default, every documented NPU constraint) or portable (SPEC 1.4).

Portable mode drops the constraints that exist only because of NPU hardware (float32/float64 inputs,
unaligned D, any block_size, larger limits); every semantic check stays. Switch it with
`fia.set_validation_mode("portable")`, the `fia.validation_mode("portable")` context manager, or the
environment variable FIA_VALIDATION=portable (read at import).
"""
from __future__ import annotations

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


class _Setting:
    """`with`: one per-thread setting (an attribute of _state) for the block, then the previous one (a class, not a
    generator-based context manager: integrations enter it on every float32 call)."""

    __slots__ = ("attr", "value", "prev")

    def __init__(self, attr: str, value):
        self.attr, self.value = attr, value

    def __enter__(self):
        self.prev = getattr(_state, self.attr)
        setattr(_state, self.attr, self.value)

    def __exit__(self, *exc):
        if self.prev is _UNSET:
            delattr(_state, self.attr)
        else:
            setattr(_state, self.attr, self.prev)


def validation_mode(mode: str) -> _Setting:
    """Context manager: run the block in `mode`, then restore the previous mode."""
    if mode not in _MODES:
        from .errors import input_error
        raise input_error("mode", f"one of {_MODES}", repr(mode))
    return _Setting("mode", mode)


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


def use_backend(name: str | None) -> _Setting:
    """Context manager forcing a backend by name (None = automatic)."""
    return _Setting("backend", name)
