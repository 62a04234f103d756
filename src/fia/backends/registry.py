"""Backend priority list; select(problem) and explain(problem)."""
from __future__ import annotations

from typing import Dict, List

from ..config import get_backend
from ..errors import FiaBackendUnavailable, FiaUnsupportedError
from ..spec.problem import AttentionProblem
from .base import Backend
from .reference import ReferenceBackend

_BACKENDS: List[Backend] = [ReferenceBackend()]


def register(backend: Backend) -> None:
    _BACKENDS.append(backend)
    _BACKENDS.sort(key=lambda b: -b.priority)


def backends() -> List[Backend]:
    return list(_BACKENDS)


def by_name(name: str) -> Backend:
    for b in _BACKENDS:
        if b.name == name:
            return b
    raise FiaUnsupportedError(f"backend {name!r} does not exist; available: {[b.name for b in _BACKENDS]}")


def explain(p: AttentionProblem) -> Dict[str, List[str]]:
    """backend name -> reasons it cannot run p (empty list: it can)."""
    return {b.name: b.not_supported_reasons(p) for b in _BACKENDS}


def select(p: AttentionProblem) -> Backend:
    forced = get_backend()
    if forced is not None:
        b = by_name(forced)
        why = b.not_supported_reasons(p)
        if why:
            raise FiaBackendUnavailable(f"backend {forced!r} (forced) cannot run this problem", {forced: why})
        return b
    report, able = {}, []
    for b in _BACKENDS:                     # priority order: the first of equal preference wins
        why = b.not_supported_reasons(p)
        if why:
            report[b.name] = why
        else:
            able.append(b)
    if not able:
        raise FiaUnsupportedError("no FIA backend can run this problem", report)
    return max(able, key=lambda b: b.preference(p))


from .prefill import PrefillBackend as _Prefill; register(_Prefill())  # noqa: E402,E702  issue 8: fast CPU prefill
from .decode import DecodeBackend as _Decode; register(_Decode())  # noqa: E402,E702  issue 7: fast CPU decode
