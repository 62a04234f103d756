"""Parse memo: one signature per call's metadata; its problem stored when data play no part in it.

A call whose tensors are query, key and value only gives parse nothing to read but metadata: the tensors'
dtype, shape, strides and device, and the values and types of the other arguments (ints, floats, strings,
bools, None, lists of ints), plus the entry point and the validation mode. Equal metadata therefore parse
to the same problem over other tensors, so the full parse (~30-40 us on the benchmark's small call) runs once per
signature and later calls only re-view their tensors (`lookup`). Only successful parses are stored: an
invalid call never has a stored signature and always runs the full parse, with its own error.

A paged call (a block table besides them) is covered too: its block ids are data, range-checked on the
host, but only data (the table reaches the backend beside the cache). A stored paged problem is re-viewed
over the call's caches and table after the same range check as parse's (`_PagedRecipe`); a table with an
id out of range runs the full parse, which raises its error.

The antiquant scales and offsets (SPEC 10) are covered the same way: parse only checks their metadata and
views them (reshape, an index on a combined parameter's leading axis), so a recall replays those views over
the call's tensors (`_AntiquantRecipe`, checked against the parse it was made from).

The template mask of sparse modes 2-4 counts by its metadata too: parse checks its shape and dtype, and keeps no
mask for those modes (SPEC 15.11).

Without a signature (the full parse runs, nothing is memoized): any other tensor argument (masks, other
scales, lengths or padding sizes as tensors: parse reads their values or keeps them in the problem), tensor
lists, tensor subclasses (FakeTensor in graph mode, Parameter), tensors that are not strided CPU tensors,
NumPy values, lists holding anything but ints.
"""
from __future__ import annotations

import math
from itertools import compress, count, repeat
from operator import is_
from typing import NamedTuple, Optional

import numpy as np
import torch

from .. import caches
from ..config import is_strict
from ..problem.layout import to_canonical
from ..problem.attention import AttentionProblem, PagedKV
from ..problem.quant import AntiQuant, KVDequant
from .paged import bad_block, cache_view, table_host

_Tensor = torch.Tensor
_TENSORS = ("query", "key", "value")
# the other tensor arguments whose values never shape the problem (their metadata go into the signature):
# the block table (range-checked again on recall) and the antiquant scales / offsets (SPEC 10; viewed only)
_ANTIQUANT = ("antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
              "value_antiquant_scale", "value_antiquant_offset")
_DATA_ONLY = ("block_table",) + _ANTIQUANT
# sparse modes whose atten_mask is the 2048 x 2048 template, checked for shape and dtype and otherwise ignored
# (SPEC 15.11: parse/masking.py keeps no mask for them), so the call's signature holds the mask's metadata
_TEMPLATE_MODES = (2, 3, 4)
_SCALARS = frozenset({type(None), bool, int, float, str, list, tuple})   # the other arguments' types covered
_INTS = frozenset({int})
_SEQS = frozenset({list, tuple})
_ONES, _FLOATS = repeat(1.0), repeat(float)
_MAX = 256                   # stored signatures (fia.caches: cleared when full; a loop over many shapes re-parses)
# signature -> (problem without its tensors or None: parse each time, kv type or _PagedRecipe, memo_key,
# _AntiquantRecipe or None)
_MEMO = caches.BoundedCache("parse.memo", _MAX)
_KEYS = count()              # memo_keys
_MAX_SEEN = 4096
_SEEN = caches.BoundedSet("parse.seen", _MAX_SEEN)     # hashes of the signatures parsed once (stored the second time)
# lookups: misses - _HIT_CREDIT x hits, in [0, 2 _TRIAL]. From _TRIAL on (a third of the lookups or fewer hit) only one
# call in _PROBE looks up its signature
_TRIAL, _PROBE, _HIT_CREDIT = 64, 8, 2
_debt = 0
_calls = 0


def _meta(t: torch.Tensor):
    """What parse (and a backend's plan) can see of a tensor without its data; None: not covered."""
    if type(t) is not _Tensor or not t.is_cpu or t.layout != torch.strided or t.is_neg():
        return None                                   # (a lazily negated view: parse resolves it)
    return t.dtype, t.shape, t.stride()


def _wanted() -> bool:
    """Whether this call looks up its signature: always while lookups pay off. A stream where they do not
    (one-off signatures, like a decode loop whose KV lengths grow every step; more signatures in turn than
    the memo holds; calls it does not cover) only probes, one call in _PROBE, and pays ~1/8 of the ~5 us."""
    global _calls
    if _debt < _TRIAL:
        return True
    _calls += 1
    return _calls % _PROBE == 0


def lookup(a: dict, api: str, aliases: Optional[dict], decode_only: bool):
    """(signature, problem): the call's signature (None: not looked up or not covered) and its stored
    problem over the call's tensors (None: parse it, then `remember`)."""
    global _debt
    if not _wanted():
        return None, None
    sig = signature(a, api, aliases, decode_only)
    entry = None if sig is None else _MEMO.get(sig)
    if entry is None:
        _debt = min(_debt + 1, 2 * _TRIAL)      # (capped: a long miss streak must not delay a recovery)
        return sig, None
    _debt = max(0, _debt - _HIT_CREDIT)
    return sig, _recall(entry, a)


def signature(a: dict, api: str, aliases: Optional[dict], decode_only: bool) -> Optional[tuple]:
    """A hashable key of everything parse_fused reads from the call `a` (of the block table and the antiquant
    tensors: their metadata), or None when it is not covered. Every argument counts with its type (True is not 1, 1 is not 1.0) and
    floats with their sign (-0.0)."""
    rest = a.copy()
    tensors = [rest.pop(n) for n in _TENSORS]
    for n in _DATA_ONLY:                                  # (their names leave `rest`: part of the signature)
        if type(rest.get(n)) is _Tensor:
            tensors.append(rest.pop(n))
    if type(rest.get("atten_mask")) is _Tensor and type(rest.get("sparse_mode")) is int \
            and rest["sparse_mode"] in _TEMPLATE_MODES:   # the template: parse checks its shape and dtype only
        tensors.append(rest.pop("atten_mask"))
    vals = tuple(rest.values())
    types = tuple(map(type, vals))                        # (C loops: this runs on every call)
    kinds = set(types)
    if not _SCALARS.issuperset(kinds):                  # another tensor (or anything else): rejected cheaply
        return None
    metas = tuple(map(_meta, tensors))
    if None in metas:
        return None
    if list in kinds or tuple in kinds:                  # the lengths lists: ints only, as tuples
        vals = list(vals)
        for i in compress(range(len(types)), map(_SEQS.__contains__, types)):
            if not _INTS.issuperset(map(type, vals[i])):
                return None
            vals[i] = tuple(vals[i])
        vals = tuple(vals)
    # -0.0 == 0.0: the signs of the float arguments, in order
    signs = tuple(map(math.copysign, _ONES, compress(vals, map(is_, types, _FLOATS)))) if float in kinds else ()
    return (api, decode_only, is_strict(), tuple(aliases.items()) if aliases else (), metas, tuple(rest), types,
            vals, signs)


class _PagedRecipe(NamedTuple):
    """How `_recall` rebuilds a paged problem's PagedKV over another call's caches and block table (parse's
    paged_kv without the checks of metadata, which the signature fixes; the block ids are checked again)."""
    kv_n: int
    block_size: int
    blocks_used: np.ndarray     # [B] table columns in use
    nb: int                     # blocks in the pool

    def rebuild(self, a: dict) -> Optional[PagedKV]:
        key, value, bt = a["key"], a["value"], a["block_table"]
        host = bt.numpy()                                   # a CPU tensor (the signature's _meta)
        if bad_block(host, self.blocks_used, self.nb) is not None:
            return None                                     # the full parse raises the error
        return PagedKV(cache_view(key, self.kv_n), cache_view(value, self.kv_n), bt, self.block_size,
                       table_host(host), None, tuple(self.blocks_used.tolist()))


class _AntiquantRecipe(NamedTuple):
    """How `_recall` rebuilds a problem's AntiQuant from another call's scale / offset tensors: per slot
    (key scale, key offset, value scale, value offset) the argument, the shape parse reshaped it to and the
    index on a combined (2, ...) parameter's leading axis; parse's quant._normalize views, replayed."""
    slots: tuple                # 4 x (argument name, shape, index or None) or None (no offset)
    granularities: tuple        # (key, value)
    int4: bool

    @staticmethod
    def of(aq, a: dict) -> "Optional[_AntiquantRecipe]":
        """The recipe of a parsed AntiQuant over its call `a`, or None when replaying it does not give back
        exactly the parsed views (then the call is parsed every time)."""
        combined = type(a.get("antiquant_scale")) is _Tensor
        slots = []
        for which, part in (("key", aq.key), ("value", aq.value)):
            for kind, t in (("scale", part.scale), ("offset", part.offset)):
                if t is None:
                    slots.append(None)
                elif combined:
                    slots.append((f"antiquant_{kind}", (2,) + tuple(t.shape), 0 if which == "key" else 1))
                else:
                    slots.append((f"{which}_antiquant_{kind}", tuple(t.shape), None))
        r = _AntiquantRecipe(tuple(slots), (aq.key.granularity, aq.value.granularity), aq.int4)
        try:
            again = r.rebuild(a)
        except Exception:  # any mismatch: not memoized
            return None
        same = all((x is None and y is None) or (x is not None and y is not None and x.data_ptr() == y.data_ptr()
                                                 and x.shape == y.shape and x.stride() == y.stride())
                   for x, y in zip((again.key.scale, again.key.offset, again.value.scale, again.value.offset),
                                   (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset)))
        return r if same else None

    def rebuild(self, a: dict) -> AntiQuant:
        ts = []
        for slot in self.slots:
            if slot is None:
                ts.append(None)
                continue
            name, shape, idx = slot
            t = a[name].reshape(shape)
            ts.append(t if idx is None else t[idx])
        kg, vg = self.granularities
        return AntiQuant(KVDequant(kg, ts[0], ts[1]), KVDequant(vg, ts[2], ts[3]), self.int4)


def _rebuildable(p: AttentionProblem) -> bool:
    """The problem's tensors are the canonical views of query, key and value (and the block table, the
    antiquant parameters: see the recipes) and nothing else (what `_recall` rebuilds); checked so the memo
    cannot drift."""
    return (p.kv.kind in ("dense", "packed", "paged") and p.kv.key_rope is None and p.mask.user_mask is None
            and p.query_rope is None and p.pse is None and p.prefix is None
            and p.full_quant is None and p.query_dequant is None and p.out_quant is None and p.sink is None)


def _recall(entry: tuple, a: dict) -> Optional[AttentionProblem]:
    """A stored problem over this call's tensors, or None (a problem parsed every time)."""
    p, kv_type, _, aqr = entry
    if p is None:
        return None
    inp = p.layout.inp
    if isinstance(kv_type, _PagedRecipe):
        kv = kv_type.rebuild(a)
        if kv is None:
            return None
    else:
        kv = kv_type(to_canonical(a["key"], inp, p.KV_N), to_canonical(a["value"], inp, p.KV_N))
    aq = None if aqr is None else aqr.rebuild(a)
    return p.evolve(query=to_canonical(a["query"], inp, p.N), kv=kv, antiquant=aq)


def remember(sig: tuple, p: AttentionProblem, a: dict) -> AttentionProblem:
    """A freshly parsed problem with its memo_key (None until the signature is stored). A signature is
    stored the second time it is parsed, with the problem without its tensors when `_recall` can rebuild it
    (the memo keeps no data alive).

    A stream of one-off signatures -- a decode loop whose KV lengths grow every step -- then only pays for
    the signature: storing it, and the backends' plans keyed on it, would cost more than it returns."""
    known = _MEMO.get(sig)
    if known is not None:                         # a problem parsed every time (not rebuildable): its memo_key kept
        return p.evolve(memo_key=known[2])
    h = hash(sig)
    if h not in _SEEN:
        _SEEN.put(h)
        return p
    key = next(_KEYS)
    aqr = None if p.antiquant is None else _AntiquantRecipe.of(p.antiquant, a)
    ok = _rebuildable(p) and (p.antiquant is None or aqr is not None)
    template = p.evolve(query=None, kv=None, antiquant=None, memo_key=key) if ok else None
    kvr = type(p.kv)
    if p.kv.kind == "paged":
        kvr = _PagedRecipe(p.KV_N, p.kv.block_size, np.array(p.kv.blocks_used, dtype=np.int64), p.kv.key.shape[0])
    _MEMO.put(sig, (template, kvr, key, aqr))
    return p.evolve(memo_key=key)
