"""The decode backend: Q_S <= 16 on the CPU, Numba kernels (decode_kernels.py).

Design (issue 7):
* grouped heads: one work item owns one KV head and all its G * Q_S query rows, so every K/V row is
  read once per item and used by the whole group (no repeat of K/V, no per-head re-reads);
* split-KV: work items are (batch, KV head, key range); long sequences are cut into ranges so that
  every core gets work, and the partials are merged through their LSEs (the math of merge.py's
  merge_partials, done inside the `merge` kernel);
* KV in place: dense / packed / tensor-list / paged caches are read where they are. Key position p
  of batch b lives at element `table[b, p // bs] * stride_block + h * stride_head + (p % bs) *
  stride_slot` of the cache's storage (paged: the block table; dense: table = batch index, bs = inf);
* fused dequantization: int8 / int4 K and V are widened per row inside the loop; per-channel,
  per-tensor and per-head factors are folded into the query (key) and the epilogue (value),
  per-token factors are applied per key;
* shared prefix: a separate pass reads the prefix once for a group of batches (all of them while
  G * Q_S * batches <= PREFIX_ROWS), and its partials are merged like one more split;
* masks, pse_shift, band geometry (Q_S > 1), left padding, lengths, learnable sink, row-invalid
  correction: applied in the kernels with the reference's rules (MASK_FILL, dead rows);
* output quantization, dtype and layout: the shared epilogue (finalize.py).

Host-side work per call is small on purpose (the small-call target): a handful of int64 arrays
describe the problem, the query is read in place by the kernel (converted, scaled and dequantized per
item), and the planning (splits) is a compiled function. That plan follows from metadata only, so it
is built once per parse-memo signature (_plan_of); a call then only passes its buffers' addresses.

Not supported (declared in not_supported_reasons, so dispatch falls back): Q_S > 16, full int8
quantization (prefill only anyway), float64 compute, non-CPU tensors, K/V/rope/prefix whose last
dimension is not contiguous.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import List, NamedTuple, Optional

import numpy as np
import torch

from ..spec.problem import AttentionProblem
from .base import Backend, BackendResult
from .prefill import PrefillBackend

MAX_Q_S = 16
PREFIX_ROWS = 64            # rows of one prefix work group: the prefix is read once per group of batches
MIN_SPLIT = 512             # fewest keys of a split (smaller splits cost more in merging than they gain)
ITEMS_PER_THREAD = 4        # split long sequences until there are about this many items per thread
CHUNK_FLOATS = 32768        # keys per chunk = CHUNK_FLOATS // head dim (256 for D = 128), measured best
PARALLEL_MIN_WORK = 16384   # keys x rows below which one thread does everything (no pool hand-off)
# The kernels' software prefetches (decode_kernels.PREFETCH_POLICY) bet that K / V come from DRAM. A launch that
# reads at most PREFETCH_MIN_BYTES of K / V runs without them: its data may well be cached (a call repeated), where
# they only cost instructions. Zen 3, session 15, bf16, one query row per KV head, prefetch toggled in process: the
# same call repeated, time without / with 0.80-0.98x at 512 KiB, 0.74-0.85x at 1 MiB, 0.62-0.75x at 2 MiB; a new
# cache each call (from DRAM) level at 512 KiB and 1 MiB, 1.02-1.32x at 2 MiB, 1.08-1.18x at 128 MiB.
PREFETCH_MIN_BYTES = 1 << 20
PREFILL_ROWS = 128          # Q_S > 1 with more rows per KV head than this: prefer the prefill backend
PREFILL_PRIORITY = PrefillBackend.priority
_BIG = 1 << 40              # "infinite" block size of unpaged storage
# [chunks whose QK ran the int16 query kernels, all chunks] x KV heads, summed over every call (atomic adds in the
# kernels): which QK path the data chose (decode_kernels.I8_QK_MAX_ERR), for tests and measurements
QK_STATS = np.zeros(2, np.int64)

_K = None                   # the kernel module, imported lazily (numba import + cache load)
_KERNEL_SETS = ("decode",)  # fia.jit: the decode_kernels entry points every call runs
_KERNEL_SETS_GENERIC = ("decode", "decode-generic")


def _kernels():
    global _K
    if _K is None:
        from . import decode_kernels
        _K = decode_kernels
    return _K


def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
        return True
    except Exception:  # pragma: no cover - numba is a dependency of this backend only
        return False


# ---------------------------------------------------------------------------------------------- buffers
_DUMMY = {}


def _dummy(dt, ndim: int = 1) -> np.ndarray:
    key = (dt, ndim)
    a = _DUMMY.get(key)
    if a is None:
        a = _DUMMY[key] = np.zeros((1,) * ndim, dtype=dt)
    return a


_DUMMY_BUF = np.zeros(16, np.uint8)          # stands for absent buffers (never read)
_DUMMY_ADDR = (_DUMMY_BUF.ctypes.data, _DUMMY_BUF.nbytes)


def _no_bufs(K) -> np.ndarray:
    """A fresh bufs [2, BUF_LEN] with every slot on the dummy buffer."""
    key = ("bufs", K.BUF_LEN)
    a = _DUMMY.get(key)
    if a is None:
        a = _DUMMY[key] = np.array([[_DUMMY_ADDR[0]] * K.BUF_LEN, [_DUMMY_ADDR[1]] * K.BUF_LEN], np.int64)
    return a.copy()


def _addr(t: Optional[torch.Tensor]):
    """(address, bytes) of the storage span of t, starting at t's first element: how query, K, V,
    rope, scales, pse and mask reach the kernels (read in place; the element kind travels separately,
    see _kind), so one compiled kernel serves every dtype. t stays alive for the call (_Inputs holds it)."""
    if t is None:
        return _DUMMY_ADDR
    if t.is_contiguous():                         # the common case, without the span loop (~0.4 us)
        n = t.nbytes
        return (t.data_ptr(), n) if n else _DUMMY_ADDR
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if s == 0:
            return _DUMMY_ADDR
        n += (s - 1) * st
    return t.data_ptr(), n * t.element_size()


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.int32: 4}
_KIND_BYTES = {0: 4.0, 1: 2.0, 2: 2.0, 3: 1.0, 4: 0.5}     # bytes per element of a kind (int4: 8 per int32)
_FUSED_KIND = {1: True, 2: True, 3: True}                  # bf16, fp16, int8: fused QK / PV kernels


def _kind(t: torch.Tensor) -> int:
    return _KINDS[t.dtype]


def _inner_contiguous(t: Optional[torch.Tensor]) -> bool:
    return t is None or t.shape[-1] <= 1 or t.stride(-1) == 1


# ---------------------------------------------------------------------------------------------- backend
class DecodeBackend(Backend):
    """Fast CPU decode: Q_S <= 16, grouped heads, split-KV, fused dequant, paged KV in place."""
    name = "decode"
    priority = 60            # above prefill (50): Q_S <= 16 comes here
    devices = ("cpu",)       # Numba CPU kernels

    def not_supported_reasons(self, p: AttentionProblem) -> List[str]:
        r = super().not_supported_reasons(p)
        if not _numba_available():
            r.append("numba is not installed")
        if p.Q_S > MAX_Q_S:
            r.append(f"Q_S = {p.Q_S} > {MAX_Q_S} (decode backend: Q_S <= {MAX_Q_S})")
        if p.full_quant is not None:
            r.append("full int8 quantization (int8 query, key and value)")
        if p.compute_dtype != torch.float32:
            r.append(f"compute dtype {p.compute_dtype} (float32 only)")
        kv = p.kv
        if kv.kind == "list":
            ts = list(kv.keys) + list(kv.values) + list(kv.key_ropes or ())
        else:
            ts = [kv.key, kv.value, kv.key_rope]
        if p.prefix is not None:
            ts += [p.prefix.key, p.prefix.value]
        if not all(_inner_contiguous(t) for t in ts):
            r.append("key/value (or rope/prefix) with a non-contiguous last dimension")
        for t in ts + [p.query, p.query_rope, p.pse]:
            if t is not None and t.dtype not in _KINDS:
                r.append(f"dtype {t.dtype}")
                break
        if p.prefix is not None and any(g.kv_lo != 0 for g in p.geometry):
            r.append("shared prefix with a KV window not starting at 0")
        return r

    def preference(self, p: AttentionProblem) -> int:
        """Q_S > 1 with more than PREFILL_ROWS query rows per KV head: rank below the prefill backend, which
        is faster there for fp16 (measured, docs/PERF_DECODE.md iteration 11 and session 9: at 256 rows
        decode / prefill bf16 17.6 / 35.7 ms, fp16 33.2 / 24.6; at 128 rows and below decode wins for bf16,
        fp16 and float32); it still runs when forced."""
        if p.Q_S > 1 and p.G * p.Q_S > PREFILL_ROWS:
            return PREFILL_PRIORITY - 1
        return self.priority

    def kernel_sets(self, p: AttentionProblem):
        """fia.jit: the decode set; with the generic float32 loops too where the IR kernels do not cover K / V
        (what _Source.generic decides per source, here from the problem's metadata)."""
        kv = p.kv
        k, v = (kv.keys[0], kv.values[0]) if kv.kind == "list" else (kv.key, kv.value)
        rope = getattr(kv, "key_rope", None) is not None or getattr(kv, "key_ropes", None) is not None
        fused = (_FUSED_KIND.get(_KINDS.get(k.dtype)) and _FUSED_KIND.get(_KINDS.get(v.dtype)) and not rope
                 and k.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0)
        return _KERNEL_SETS if fused else _KERNEL_SETS_GENERIC

    def describe(self, p: AttentionProblem) -> Optional[str]:
        if p.B == 0 or p.N == 0 or p.Q_S == 0 or (p.packed and p.T == 0) or (p.Dv == 0 and not p.want_lse):
            return "kernels: none (empty output)"
        if p.Dv == 0:
            return "kernels: none (empty output; the lse by the reference's formulas)"
        K = _kernels()
        x = _Inputs(p)
        if x.exceptional:
            return "kernels: none (NaN, infinite or huge dequant factors: the reference's element-wise formulas)"
        plan = _plan_of(p, x, K)
        names = []
        for launch in plan.own + [plan.prefix]:
            if launch is not None:
                name = _kernel_names(K, launch)
                if name not in names:
                    names.append(name)
        return "kernels: " + " | ".join(names)

    def run(self, p: AttentionProblem) -> BackendResult:
        return _run(p, _kernels())

    def replay(self, p: AttentionProblem, query, key, value, lengths: bool = False,
               extras: tuple = ()) -> Optional["_Replay"]:
        """fia.replay's prepared launch of p's call (query, key, value as passed), or None where the call
        reads more than those three tensors' data (or writes through the shared epilogue's Python).
        lengths: the call's KV lengths list varies between the calls it will serve (right padding: every
        batch's keys from position 0); the launch is then re-planned per lengths (_relength). extras: the
        call's dequantization tensors (fia.replay._TENSOR_ARGS): int8 K / V whose factors (per tensor, channel,
        head or token) are views of them are served -- per-token ones read in place at each call's addresses,
        the others re-derived from each call's."""
        if lengths and (p.mask.kind == "band" or any(g.kv_lo != 0 or g.prefix != 0 for g in p.geometry)):
            return None
        aq = p.antiquant
        views = None
        if aq is not None:
            if aq.int4 or (views := _views_of(aq, extras)) is None:
                return None
        if ((p.memo_key is None and not lengths) or p.kv.kind not in (("dense", "paged") if lengths else ("dense",))
                or p.pse is not None
                or p.mask.user_mask is not None or p.query_rope is not None or p.query_dequant is not None
                or p.prefix is not None or p.sink is not None or p.out_quant is not None or p.full_quant is not None
                or p.kv.key_rope is not None or p.packed or min(query.numel(), key.numel(), value.numel()) == 0
                or p.B == 0 or p.N == 0 or p.Dv == 0 or p.Q_S == 0):
            return None
        K = _kernels()
        x = _Inputs(p)
        if x.q is not p.query or x.exceptional:   # (the query is copied first: not a view of the call's)
            return None
        if aq is not None:                        # per-token factors read in place: parse's tensors, not copies
            src = x.sources[0]
            for tok, spec in ((src.ktok, aq.key), (src.vtok, aq.value)):
                if tok.mode and (tok.scale is not spec.scale or tok.offset is not spec.offset):
                    return None
        plan = _plan_of(p, x, K)
        if plan.prefix is not None or len(plan.own) != 1 or plan.own[0] is None:
            return None
        return _Replay(p, x, plan, K, (query, key, value), lengths, views)


def _kernel_names(K, launch: "_Launch") -> str:
    """The kernels of one launch in words (K.kernel_flags decides them; fia.explain shows this)."""
    f = int(K.kernel_flags(launch.ip))

    def one(step, dp, i8, fma, amx, eo):
        if f & amx:
            return f"{step} bf16 AMX tiles (16-key blocks; the rest AVX512-BF16)"
        if f & dp:
            return f"{step} bf16 dot products (AVX512-BF16)"
        if f & i8:
            return f"{step} int16 x int8 dot products ({K.I8_DOT})"
        if f & fma:
            return f"{step} float32 FMA" + (" (bf16 in even / odd halves)" if f & eo else "")
        return f"{step} generic float32 loops"
    parts = [one("QK", K.KF_DP_QK, K.KF_I8_QK, K.KF_FMA_QK, K.KF_AMX_QK, K.KF_EO_QK),
             one("PV", K.KF_DP_PV, K.KF_I8_PV, K.KF_FMA_PV, K.KF_AMX_PV, K.KF_EO_PV)]
    ir = f & (K.KF_DP_QK | K.KF_I8_QK | K.KF_FMA_QK)        # (the generic loops never prefetch)
    if f & K.KF_PREFETCH and ir:
        how = ["nta" if f & K.KF_NTA else "t1"] + ([] if f & K.KF_PV_K else ["V rows only"])
        ahead = [n for n, b in (("K", K.KF_AHEAD_K), ("V", K.KF_AHEAD_V)) if f & b]
        if ahead:
            how.append(f"rows ahead: {', '.join(ahead)}")
        parts.append("software prefetch" + (f" ({'; '.join(how)})" if how else ""))
    elif ir and K.DP_FLAGS & K.DP_PREFETCH and not launch.ip[K.IP_DP] & K.DP_PREFETCH:
        parts.append(f"no software prefetch (at most {PREFETCH_MIN_BYTES >> 10} KiB of K / V: likely cached)")
    hb = int(launch.ip[K.IP_HB])
    if hb > 1:
        parts.append(f"{hb} KV heads per item" + (", each chunk's rows read front to back first"
                                                  if launch.ip[K.IP_DP] & K.DP_TOUCH else ""))
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- the run
# A call = its inputs (data: addresses and contents, _Inputs) + its plan (everything that follows from
# metadata: int parameters, geometry, work split, shapes; _Plan). Problems of the same parse-memo key differ
# only in data, so their plan is built once (issue 7's small call: ~30 us of Python per call).
def _run(p: AttentionProblem, K) -> BackendResult:
    if p.B == 0 or p.N == 0 or p.Q_S == 0 or (p.packed and p.T == 0) or (p.Dv == 0 and not p.want_lse):
        out = torch.zeros(p.out_shape(), dtype=torch.float32)
        lse = torch.full(p.lse_shape(), float("inf"), dtype=torch.float32)
        return BackendResult(out, lse if p.want_lse else None)
    if p.Dv == 0:                       # an empty output, but an lse (log of the keys' weights): the reference's
        return _reference(p)
    x = _Inputs(p)
    if x.exceptional:
        return _reference(p)
    return _execute(p, x, _plan_of(p, x, K), K)


def _reference(p: AttentionProblem) -> BackendResult:
    """The call computed with the reference's formulas: for what the kernels' folded arithmetic cannot reproduce
    (NaN / infinite / huge dequant factors applied outside the loop: their inf * 0 and overflows happen per
    element; head dim 0: the lse alone). Degenerate inputs only."""
    from .reference import ReferenceBackend
    return ReferenceBackend().run(p)


class _Inputs:
    """What the kernels read, as they read it: the query with a unit-stride last dim, a byte mask, the
    tensor / channel / head dequant factors and the sink as float32 arrays, the KV sources (with the
    paged block table). The plan sees only their metadata."""

    def __init__(self, p: AttentionProblem):
        q, qr = p.query, p.query_rope                 # read in place with a unit-stride last dim
        self.q = q if q.stride(-1) == 1 else q.contiguous()
        self.qr = qr if qr is None or qr.stride(-1) == 1 else qr.contiguous()
        self.qds = None if p.query_dequant is None else p.query_dequant.scale    # (B, N, Q_S) float32
        self.pse = p.pse
        um = p.mask.user_mask
        if um is not None and um.dtype not in (torch.bool, torch.int8, torch.uint8):
            um = (um != 0).to(torch.uint8)          # legacy float16 masks: nonzero = masked
        self.mask = um
        # exceptional: factors applied outside the loop that are NaN / infinite / huge (decode_kernels.EXC_FACTOR)
        self.kchan, self.vcs, self.vco, self.exceptional = _dequant_factors(p)
        self.sink = _dummy(np.float32) if p.sink is None else p.sink.detach().to(torch.float32).contiguous().numpy()
        self.sources = list(_sources(p))
        self.prefix = None if p.prefix is None else _Source(      # (per-token dequant never comes with a prefix)
            p, p.prefix.key, p.prefix.value, None, np.zeros((_prefix_groups(p)[1], 1), np.int64), _BIG, None, 0, 1,
            per_token=False)

    def addresses(self, K) -> np.ndarray:
        """bufs [2, BUF_LEN] (address, bytes) of the query-side buffers; the KV source fills its own."""
        bufs = _no_bufs(K)
        bufs[0, K.BUF_Q], bufs[1, K.BUF_Q] = _addr(self.q)
        if self.qr is not None:
            bufs[0, K.BUF_QR], bufs[1, K.BUF_QR] = _addr(self.qr)
        if self.qds is not None:
            bufs[0, K.BUF_QDS], bufs[1, K.BUF_QDS] = _addr(self.qds)
        if self.pse is not None:
            bufs[0, K.BUF_PSE], bufs[1, K.BUF_PSE] = _addr(self.pse)
        if self.mask is not None:
            bufs[0, K.BUF_MASK], bufs[1, K.BUF_MASK] = _addr(self.mask)
        return bufs


def _chan_modes(aq):
    """Modes of the key's and the value's dequant factors (aq: an AntiQuant) applied outside the loop (tensor /
    channel / head: key folded into the query, value in merge): 0 per token, 1 scale, 2 scale and offset."""
    return tuple(0 if s.per_token else 1 + (s.offset is not None) for s in (aq.key, aq.value))


def _dequant_factors(p: AttentionProblem):
    """kchan [modes, KV_N, D] (scale, offset), vcs / vco [KV_N, Dv] float32 (dummies where absent), and whether
    one of them is exceptional (decode_kernels.fill_factors)."""
    aq = p.antiquant
    if aq is None:
        return _no_factors() + (False,)
    return _factor_arrays(_factor_meta(p), (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset))


def _factor_meta(p: AttentionProblem) -> tuple:
    """What _factor_arrays needs of p besides the tensors: granularities, modes (_chan_modes), KV_N, D, Dv."""
    aq = p.antiquant
    return (aq.key.granularity, aq.value.granularity) + _chan_modes(aq) + (p.KV_N, p.D, p.Dv)


def _factor_arrays(meta: tuple, tensors: tuple) -> tuple:
    """_dequant_factors' arrays from meta (_factor_meta) and the (key scale, key offset, value scale, value
    offset) tensors."""
    return _fill_factors(meta, _factor_specs(meta, tensors))


_GRANS = {"tensor": 0, "channel": 1, "head": 2}     # decode_kernels.GRAN_*


def _factor_specs(meta: tuple, tensors: tuple) -> np.ndarray:
    """decode_kernels.fill_factors' specs [4, FS_LEN] of the (key scale, key offset, value scale, value offset)
    tensors that are applied outside the loop (_chan_modes; the others absent: address 0). Each tensor holds
    1, H x D or H values (its granularity) in its logical order: anything else is a parse bug, raised here
    (the kernel writes that many values)."""
    K = _K
    kg, vg, kmode, vmode, H, D, Dv = meta
    specs = np.zeros((4, K.FS_LEN), np.int64)
    for f, t in enumerate(tensors):
        mode, gran, d = (kmode, kg, D) if f < 2 else (vmode, vg, Dv)
        if t is None or mode == 0 or (f % 2 == 1 and mode != 2):
            continue
        if t.dim() > 4 or t.numel() != {"tensor": 1, "channel": H * d, "head": H}[gran]:
            raise AssertionError(f"dequant factor of shape {tuple(t.shape)} for granularity {gran}")
        pad = 4 - t.dim()
        specs[f] = (t.data_ptr(), _KINDS[t.dtype], _GRANS[gran], *((1,) * pad + tuple(t.shape)),
                    *((0,) * pad + tuple(t.stride())))
    return specs


def _fill_factors(meta: tuple, specs: np.ndarray) -> tuple:
    """_dequant_factors' arrays and flag, filled from the factor tensors in place (decode_kernels.fill_factors)."""
    _, _, kmode, vmode, H, D, Dv = meta
    kchan, vcs, vco = _no_factors()
    if kmode:
        kchan = np.empty((kmode, H, D), np.float32)
    if vmode:
        vcs = np.empty((H, Dv), np.float32)
        if vmode == 2:
            vco = np.empty((H, Dv), np.float32)
    exceptional = bool(_K.fill_factors(specs, kchan, vcs, vco))
    return kchan, vcs, vco, exceptional


def _no_factors() -> tuple:
    """_dequant_factors' dummies (no dequantization outside the loop)."""
    return _dummy(np.float32, 3), _dummy(np.float32, 2), _dummy(np.float32, 2)


def _span(t: torch.Tensor) -> tuple:
    """[first, last] storage elements of t (torch strides are never negative)."""
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _views_of(aq, extras: tuple) -> Optional[tuple]:
    """For each of aq's factor tensors (key scale / offset, value scale / offset; None where absent): (index of
    the call's tensor in extras it is a view of, its storage offset from that tensor's), or None when one is not
    such a view (parse made it: it would not follow a later call's tensor). Its shape and strides are the
    key's metadata: the same in every call the replay serves."""
    specs = []
    for f in (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset):
        if f is None:
            specs.append(None)
            continue
        if f.numel() == 0:
            return None
        lo, hi = _span(f)
        for i, e in enumerate(extras):
            if (e.dtype == f.dtype and e.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                    and _span(e)[0] <= lo and hi <= _span(e)[1]):
                specs.append((i, f.storage_offset() - e.storage_offset()))
                break
        else:
            return None
    return tuple(specs)


def _view_address(spec: tuple, extras: tuple) -> int:
    """The address of a factor tensor in a replayed call: its _views_of spec applied to the call's tensors."""
    i, rel = spec
    e = extras[i]
    return e.data_ptr() + rel * e.element_size()


def _prefix_groups(p: AttentionProblem):
    """(batches per group, groups) of the shared-prefix pass: the prefix is read once per group."""
    bpg = max(1, min(p.B, PREFIX_ROWS // (p.G * p.Q_S)))
    return bpg, -(-p.B // bpg)


class _Launch(NamedTuple):
    """One attend_items call: its int parameters, work entries [w0, w1) and item schedule."""
    ip: np.ndarray
    work: np.ndarray
    w0: int
    w1: int
    items: np.ndarray       # item order (longest first when threaded)
    threads: int
    generic: Optional[np.ndarray]
    key_bytes: float        # bytes of K / V (and rope) per key and KV head (_dp_flags)


class _Plan(NamedTuple):
    """Everything of a call that follows from metadata (see _run); arrays only read by the kernels."""
    fp: np.ndarray          # [scale] float64
    geo: np.ndarray         # [GEO_LEN, B]
    W: int                  # own-key work entries
    wrange: np.ndarray      # [2, B] work entries of batch b
    own: list               # a _Launch (or None: no entries) per KV source of _Inputs.sources
    prefix: Optional[_Launch]
    prefix_rows: int        # rows of one prefix work item (batches per group x R0)
    pwrange: np.ndarray     # [2, groups] prefix work entries of a group
    mp: np.ndarray          # merge's int parameters
    obase: np.ndarray       # [3, B] output row bases (see merge)
    out_size: tuple         # the canonical view of the output as allocated (in the output layout):
    out_stride: tuple       # its size and strides, for one torch.empty_strided (empty + permute: ~2x the time)
    out_dtype: torch.dtype
    out_bytes: int


_PLANS: dict = {}
_MAX_PLANS = 256


def _plan_of(p: AttentionProblem, x: _Inputs, K) -> _Plan:
    """The plan of p, memoized per parse-memo key, thread count and tuning constants."""
    if p.memo_key is None:
        return _plan(p, x, K, max(1, torch.get_num_threads()))
    key = _plan_key(p.memo_key, K)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(p, x, K, key[1])
    return plan


def _plan_key(memo_key: int, K) -> tuple:
    """What a memoized plan depends on besides the problem's metadata: threads and the tuning constants."""
    return (memo_key,) + _tuning(K)


def _tuning(K) -> tuple:
    return (max(1, torch.get_num_threads()), MIN_SPLIT, ITEMS_PER_THREAD, CHUNK_FLOATS, PARALLEL_MIN_WORK, PREFIX_ROWS,
            PREFETCH_MIN_BYTES, K.DP_FLAGS)


def _plan(p: AttentionProblem, x: _Inputs, K, threads: int) -> _Plan:
    B, H, G, QS, Dv = p.B, p.KV_N, p.G, p.Q_S, p.Dv
    R0 = G * QS
    P = 0 if p.prefix is None else p.prefix.length
    q, qr = x.q, x.qr
    D = q.shape[-1]
    Dr = 0 if qr is None else qr.shape[-1]

    # ---- per-batch geometry: query window, effective keys, band, column offset, query row base
    has_band = p.mask.kind == "band"
    qst, qrst = q.stride(), (qr.stride() if qr is not None else (0,) * q.dim())
    if p.packed:                                  # [N, T, D]: batch b starts at row q_offset
        q_sn, q_ss, qr_sn, qr_ss = qst[0], qst[1], qrst[0], qrst[1]
        q_sb, qr_sb = q_ss, qr_ss
    else:                                         # [B, N, Q_S, D]
        q_sn, q_ss, qr_sn, qr_ss = qst[1], qst[2], qrst[1], qrst[2]
        q_sb, qr_sb = qst[0], qrst[0]
    geo, lens, kv_lo, keys_total = _geometry(p, P, q_sb, qr_sb)

    ip = [0] * K.IP_LEN
    ip[K.IP_R0], ip[K.IP_BPG], ip[K.IP_R], ip[K.IP_B] = R0, 1, R0, B
    ip[K.IP_G], ip[K.IP_QS], ip[K.IP_H] = G, QS, H
    ip[K.IP_D], ip[K.IP_DR], ip[K.IP_DV] = D, Dr, Dv
    bpg, ng = _prefix_groups(p) if P > 0 else (1, 0)
    C = _chunk(D + Dr, Dv, max(R0, bpg * R0))
    ip[K.IP_C] = C
    ip[K.IP_DP] = K.DP_FLAGS
    ip[K.IP_Q_KIND], ip[K.IP_Q_SN], ip[K.IP_Q_SS] = _kind(q), q_sn, q_ss
    if qr is not None:
        ip[K.IP_QR_KIND], ip[K.IP_QR_SN], ip[K.IP_QR_SS] = _kind(qr), qr_sn, qr_ss
    if x.qds is not None:                         # indexed by the batch's own row
        st = x.qds.stride()
        ip[K.IP_QD], ip[K.IP_QD_SB], ip[K.IP_QD_SN], ip[K.IP_QD_SS] = 1, st[0], st[1], st[2]
    kc_mode, v_chan = (0, 0) if p.antiquant is None else _chan_modes(p.antiquant)
    ip[K.IP_KC_MODE] = kc_mode

    # ---- pse / mask, physical coordinates
    ip[K.IP_PSE_KIND] = -1
    if x.pse is not None:
        st = x.pse.stride()
        ip[K.IP_PSE_KIND] = _kind(x.pse)
        ip[K.IP_PSE_B] = st[0] if x.pse.shape[0] > 1 else 0
        ip[K.IP_PSE_N], ip[K.IP_PSE_S], ip[K.IP_PSE_K] = st[1], st[2], st[3]
    um = x.mask
    if um is not None:
        st = um.stride()
        ip[K.IP_MASK], ip[K.IP_M_B], ip[K.IP_M_S], ip[K.IP_M_K] = 1, (st[0] if um.shape[0] > 1 else 0), st[1], st[2]
    ip[K.IP_BAND] = int(has_band)
    want_any = int(p.row_invalid_fix and (um is not None or has_band) and p.sink is None)
    ip[K.IP_WANT_ANY] = want_any

    # ---- own keys: work entries (batch, key range) x KV heads, HB heads per item
    hb = _heads_per_item(x.sources, H)
    ip[K.IP_HB] = hb
    work, wrange = K.split_work(lens, kv_lo, H // hb, threads, C, MIN_SPLIT, ITEMS_PER_THREAD)
    W = work.shape[1]
    ip[K.IP_COL_BASE] = P
    own = []
    for src in x.sources:
        w0, w1 = src.entries(work, wrange)
        keys = keys_total if src.batch is None else int(lens[src.batch])
        wk = work if (w0, w1) == (0, W) else np.ascontiguousarray(work[:, w0:w1])
        own.append(_launch_plan(src, ip, K, wk, w0, w1, H, R0, threads, keys) if w1 > w0 else None)

    # ---- shared prefix: batches grouped, the prefix read once per group (SPEC 7)
    prefix, pwrange, Rp = None, wrange[:, :1], R0
    if P > 0:
        Rp = bpg * R0
        phb = _heads_per_item((x.prefix,), H)
        pwork, pwrange = K.split_work(np.full(ng, P, np.int64), np.zeros(ng, np.int64), H // phb, threads, C,
                                      MIN_SPLIT, ITEMS_PER_THREAD)
        ipp = list(ip)                            # (the prefix source sets its own source ints)
        ipp[K.IP_BPG], ipp[K.IP_R], ipp[K.IP_HB] = bpg, Rp, phb
        ipp[K.IP_COL_BASE], ipp[K.IP_PREFIX_PASS] = 0, 1
        prefix = _launch_plan(x.prefix, ipp, K, pwork, 0, pwork.shape[1], H, Rp, threads, ng * P)

    # ---- merge: splits + prefix + sink, normalization, value dequant, special rows; the output is
    # written in its final layout and dtype, so the shared epilogue has nothing to copy
    out_dtype = torch.float32 if p.out_quant is not None else p.out_dtype     # int8 output: the epilogue quantizes
    shape, perm, obase, ost = _out_layout(p)
    okind = 0 if out_dtype == torch.float32 else _KINDS[out_dtype]
    lst = (p.T, 1) if p.packed else (QS, 1)
    mp = np.array([B, G, QS, H, int(P > 0), int(p.sink is not None), v_chan, want_any, bpg, int(has_band),
                   ost[0], ost[1], lst[0], lst[1], okind], np.int64)
    out_bytes = math.prod(shape) * out_dtype.itemsize
    size = shape if perm is None else tuple(shape[i] for i in perm)
    return _Plan(np.array([p.scale], np.float64), geo, W, wrange, own, prefix, Rp, pwrange, mp, obase, size,
                 tuple(_view_strides(shape, perm)), out_dtype, out_bytes)


def _geometry(p: AttentionProblem, P: int, q_sb: int, qr_sb: int):
    """geo [GEO_LEN, B] (GEO_* rows), own keys [B] and their first position [B], all own keys: one pass
    over the batches. q_sb / qr_sb: elements between batches (packed: between rows, times q_offset)."""
    band = p.mask.band_for if p.mask.kind == "band" else None
    packed = p.packed
    rows = []
    for b, g in enumerate(p.geometry):
        s1, s2 = g.s1, g.s2
        pre, nxt = band(s1, s2) if band is not None else (0, 0)
        r = g.q_offset if packed else b
        rows.append((g.q_lo, g.q_hi, s2, pre, nxt, P - g.kv_lo, r * q_sb, r * qr_sb,
                     (g.kv_hi - g.kv_lo) if s1 > 0 else 0, g.kv_lo))
    a = np.array(rows, np.int64).reshape(-1, 10).T.copy()       # (C-contiguous rows: the kernels' layout)
    return a[:8], a[8], a[9], sum(r[8] for r in rows)


def _heads_per_item(sources, H: int) -> int:
    """KV heads per item (decode_kernels.IP_HB): all H when every source's key and value hold a token's rows
    of all heads side by side (BSH / BSND, the paged [blocks, block_size, H] cache: one head's rows alone are
    D elements every H x D or more, which the CPU does not stream -- decode_kernels.DP_TOUCH), else 1."""
    if H < 2:
        return 1
    for src in sources:
        if src.rope is not None:
            return 1
        for t in (src.key, src.value):
            _, sh, ss = src._strides(t)
            if sh != t.shape[-1] or ss < H * sh:
                return 1
    return H


def _launch_plan(src: "_Source", ip: list, K, work: np.ndarray, w0: int, w1: int, H: int, R: int, threads: int,
                 keys: int) -> _Launch:
    """A source's launch: the shared int parameters (in ip) with the source's own; the items w * (H / HB) + h /
    HB in the order the threads take them. Threaded: longest first; small work (keys x H x R <
    PARALLEL_MIN_WORK) stays on the calling thread."""
    src.ints(ip, K)
    key_bytes = _key_bytes(K, ip)
    ip[K.IP_DP] = _dp_flags(K, key_bytes, keys, H)
    items, t = _schedule(work, H, R, threads, keys, ip[K.IP_HB])
    return _Launch(np.array(ip, np.int64), work, w0, w1, items, t, src.generic(), key_bytes)


def _key_bytes(K, ip) -> float:
    """Bytes per key and KV head of a launch's K / V (and rope), from the kinds and head dims in ip."""
    return float(sum(int(ip[d]) * _KIND_BYTES[int(ip[kind])]
                     for d, kind in ((K.IP_D, K.IP_K_KIND), (K.IP_DV, K.IP_V_KIND), (K.IP_DR, K.IP_R_KIND))))


def _dp_flags(K, key_bytes: float, keys: int, H: int) -> int:
    """ip[IP_DP] of a launch over `keys` keys x H KV heads of key_bytes each (_key_bytes): DP_FLAGS, without
    the prefetch bits when it reads at most PREFETCH_MIN_BYTES of K / V."""
    if keys * H * key_bytes <= PREFETCH_MIN_BYTES:
        return K.DP_FLAGS & ~(K.DP_PREFETCH_BITS | K.DP_TOUCH)
    return K.DP_FLAGS


def _schedule(work: np.ndarray, H: int, R: int, threads: int, keys: int, hb: int = 1):
    """(items in the order the threads take them, threads) of work entries x H KV heads of R rows, hb heads
    per item."""
    ng = H // hb
    n = work.shape[1] * ng
    t = min(threads, n)
    if t <= 1 or keys * H * R < PARALLEL_MIN_WORK:
        return np.arange(n, dtype=np.int64), 1
    return np.argsort(-np.repeat(work[2] - work[1], ng), kind="stable").astype(np.int64), t


def _relength(plan: _Plan, p: AttentionProblem, kv_lens: np.ndarray, K, threads: int):
    """plan (p's: one dense KV source serving every work entry, right-padded keys, no shared prefix, no band)
    for other KV lengths kv_lens [B] of the same metadata -- what _plan gives for p with those lengths,
    rebuilding only the parts they shape: the geometry's key count row (as _geometry: s2 = the batch's keys),
    the own keys, work split, item schedule (tests/test_replay.py compares the two). None where no work entry
    is left (the full path handles it)."""
    geo = plan.geo.copy()
    geo[K.GEO_S2] = kv_lens
    lens = kv_lens * (geo[K.GEO_QHI] > geo[K.GEO_QLO])                 # batches without query rows: no keys
    keys = int(lens.sum())
    launch = plan.own[0]
    ip = launch.ip
    hb = int(ip[K.IP_HB])
    work, wrange = K.split_work(lens, np.zeros(len(lens), np.int64), p.KV_N // hb, threads, int(ip[K.IP_C]),
                                MIN_SPLIT, ITEMS_PER_THREAD)
    W = work.shape[1]
    if W == 0:
        return None
    items, t = _schedule(work, p.KV_N, p.G * p.Q_S, threads, keys, hb)
    flags = _dp_flags(K, launch.key_bytes, keys, p.KV_N)
    if flags != ip[K.IP_DP]:                      # (the prefetch choice follows the bytes read)
        ip = ip.copy()
        ip[K.IP_DP] = flags
    return plan._replace(geo=geo, W=W, wrange=wrange, pwrange=wrange[:, :1],
                         own=[launch._replace(ip=ip, work=work, w0=0, w1=W, items=items, threads=t)])


def _out_layout(p: AttentionProblem):
    """The output as allocated (in the output layout) and its canonical view: (shape, permutation to the
    canonical view or None, per-batch row bases / existing rows [3, B], (head, row) strides)."""
    if not p.packed:
        return _padded_out_layout(p.layout.out, p.B, p.N, p.Q_S, p.Dv)
    N, Dv, geom = p.N, p.Dv, p.geometry
    shape, perm = ((p.T, N, Dv), (1, 0, 2)) if p.layout.out == "TND" else ((N, p.T, Dv), None)
    st = _view_strides(shape, perm)
    obase = np.array([[g.q_offset * st[1] for g in geom], [g.q_offset for g in geom],
                      [g.q_rows for g in geom]], np.int64)
    return shape, perm, obase, (st[0], st[1])


@functools.lru_cache(maxsize=256)
def _padded_out_layout(lay: str, B: int, N: int, QS: int, Dv: int):
    """_out_layout of [B, N, Q_S, Dv] outputs (a function of these alone; obase is only read)."""
    if lay in ("BSH", "BSND"):
        shape, perm = (B, QS, N, Dv), (0, 2, 1, 3)
    elif lay == "NBSD":
        shape, perm = (N, B, QS, Dv), (1, 0, 2, 3)
    else:
        shape, perm = (B, N, QS, Dv), None
    st = _view_strides(shape, perm)
    obase = np.array([[b * st[0] for b in range(B)], [b * N * QS for b in range(B)], [QS] * B], np.int64)
    return shape, perm, obase, (st[1], st[2])


def _view_strides(shape: tuple, perm: Optional[tuple]):
    """Strides of a contiguous tensor of `shape`, permuted by perm (None: as is)."""
    st = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        st[i - 1] = st[i] * shape[i]
    return st if perm is None else [st[i] for i in perm]


def _execute(p: AttentionProblem, x: _Inputs, plan: _Plan, K) -> BackendResult:
    """Allocate the partials and outputs, hand every buffer's address to the kernels, run them."""
    H, R0, Dv = p.KV_N, p.G * p.Q_S, p.Dv
    po, pm, pl, pany = _partials(plan.W, H, R0, Dv)
    qbufs = x.addresses(K)
    for src, launch in zip(x.sources, plan.own):
        if launch is not None:
            _attend(K, plan, launch, src, qbufs, x.kchan, po, pm, pl, pany)
    ppo, ppm, ppl, ppany = po, pm, pl, pany                  # (read only with a prefix)
    if plan.prefix is not None:
        ppo, ppm, ppl, ppany = _partials(plan.prefix.work.shape[1], H, plan.prefix_rows, Dv)
        _attend(K, plan, plan.prefix, x.prefix, qbufs, x.kchan, ppo, ppm, ppl, ppany)
    out = torch.empty_strided(plan.out_size, plan.out_stride, dtype=plan.out_dtype)
    lse, lse_addr = _lse_target(p.lse_shape(), p.want_lse)
    _merge(K, plan, (x.sink, x.vcs, x.vco), out, lse_addr, (po, pm, pl, pany), (ppo, ppm, ppl, ppany))
    return BackendResult(out, lse if p.want_lse else None)


def _lse_target(shape: tuple, want: bool):
    """(buffer, its (address, bytes)) merge writes the lse to: a float32 tensor when wanted, else numpy
    scratch (merge writes the lse anyway; a torch.empty costs ~3 us more per small call). The caller keeps
    the buffer alive until merge has run."""
    if want:
        lse = torch.empty(shape, dtype=torch.float32)
        return lse, (lse.data_ptr(), lse.numel() * 4)
    scratch = np.empty(shape, np.float32)
    return scratch, (scratch.ctypes.data, scratch.size * 4)


def _merge(K, plan: _Plan, factors: tuple, out: torch.Tensor, lse_addr: tuple, parts: tuple, pparts: tuple) -> None:
    """Merge the partials (own, prefix) into `out` (the plan's output, allocated) and the lse at lse_addr;
    factors: _Inputs' (sink, vcs, vco)."""
    obufs = np.array([[out.data_ptr(), lse_addr[0]], [plan.out_bytes, lse_addr[1]]], np.int64)
    K.merge(plan.mp, plan.geo, *parts, plan.wrange, *pparts, plan.pwrange, *factors, plan.obase, obufs)


class _Replay:
    """A call's launch prepared once (fia.replay): the plan, the buffer table with the query, key and value
    slots refilled from each call's tensors (same metadata: same spans, offsets of the canonical views from
    the tensors passed), the output allocated directly in its final layout (the epilogue's result for this
    problem). Returns (out, lse) as the entry point's full path does, or None when the plan went stale.

    With `lengths` the calls it serves pass KV lengths that vary (a decode loop): each call's lengths are
    checked as parse checks them (1 or >= B values in [0, KV_S]; anything else: None, and the full path
    raises its error) and its plan is the admitting one re-planned for them (_relength, a few per replay
    kept)."""

    _MAX_LENGTHS = 8                # plans kept per lengths replay (cleared when full)

    def __init__(self, p: AttentionProblem, x: _Inputs, plan: _Plan, K, tensors: tuple, lengths: bool = False,
                 aq_views: Optional[tuple] = None):
        src = x.sources[0]
        self.memo_key = p.memo_key
        self.bufs = x.addresses(K)                  # [2, BUF_LEN]: spans fixed by the metadata
        src.addresses(self.bufs, K)
        self.slots = (K.BUF_Q, K.BUF_K, K.BUF_V)
        views = (x.q, src.key, src.value)           # the canonical views the kernels read
        self.deltas = tuple(c.data_ptr() - t.data_ptr() for c, t in zip(views, tensors))
        self.bufs[0, list(self.slots)] = 0          # (no address of the admitting call survives)
        # _Inputs' dummies only (no sink here; dequant factors: made per call from its tensors, see _factors):
        # no tensor of the admitting call is kept
        self.aq = None
        self.tok_slots = ()
        self.tok_follow = (False, False)
        if aq_views is not None:                # (the factors' metadata; their tensors: each call's views)
            self.aq = (_factor_meta(p), aq_views)
            aq = p.antiquant                    # (specs of the admitting call; no address of it survives)
            self.fspecs = _factor_specs(self.aq[0], (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset))
            self.fslots = tuple(f for f in range(4) if self.fspecs[f, 0] != 0)
            self.fspecs[:, 0] = 0
            x.kchan, x.vcs, x.vco = _no_factors()
            # per-token factors (read in place): (buffer slot, index in aq_views) per tensor, each call's address;
            # factors stored by paged block follow each call's block table
            slots = ((src.ktok, K.BUF_KTS, K.BUF_KTO, 0), (src.vtok, K.BUF_VTS, K.BUF_VTO, 2))
            self.tok_slots = tuple((slot, j + i) for tok, s0, s1, j in slots if tok.mode
                                   for i, slot in enumerate((s0, s1)) if aq_views[j + i] is not None)
            self.bufs[0, [slot for slot, _ in self.tok_slots]] = 0
            self.tok_follow = tuple(bool(tok.mode) and tok.tbl is src.tbl for tok in (src.ktok, src.vtok))
        self.kchan, self.factors = x.kchan, (x.sink, x.vcs, x.vco)
        self.tbls = (src.tbl, src.ktok.tbl, src.vtok.tbl)
        from ..finalize import expected_outputs
        self.out_shape, _, lse_shape = expected_outputs(p)      # the epilogue's output = the plan's, contiguous
        self.want_lse, self.lse_shape = p.want_lse, lse_shape
        # unwanted lse: one scratch per replay (merge only writes it: concurrent calls may share it)
        self.scratch = None if p.want_lse else _lse_target(p.lse_shape(), False)
        self.lse_bytes = math.prod(lse_shape) * 4 if p.want_lse else self.scratch[1][1]
        self.rows = (p.KV_N, p.G * p.Q_S, p.Dv)
        # paged (lengths replays only): block size, blocks in the pool -- each call's table is range-checked
        self.paged = (p.kv.block_size, p.kv.key.shape[0]) if p.kv.kind == "paged" else None
        self.prepared = self._prepare(plan)
        self.lengths = None
        if lengths:                                 # what re-planning reads: metadata only (the tensors dropped)
            self.lengths = {}
            self.p = p.evolve(query=None, kv=None, antiquant=None)
            self.tuning = _tuning(K)

    def stale(self) -> bool:
        """Whether the tuning (thread count, constants) changed since the replay was made."""
        if self.lengths is not None:
            return _tuning(_K) != self.tuning
        return _PLANS.get(_plan_key(self.memo_key, _K)) is not self.prepared[0]

    def _prepare(self, plan: _Plan, lens: tuple = ()) -> tuple:
        parts = (plan.W,) + self.rows
        used = None                                 # paged: the table columns each batch uses
        if self.paged is not None:
            bs = self.paged[0]
            used = np.array([(n + bs - 1) // bs for n in lens], np.int64)
        return plan, plan.own[0], parts, np.array(parts + (plan.out_bytes, self.lse_bytes), np.int64), used

    def _table(self, table, used: np.ndarray) -> Optional[np.ndarray]:
        """A paged call's block table as the kernels read it (int64 [B, MB]), or None where parse would refuse
        it (an id outside the pool among the used columns: the full path raises the error)."""
        if type(table) is not torch.Tensor:
            return None
        from ..parse.paged import bad_block         # (the same check as parse's, on the same host array)
        host = table.numpy()
        if bad_block(host, used, self.paged[1]) is not None:
            return None
        return host.astype(np.int64)

    def _for_lengths(self, lens, K) -> Optional[tuple]:
        """The prepared plan for a call's KV lengths, or None (invalid lengths, stale tuning, no work)."""
        if type(lens) not in (list, tuple) or _tuning(K) != self.tuning:
            return None
        from ..parse.lengths import broadcast        # (parse's own rule for the value count)
        lens, S = broadcast(lens, self.p.B), self.p.KV_S
        if lens is None:
            return None
        for v in lens:
            if type(v) is not int or v < 0 or v > S:
                return None
        got = self.lengths.get(lens)
        if got is None:
            plan = _relength(self.prepared[0], self.p, np.array(lens, np.int64), K, self.tuning[0])
            if plan is None:
                return None
            if len(self.lengths) >= self._MAX_LENGTHS:
                self.lengths.clear()
            got = self.lengths[lens] = self._prepare(plan, lens)
        return got

    def _factors(self, extras: tuple) -> tuple:
        """(kchan, (sink, vcs, vco)) of a call: the dequant factors from its own tensors (self.aq): the admitting
        call's specs (shapes, strides, kinds: the key's metadata) at the addresses of this call's views."""
        if self.aq is None:
            return self.kchan, self.factors
        meta, views = self.aq
        specs = self.fspecs.copy()
        for f in self.fslots:
            specs[f, 0] = _view_address(views[f], extras)
        kchan, vcs, vco, exceptional = _fill_factors(meta, specs)
        return None if exceptional else (kchan, (self.factors[0], vcs, vco))

    def __call__(self, q, k, v, lens=None, table=None, extras=()):
        K = _K
        tbl = self.tbls[0]
        if self.lengths is not None:
            prepared = self._for_lengths(lens, K)
            if prepared is None:
                return None
            if self.paged is not None:
                tbl = self._table(table, prepared[4])
                if tbl is None:
                    return None
        else:
            if self.stale():
                return None
            prepared = self.prepared
        plan, launch, parts, dims, _ = prepared
        got = self._factors(extras)
        if got is None:                             # exceptional factors: the full path (decode._reference)
            return None
        kchan, factors = got
        bufs = self.bufs.copy()
        s, d = self.slots, self.deltas
        bufs[0, s[0]], bufs[0, s[1]], bufs[0, s[2]] = q.data_ptr() + d[0], k.data_ptr() + d[1], v.data_ptr() + d[2]
        kt_tbl, vt_tbl = self.tbls[1], self.tbls[2]
        if self.tok_slots:
            views = self.aq[1]
            for slot, j in self.tok_slots:
                bufs[0, slot] = _view_address(views[j], extras)
            kt_tbl = tbl if self.tok_follow[0] else kt_tbl
            vt_tbl = tbl if self.tok_follow[1] else vt_tbl
        out = torch.empty(self.out_shape, dtype=plan.out_dtype)
        if self.want_lse:
            lse, lse_addr = _lse_target(self.lse_shape, True)
        else:
            lse, lse_addr = torch.empty(0, dtype=torch.float32), self.scratch[1]
        if launch.threads == 1:                     # attend + merge in one dispatch
            K.attend_merge(launch.items, launch.ip, plan.fp, plan.geo, launch.work, tbl, bufs, kchan,
                           kt_tbl, vt_tbl, launch.generic, plan.mp, plan.wrange, plan.pwrange,
                           *factors, plan.obase, dims, out.data_ptr(), lse_addr[0], QK_STATS)
            return out, lse
        po = _partials(*parts)
        _launch(K.attend_items, launch.items, launch.threads,
                (launch.ip, plan.fp, plan.geo, launch.work, tbl, bufs, kchan, kt_tbl, vt_tbl, *po,
                 launch.generic, QK_STATS))
        _merge(K, plan, factors, out, lse_addr, po, po)
        return out, lse


def _partials(W: int, H: int, R: int, Dv: int):
    """Unnormalized partial results of W work entries: acc, running max, sum, 'saw a key' flags."""
    W = max(W, 1)
    return (np.empty((W, H, R, Dv), np.float32), np.empty((W, H, R), np.float32), np.zeros((W, H, R), np.float32),
            np.zeros((W, H, R), np.uint8))


def _attend(K, plan: _Plan, launch: _Launch, src: "_Source", qbufs: np.ndarray, kchan, po, pm, pl, pany) -> None:
    bufs = qbufs.copy()
    src.addresses(bufs, K)
    w0, w1 = launch.w0, launch.w1
    _launch(K.attend_items, launch.items, launch.threads,
            (launch.ip, plan.fp, plan.geo, launch.work, src.tbl, bufs, kchan, src.ktok.tbl, src.vtok.tbl,
             po[w0:w1], pm[w0:w1], pl[w0:w1], pany[w0:w1], launch.generic, QK_STATS))


def _chunk(dq: int, dv: int, rows: int) -> int:
    """Keys per chunk: CHUNK_FLOATS // head dim, at most 16384 // rows (the [rows, C] score block stays
    in L2), a multiple of 4 in [8, 256]."""
    c = min(CHUNK_FLOATS // max(dq, dv, 1), 16384 // max(rows, 1))
    return int(max(8, min(256, c - c % 4)))


# ---------------------------------------------------------------------------------------------- threads
_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool on demand."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool(n: int):
    """An executor of at least n workers. A larger one replaces the pool without shutting the old one down: a
    call in another thread may hold it and still submit to it (shutdown made that submit raise). The old pool's
    idle workers exit once the last reference to it is gone (ThreadPoolExecutor's weakref callback)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fia-decode")
            _POOL_SIZE = n
        return _POOL


def _launch(fn, items: np.ndarray, t: int, args: tuple) -> None:
    """Run fn(items, counter, *args) on t threads (the calling thread included).

    The threads take the items one at a time through a shared atomic counter (dynamic scheduling: on a
    shared machine a thread may lose its core for a while, e.g. to torch's OpenMP workers spinning after
    the previous op). fn releases the GIL."""
    counter = np.zeros(1, np.int64)
    if t <= 1:
        fn(items, counter, *args)
        return
    pool = _pool(t - 1)
    futs = [pool.submit(fn, items, counter, *args) for _ in range(1, t)]
    try:
        fn(items, counter, *args)
    finally:
        for f in futs:
            f.result()


# ---------------------------------------------------------------------------------------------- sources
class _Tokens:
    """Per-token dequant factors of the key or the value (SPEC 10): scale (and offset) read in place, and
    the table mapping a query group's position to their row (its batch, or the paged block). mode 0: none."""
    mode, scale, offset, bs, gran = 0, None, None, _BIG, None

    def __init__(self, spec=None, B: int = 0, block_size: int = 0, paged_tbl=None):
        self.tbl = _dummy(np.int64, 2)
        if spec is None or not spec.per_token:
            return
        sc, off = spec.scale, spec.offset
        if off is not None and off.stride() != sc.stride():
            sc, off = sc.contiguous(), off.contiguous()
        self.scale, self.offset, self.gran = sc, off, spec.granularity
        self.mode = 2 if off is not None else 1
        if self.gran in ("token", "token_head"):          # [Bs, S] / [Bs, KV_N, S]: logical position p
            bsel = np.arange(B, dtype=np.int64) if sc.shape[0] > 1 else np.zeros(B, np.int64)
            self.tbl = bsel[:, None].copy()
        else:                                             # [NB, bs] / [NB, KV_N, bs]: by paged block
            self.tbl, self.bs = paged_tbl, block_size

    def ints(self) -> tuple:
        """(mode, block size, block / head / position strides) for ip."""
        if not self.mode:
            return _NO_TOKEN_INTS
        st = self.scale.stride()
        return self.mode, self.bs, st[0], (st[1] if self.gran in ("token_head", "block_token_head") else 0), st[-1]


_NO_TOKENS = _Tokens()
_NO_TOKEN_INTS = (0, _BIG, 0, 0, 0)


class _Source:
    """One KV storage the kernel reads in place: key, value, rope, block table, per-token factors.

    Key position p of query group i is element tbl[i, p // bs] * s_blk + h * s_h + (p % bs) * s_s.
    `ints` writes its metadata into a plan's ip, `addresses` its buffers into a call's bufs."""

    def __init__(self, p: AttentionProblem, key, value, rope, tbl, bs, blk_axis: Optional[int], h_axis: int,
                 s_axis: int, batch: Optional[int] = None, per_token: bool = True):
        self.tbl, self.bs, self.batch = tbl, bs, batch
        self.key, self.value, self.rope = key, value, rope
        self.axes = (blk_axis, h_axis, s_axis)
        aq = p.antiquant if per_token else None
        if aq is None:
            self.ktok = self.vtok = _NO_TOKENS
        else:
            ptbl = tbl if p.kv.kind == "paged" else None
            self.ktok, self.vtok = _Tokens(aq.key, p.B, bs, ptbl), _Tokens(aq.value, p.B, bs, ptbl)

    def _strides(self, t) -> tuple:
        blk, h, s = self.axes
        st = t.stride()
        return (st[blk] if blk is not None else 0, st[h], st[s])

    def generic(self):
        """None when the IR kernels cover this source (bf16 / fp16 / int8 K and V, head dims multiples of
        16, no rope): the kernel build without the generic paths (see attend_items); else a marker array."""
        fused = (_FUSED_KIND.get(_kind(self.key)) and _FUSED_KIND.get(_kind(self.value)) and self.rope is None
                 and self.key.shape[-1] % 16 == 0 and self.value.shape[-1] % 16 == 0)
        return None if fused else _dummy(np.uint8)

    def entries(self, work, wrange):
        """The work entries [w0, w1) this source serves (all, or one batch's for tensor lists)."""
        if self.batch is None:
            return 0, work.shape[1]
        return int(wrange[0, self.batch]), int(wrange[1, self.batch])

    def ints(self, ip: list, K) -> None:
        ip[K.IP_BS] = self.bs
        ip[K.IP_K_BLK], ip[K.IP_K_H], ip[K.IP_K_S] = self._strides(self.key)
        ip[K.IP_K_KIND] = _kind(self.key)
        ip[K.IP_R_BLK], ip[K.IP_R_H], ip[K.IP_R_S] = self._strides(self.rope) if self.rope is not None else (0, 0, 0)
        ip[K.IP_R_KIND] = _kind(self.rope) if self.rope is not None else 0
        ip[K.IP_V_BLK], ip[K.IP_V_H], ip[K.IP_V_S] = self._strides(self.value)
        ip[K.IP_V_KIND] = _kind(self.value)
        ip[K.IP_KT_MODE], ip[K.IP_KT_BS], ip[K.IP_KT_BLK], ip[K.IP_KT_H], ip[K.IP_KT_S] = self.ktok.ints()
        ip[K.IP_VT_MODE], ip[K.IP_VT_BS], ip[K.IP_VT_BLK], ip[K.IP_VT_H], ip[K.IP_VT_S] = self.vtok.ints()

    def addresses(self, bufs: np.ndarray, K) -> None:
        bufs[0, K.BUF_K], bufs[1, K.BUF_K] = _addr(self.key)
        bufs[0, K.BUF_V], bufs[1, K.BUF_V] = _addr(self.value)
        if self.rope is not None:
            bufs[0, K.BUF_R], bufs[1, K.BUF_R] = _addr(self.rope)
        if self.ktok.mode:
            bufs[0, K.BUF_KTS], bufs[1, K.BUF_KTS] = _addr(self.ktok.scale)
            bufs[0, K.BUF_KTO], bufs[1, K.BUF_KTO] = _addr(self.ktok.offset)
        if self.vtok.mode:
            bufs[0, K.BUF_VTS], bufs[1, K.BUF_VTS] = _addr(self.vtok.scale)
            bufs[0, K.BUF_VTO], bufs[1, K.BUF_VTO] = _addr(self.vtok.offset)


def _sources(p: AttentionProblem):
    B, kv = p.B, p.kv
    if kv.kind == "dense":                          # [B, H, S, D]
        yield _Source(p, kv.key, kv.value, kv.key_rope, np.arange(B, dtype=np.int64).reshape(B, 1), _BIG, 0, 1, 2)
    elif kv.kind == "packed":                       # [H, T, D]; batch b starts at kv_offset
        tbl = np.array([g.kv_offset for g in p.geometry], np.int64).reshape(B, 1)
        yield _Source(p, kv.key, kv.value, kv.key_rope, tbl, _BIG, 1, 0, 1)
    elif kv.kind == "paged":                        # [NB, H, bs, D] + block table, read in place
        tbl = kv.block_table.to(torch.int64).contiguous().numpy()
        yield _Source(p, kv.key, kv.value, kv.key_rope, tbl, kv.block_size, 0, 1, 2)
    elif kv.kind == "list":                         # per batch [H, S_b, D]
        tbl = np.zeros((B, 1), np.int64)
        for b in range(B):
            kr = None if kv.key_ropes is None else kv.key_ropes[b]
            yield _Source(p, kv.keys[b], kv.values[b], kr, tbl, _BIG, None, 0, 1, batch=b)
    else:  # pragma: no cover
        raise AssertionError(kv.kind)
