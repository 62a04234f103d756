"""Call replay: the host path of a repeated call, cut to what its data need (issue 7's small call).

A decode call on a short cache spends most of its time in Python: parse (even memoized: signature, re-view,
problem), dispatch, inputs, plan lookup, addresses, the epilogue -- ~100 us per call on a slow host, against
~40 us of kernel. A replay is a backend's prepared launch for one call signature: it takes the call's query,
key and value and returns exactly what the full path returns (fresh output tensors every call).

The key (`key_of`) is computed from the call as written: the entry point, query / key / value metadata
(dtype, shape, strides; plain CPU tensors only), the keyword arguments passed (names, values, their types,
the signs of floats), the validation mode, the forced backend and torch's thread count. Calls with any other
tensor argument, a list (lengths), or anything else are never keyed: they always take the full path.

Why replaying skips validation safely: parse reads nothing of such a call but that metadata (the parse memo,
parse/memo.py, relies on the same fact), so a call equal in all of it to one that passed validation passes
again. Only successful calls are admitted, and only the second time their parse is memoized (the problem has
a memo_key), after a trial: the replay runs once on the admitting call's tensors and its outputs must equal
the full path's bit for bit, with the same shapes, strides and dtypes -- else the key is marked never to
replay. A replay returns None when its preparation went stale (e.g. the backend's tuning constants
changed); the call then takes the full path.
"""
from __future__ import annotations

import math
import threading
from itertools import compress, repeat
from operator import is_
from typing import Callable, Optional

import torch

from .config import get_backend, get_validation_mode

_Tensor = torch.Tensor
_SCALARS = frozenset({type(None), bool, int, float, str})
_ONES, _FLOATS = repeat(1.0), repeat(float)
_MAX = 64                       # keys held (cleared when full)
_NEVER = object()               # a key that does not replay (no replay offered, or the trial differed)
_TABLE: dict = {}               # key -> replay callable or _NEVER


class _Last(threading.local):
    """armed: inside `capture`; run: the (problem, backend) noted by api._run. Class defaults, so `note` -- on
    every full-path call -- reads them without a getattr default (a raised and caught AttributeError)."""
    armed = False
    run = None


_last = _Last()
stats = {"admitted": 0, "refused": 0, "replayed": 0}


def key_of(name: str, q, k, v, kw: dict) -> Optional[tuple]:
    """The call's replay key, or None when the call is not covered (see the module docstring)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if not (q.is_cpu and k.is_cpu and v.is_cpu) or q.layout != torch.strided:
        return None
    vals = tuple(kw.values())
    types = tuple(map(type, vals))                     # (True is not 1, 1 is not 1.0)
    if not _SCALARS.issuperset(types):
        return None
    signs = tuple(map(math.copysign, _ONES, compress(vals, map(is_, types, _FLOATS))))     # -0.0 vs 0.0
    try:
        return (name, q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride(),
                tuple(kw), vals, types, signs, get_validation_mode(), get_backend(), torch.get_num_threads())
    except RuntimeError:                               # a layout without strides
        return None


def run(key: tuple, q, k, v):
    """The replayed results (out, lse) of a call, or None: take the full path (then `admit`)."""
    r = _TABLE.get(key)
    if r is None or r is _NEVER:
        return None
    res = r(q, k, v)
    if res is None:                                    # stale: the full path runs and admits afresh
        _TABLE.pop(key, None)
    else:
        stats["replayed"] += 1
    return res


def capture(fn, *args, **kwargs):
    """fn(*args, **kwargs) (a full-path call) -> (its result, the (problem, backend) its run noted or None)."""
    _last.armed, _last.run = True, None
    try:
        return fn(*args, **kwargs), _last.run
    finally:
        _last.armed, _last.run = False, None         # (the noted problem holds the call's tensors)


def note(problem, backend) -> None:
    """Called by the full path (api._run) with what ran the call, kept only inside `capture`."""
    if _last.armed:
        _last.run = (problem, backend)


def admit(key: tuple, ran, q, k, v, results: tuple) -> None:
    """After a full-path call with this key that `ran` (problem, backend): store the backend's replay when the
    parse was memoized and a trial reproduces `results` exactly -- the full path's (out, lse), or (out,) for
    an entry point that returns the output alone."""
    if ran is None or key in _TABLE:
        return
    problem, backend = ran
    if problem.memo_key is None:                   # not yet memoized: maybe the next time
        return
    make: Optional[Callable] = getattr(backend, "replay", None)
    r = make(problem, q, k, v) if make is not None else None
    got = r(q, k, v) if r is not None else None
    ok = got is not None and _same(got[:len(results)], results)
    if len(_TABLE) >= _MAX:
        _TABLE.clear()
    _TABLE[key] = r if ok else _NEVER
    stats["admitted" if ok else "refused"] += 1


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(got, want: tuple) -> bool:
    """Bitwise equality of result tuples, with equal shapes, strides and dtypes."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if type(a) is not _Tensor or type(b) is not _Tensor:
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride() or a.device != b.device:
            return False
        if a.is_floating_point():
            it = _BITS[a.element_size()]
            a, b = a.view(it), b.view(it)
        if not torch.equal(a, b):
            return False
    return True


def clear() -> None:
    _TABLE.clear()
