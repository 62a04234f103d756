"""The backends, in priority order; select(problem) and explain(problem)."""
from __future__ import annotations

from typing import Dict, List

from .. import caches
from ..cpu import jit
from ..config import get_backend, use_backend
from ..errors import FiaBackendUnavailable, FiaUnsupportedError
from ..problem.attention import AttentionProblem
from .base import Backend
from .decode.backend import DecodeBackend
from .prefill.backend import PrefillBackend
from .reference import ReferenceBackend
from .torchops.backend import TorchBackend

# every backend, highest priority first: the fast CPU decode (Q_S <= 16) and prefill kernels, torch ops (any
# device; the CPU stand-in while compiled kernels build), the float64 reference
_BACKENDS: List[Backend] = sorted([DecodeBackend(), PrefillBackend(), TorchBackend(), ReferenceBackend()],
                                  key=lambda b: -b.priority)


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


# (memo_key, forced backend, backends) -> (the choice, its kernel sets)
_CHOICES = caches.BoundedCache("backends.choice", 256)


def select(p: AttentionProblem) -> Backend:
    """The backend that runs p: the forced one (fia.use_backend), else the most preferred able one -- or, while
    that one's compiled kernels are not built, the best able one whose are (fia.cpu.jit tiers).

    Backends decide from the problem's metadata only (Backend.not_supported_reasons, kernel_sets), so the
    choice is memoized per parse-memo key; problems parsed without the memo decide every time."""
    forced = get_backend()
    if p.memo_key is None:
        b, sets = _choice(p, forced)
    else:
        key = (p.memo_key, forced, tuple(_BACKENDS))
        c = _CHOICES.get(key)
        if c is None:
            c = _CHOICES.put(key, _choice(p, forced))
        b, sets = c
    if sets and not jit.ready(sets):
        return tier(p, b, sets)
    return b


def _choice(p: AttentionProblem, forced) -> tuple:
    """(backend, the kernel sets that wait for a build): none for a forced backend, which compiles if it must."""
    b = _select(p)
    return b, (() if forced is not None else b.kernel_sets(p))


def best(p: AttentionProblem) -> Backend:
    """The backend automatic selection prefers for p, whether or not its kernels are loaded yet."""
    with use_backend(None):
        return _select(p)


def tier(p: AttentionProblem, best: Backend, sets) -> Backend:
    """While `best`'s kernel sets are not loaded: start their build (FIA_JIT=background) and pick the best able
    backend whose kernels are ready (the torch backend; the reference needs none)."""
    jit.request(sets)
    able = [b for b in _BACKENDS if b is not best and not b.not_supported_reasons(p)
            and jit.ready(b.kernel_sets(p))]
    return max(able, key=lambda b: b.preference(p))


def _select(p: AttentionProblem) -> Backend:
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

