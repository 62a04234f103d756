"""The exception classes of FIA and the aclnn status codes they carry.

Two kinds of failure are kept apart (SPEC 14):
* FiaInputError — the arguments are invalid (what the hardware rejects). It is a ValueError *and* a
  TypeError so callers catching either keep working. Status 161001 (a required tensor is None) or
  161002 (anything else invalid).
* FiaUnsupportedError — the arguments are valid per the documents but no backend of this library
  implements them. A NotImplementedError carrying each backend's reasons.
FiaRuntimeError (status 361001) is raised when the computation itself fails.
"""
from __future__ import annotations

from typing import Mapping, Sequence

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001

__all__ = [
    "ACLNN_SUCCESS", "ACLNN_ERR_PARAM_NULLPTR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_RUNTIME_ERROR",
    "FiaError", "FiaInputError", "FiaUnsupportedError", "FiaBackendUnavailable", "FiaRuntimeError",
    "FiaMemoryError",
]


class FiaError(Exception):
    """Base class of every FIA error; `status` is the aclnn status code."""

    status: int = ACLNN_ERR_RUNTIME_ERROR


class FiaInputError(FiaError, ValueError, TypeError):
    """Invalid input. `argument` names the offending argument (None when several are involved)."""

    def __init__(self, message: str, *, argument: str | None = None, status: int = ACLNN_ERR_PARAM_INVALID):
        super().__init__(message)
        self.argument = argument
        self.status = status


class FiaUnsupportedError(FiaError, NotImplementedError):
    """Valid input that no available backend implements. `reasons` maps backend name -> reasons."""

    status = ACLNN_ERR_PARAM_INVALID

    def __init__(self, message: str, reasons: Mapping[str, Sequence[str]] | None = None):
        self.reasons = {k: list(v) for k, v in (reasons or {}).items()}
        lines = [message]
        for name, why in self.reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))


class FiaBackendUnavailable(FiaUnsupportedError):
    """A backend forced with fia.use_backend(name) cannot run this problem (others might)."""


class FiaRuntimeError(FiaError, RuntimeError):
    """The computation failed after validation (status 361001)."""

    status = ACLNN_ERR_RUNTIME_ERROR


class FiaMemoryError(FiaRuntimeError, MemoryError):
    """A call would need more memory than the machine has available; raised before anything is allocated.
    `tensor` names what would not fit, `need` / `available` are bytes."""

    def __init__(self, message: str, *, tensor: str, need: int, available: int):
        super().__init__(message)
        self.tensor, self.need, self.available = tensor, need, available


def input_error(argument: str | None, expected: str, received: object, hint: str | None = None,
                *, status: int = ACLNN_ERR_PARAM_INVALID) -> FiaInputError:
    """Build the standard message: `<argument>: expected <expected>, got <received>[ (hint)]`."""
    msg = f"{argument}: expected {expected}, got {received}" if argument else f"expected {expected}, got {received}"
    if hint:
        msg += f" ({hint})"
    return FiaInputError(msg, argument=argument, status=status)
