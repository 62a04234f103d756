"""Parse memo for the common call: query, key and value are its only tensors.

Such a call gives parse nothing to read but metadata: the three tensors' dtype, shape, strides and device,
and the values and types of the other arguments (ints, floats, strings, bools, None, lists of ints), plus
the entry point and the validation mode. Equal metadata therefore parse to the same problem over other
tensors, so the full parse (~30-40 us, issue 7's small call) runs once per signature and later calls only
re-view their tensors (`recall`). Only successful parses are stored: an invalid call never has a stored
signature and always runs the full parse, with its own error.

Not memoized (the full parse runs every time): any other tensor argument (masks, block tables, scales,
lengths as tensors: parse may read their values), tensor lists, tensor subclasses (FakeTensor in graph
mode, Parameter), tensors that are not strided CPU tensors, NumPy values, lists holding anything but ints.
"""
from __future__ import annotations

import itertools
import math
from itertools import compress, repeat
from operator import is_
from typing import Optional

import torch

from ..config import is_strict
from ..spec.layout import to_canonical
from ..spec.problem import AttentionProblem

_Tensor = torch.Tensor
_SCALARS = frozenset({type(None), bool, int, float, str, list, tuple})   # the other arguments' types covered
_INTS = frozenset({int})
_ONES, _FLOATS = repeat(1.0), repeat(float)
_MAX = 256                   # stored signatures (cleared when full: a loop over many shapes only re-parses)
_MEMO: dict = {}             # signature -> the problem without its tensors
_KEYS = itertools.count()    # AttentionProblem.memo_key of each stored signature


def _meta(t: torch.Tensor):
    """What parse (and a backend's plan) can see of a tensor without its data; None: not covered."""
    if not t.is_cpu or t.layout != torch.strided:
        return None
    return t.dtype, t.shape, t.stride()


def _where(types: tuple, t: type):
    """Indices of the arguments of type t (count and index run in C: a Python loop over ~55 arguments costs ~4 us)."""
    i = -1
    for _ in range(types.count(t)):
        i = types.index(t, i + 1)
        yield i


def signature(a: dict, api: str, aliases: Optional[dict], decode_only: bool) -> Optional[tuple]:
    """A hashable key of everything parse_fused reads from the call `a`, or None when it is not covered.
    Every argument counts with its type (True is not 1, 1 is not 1.0) and floats with their sign (-0.0)."""
    q, k, v = a["query"], a["key"], a["value"]
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    qkv = (_meta(q), _meta(k), _meta(v))
    if None in qkv:
        return None
    rest = a.copy()
    del rest["query"], rest["key"], rest["value"]
    vals = tuple(rest.values())
    types = tuple(map(type, vals))                        # (C loops: this runs on every call)
    kinds = set(types)
    if not _SCALARS.issuperset(kinds):
        return None
    if list in kinds or tuple in kinds:                  # the lengths lists: ints only, as tuples
        vals = list(vals)
        for i in itertools.chain(_where(types, list), _where(types, tuple)):
            if not _INTS.issuperset(map(type, vals[i])):
                return None
            vals[i] = tuple(vals[i])
        vals = tuple(vals)
    # -0.0 == 0.0: the signs of the float arguments, in order
    signs = tuple(map(math.copysign, _ONES, compress(vals, map(is_, types, _FLOATS)))) if float in kinds else ()
    return (api, decode_only, is_strict(), tuple(aliases.items()) if aliases else (), qkv, tuple(rest), types,
            vals, signs)


def _only_qkv(p: AttentionProblem) -> bool:
    """The problem's tensors are the canonical views of query, key and value and nothing else (what
    `recall` rebuilds); always so for a call without other tensors, checked so the memo cannot drift."""
    return p.kv.kind in ("dense", "packed") and p.kv.key_rope is None and p.mask.user_mask is None and all(
        x is None for x in (p.query_rope, p.pse, p.prefix, p.antiquant, p.full_quant, p.query_dequant,
                            p.out_quant, p.sink))


def recall(sig: tuple, a: dict) -> Optional[AttentionProblem]:
    """The stored problem of `sig` over this call's tensors, or None."""
    p = _MEMO.get(sig)
    if p is None:
        return None
    inp = p.layout.inp
    kv = type(p.kv)(to_canonical(a["key"], inp, p.KV_N), to_canonical(a["value"], inp, p.KV_N))
    return p.evolve(query=to_canonical(a["query"], inp, p.N), kv=kv)


def remember(sig: tuple, p: AttentionProblem) -> AttentionProblem:
    """Store a freshly parsed problem under `sig` (without its tensors: the memo keeps no data alive);
    returns it with its memo_key."""
    if not _only_qkv(p):
        return p
    if len(_MEMO) >= _MAX:
        _MEMO.clear()
    p = p.evolve(memo_key=next(_KEYS))
    _MEMO[sig] = p.evolve(query=None, kv=type(p.kv)(None, None))
    return p
