"""What the decode kernels read of a call, as they read it (its data: addresses and contents).

Inputs: the query with a unit-stride last dim, a byte mask, the dequant factors applied outside the loop (folded
into the query and the epilogue, decode kernels' fill_factors) and the sink as float32 arrays, and the KV sources
(Source: key, value, rope, block table, per-token factors, read in place). Element kinds travel as ints (KINDS),
addresses as (address, bytes) pairs, so one compiled kernel serves every dtype. The plan (plan.py) sees only
their metadata.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...problem.attention import AttentionProblem
from . import loader

BIG = 1 << 40               # "infinite" block size of unpaged storage


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
    see kind_of), so one compiled kernel serves every dtype. t stays alive for the call (Inputs holds it)."""
    if t is None:
        return _DUMMY_ADDR
    # the common case, without the span loop (docs/performance.md, "Kernel choices: the measurements")
    if t.is_contiguous():
        n = t.nbytes
        return (t.data_ptr(), n) if n else _DUMMY_ADDR
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if s == 0:
            return _DUMMY_ADDR
        n += (s - 1) * st
    return t.data_ptr(), n * t.element_size()


KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.int32: 4,
         torch.float4_e2m1fn_x2: 6}                       # 6: kernels.KIND_FP4 (two E2M1 values a byte)
KIND_BYTES = {0: 4.0, 1: 2.0, 2: 2.0, 3: 1.0, 4: 0.5, 6: 0.5}   # bytes per value of a kind (int4: 8 per int32)
FUSED_KIND = {1: True, 2: True, 3: True}                  # bf16, fp16, int8: fused QK / PV kernels


def ir_covers(k_dtype, v_dtype, dk: int, dv: int, rope: bool, f32: bool) -> bool:
    """Whether the IR kernels take K / V of these dtypes and head dims (no rope): bf16 / fp16 / int8, and float32
    with f32 (kernels.DP_F32 in the launch's flags), head dims multiples of 16; else the generic loops run."""
    def ok(dt):
        kind = KINDS.get(dt)
        return FUSED_KIND.get(kind, False) or (f32 and kind == 0)
    return ok(k_dtype) and ok(v_dtype) and not rope and dk % 16 == 0 and dv % 16 == 0


def kind_of(t: torch.Tensor) -> int:
    return KINDS[t.dtype]


class Inputs:
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
        # exceptional: factors applied outside the loop that are NaN / infinite / huge (kernels.EXC_FACTOR)
        self.kchan, self.vcs, self.vco, self.exceptional = _dequant_factors(p)
        self.sink = _dummy(np.float32) if p.sink is None else p.sink.detach().to(torch.float32).contiguous().numpy()
        self.sources = list(_sources(p))
        # the shared prefix: one block at offset 0 for every prefix group (a table row per batch: at least one per
        # group, whatever the plan's grouping); per-token dequant never comes with a prefix
        self.prefix = None if p.prefix is None else Source(
            p, p.prefix.key, p.prefix.value, None, np.zeros((p.B, 1), np.int64), BIG, None, 0, 1,
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


def chan_modes(aq):
    """Modes of the key's and the value's dequant factors (aq: an AntiQuant) applied outside the loop (tensor /
    channel / head: key folded into the query, value in merge): 0 per token, 1 scale, 2 scale and offset."""
    return tuple(0 if s.per_token else 1 + (s.offset is not None) for s in (aq.key, aq.value))


def _dequant_factors(p: AttentionProblem):
    """kchan [modes, KV_N, D] (scale, offset), vcs / vco [KV_N, Dv] float32 (dummies where absent), and whether
    one of them is exceptional (kernels.fill_factors)."""
    aq = p.antiquant
    if aq is None:
        return no_factors() + (False,)
    return _factor_arrays(factor_meta(p), (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset))


def factor_meta(p: AttentionProblem) -> tuple:
    """What _factor_arrays needs of p besides the tensors: granularities, modes (chan_modes), KV_N, D, Dv."""
    aq = p.antiquant
    return (aq.key.granularity, aq.value.granularity) + chan_modes(aq) + (p.KV_N, p.D, p.Dv)


def _factor_arrays(meta: tuple, tensors: tuple) -> tuple:
    """_dequant_factors' arrays from meta (factor_meta) and the (key scale, key offset, value scale, value
    offset) tensors."""
    return fill_factors(meta, factor_specs(meta, tensors))


_GRANS = {"tensor": 0, "channel": 1, "head": 2}     # kernels.GRAN_*


def factor_specs(meta: tuple, tensors: tuple) -> np.ndarray:
    """kernels.fill_factors' specs [4, FS_LEN] of the (key scale, key offset, value scale, value offset)
    tensors that are applied outside the loop (chan_modes; the others absent: address 0). Each tensor holds
    1, H x D or H values (its granularity) in its logical order: anything else is a parse bug, raised here
    (the kernel writes that many values)."""
    K = loader.K
    kg, vg, kmode, vmode, H, D, Dv = meta
    specs = np.zeros((4, K.FS_LEN), np.int64)
    for f, t in enumerate(tensors):
        mode, gran, d = (kmode, kg, D) if f < 2 else (vmode, vg, Dv)
        if t is None or mode == 0 or (f % 2 == 1 and mode != 2):
            continue
        if t.dim() > 4 or t.numel() != {"tensor": 1, "channel": H * d, "head": H}[gran]:
            raise AssertionError(f"dequant factor of shape {tuple(t.shape)} for granularity {gran}")
        pad = 4 - t.dim()
        specs[f] = (t.data_ptr(), KINDS[t.dtype], _GRANS[gran], *((1,) * pad + tuple(t.shape)),
                    *((0,) * pad + tuple(t.stride())))
    return specs


def fill_factors(meta: tuple, specs: np.ndarray) -> tuple:
    """_dequant_factors' arrays and flag, filled from the factor tensors in place (kernels.fill_factors)."""
    _, _, kmode, vmode, H, D, Dv = meta
    kchan, vcs, vco = no_factors()
    if kmode:
        kchan = np.empty((kmode, H, D), np.float32)
    if vmode:
        vcs = np.empty((H, Dv), np.float32)
        if vmode == 2:
            vco = np.empty((H, Dv), np.float32)
    exceptional = bool(loader.K.fill_factors(specs, kchan, vcs, vco))
    return kchan, vcs, vco, exceptional


def no_factors() -> tuple:
    """_dequant_factors' dummies (no dequantization outside the loop)."""
    return _dummy(np.float32, 3), _dummy(np.float32, 2), _dummy(np.float32, 2)


def _span(t: torch.Tensor) -> tuple:
    """[first, last] storage elements of t (torch strides are never negative)."""
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def views_of(aq, extras: tuple) -> Optional[tuple]:
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


def view_address(spec: tuple, extras: tuple) -> int:
    """The address of a factor tensor in a replayed call: its views_of spec applied to the call's tensors."""
    i, rel = spec
    e = extras[i]
    return e.data_ptr() + rel * e.element_size()



# ---------------------------------------------------------------------------------------------- sources
class _Tokens:
    """Per-token dequant factors of the key or the value (SPEC 10): scale (and offset) read in place, and
    the table mapping a query group's position to their row (its batch, or the paged block). mode 0: none."""
    mode, scale, offset, bs, gran = 0, None, None, BIG, None

    def __init__(self, spec=None, B: int = 0, block_size: int = 0, paged_tbl=None):
        self.tbl = _dummy(np.int64, 2)
        if spec is None or not spec.per_token:
            return
        sc, off = spec.scale, spec.offset
        if off is not None and off.stride() != sc.stride():
            sc, off = sc.contiguous(), off.contiguous()
        self.scale, self.offset, self.gran = sc, off, spec.granularity
        self.mode = 2 if off is not None else 1
        if self.gran == "token_group":                    # [B, KV_N, S, D/32] E8M0 of FP4 K / V (kernels.KIND_FP4):
            self.scale = _whole_words(sc)                 # read as bytes of a float32 buffer (kernels.buf_f32)
            self.tbl = np.arange(B, dtype=np.int64)[:, None].copy()
        elif self.gran in ("token", "token_head"):          # [Bs, S] / [Bs, KV_N, S]: logical position p
            bsel = np.arange(B, dtype=np.int64) if sc.shape[0] > 1 else np.zeros(B, np.int64)
            self.tbl = bsel[:, None].copy()
        else:                                             # [NB, bs] / [NB, KV_N, bs]: by paged block
            self.tbl, self.bs = paged_tbl, block_size

    def ints(self) -> tuple:
        """(mode, block size, block / head / position strides) for ip."""
        if not self.mode:
            return _NO_TOKEN_INTS
        st = self.scale.stride()
        if self.gran == "token_group":                    # (the group axis has stride 1: _whole_words)
            return self.mode, self.bs, st[0], st[1], st[2]
        return self.mode, self.bs, st[0], (st[1] if self.gran in ("token_head", "block_token_head") else 0), st[-1]


def _whole_words(sc: torch.Tensor) -> torch.Tensor:
    """E8M0 group scales the kernels read in place when their groups are contiguous and their span is whole
    float32 words (kernels.buf_f32 cuts a buffer to those); else a copy inside a buffer that is."""
    if sc.stride(-1) == 1 and _addr(sc)[1] % 4 == 0:
        return sc
    buf = torch.empty(sc.numel() + 4, dtype=torch.uint8)
    out = buf[:sc.numel()].view(sc.shape)
    out.copy_(sc.view(torch.uint8))
    return out.view(sc.dtype)


_NO_TOKENS = _Tokens()
_NO_TOKEN_INTS = (0, BIG, 0, 0, 0)


class Source:
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

    def strides(self, t) -> tuple:
        blk, h, s = self.axes
        st = t.stride()
        return (st[blk] if blk is not None else 0, st[h], st[s])

    @staticmethod
    def fragments(t) -> tuple:
        """(fragment stride, fragment width) in elements of an NZ cache view [NB, H, bs, D/D0, D0] (SPEC 8b),
        (0, 0) for a cache whose rows are one run."""
        return (t.stride(3), t.shape[4]) if t is not None and t.dim() == 5 else (0, 0)

    def generic(self, f32: bool = True):
        """None when the IR kernels cover this source (ir_covers; f32: float32 K / V too): the kernel build
        without the generic paths (see attend_items); else a marker array."""
        fused = ir_covers(self.key.dtype, self.value.dtype, self.key.shape[-1], self.value.shape[-1],
                          self.rope is not None, f32)
        return None if fused else _dummy(np.uint8)

    def entries(self, work, wrange):
        """The work entries [w0, w1) this source serves (all, or one batch's for tensor lists)."""
        if self.batch is None:
            return 0, work.shape[1]
        return int(wrange[0, self.batch]), int(wrange[1, self.batch])

    def ints(self, ip: list, K) -> None:
        ip[K.IP_BS] = self.bs
        ip[K.IP_K_BLK], ip[K.IP_K_H], ip[K.IP_K_S] = self.strides(self.key)
        ip[K.IP_K_KIND] = kind_of(self.key)
        ip[K.IP_R_BLK], ip[K.IP_R_H], ip[K.IP_R_S] = self.strides(self.rope) if self.rope is not None else (0, 0, 0)
        ip[K.IP_R_KIND] = kind_of(self.rope) if self.rope is not None else 0
        ip[K.IP_V_BLK], ip[K.IP_V_H], ip[K.IP_V_S] = self.strides(self.value)
        ip[K.IP_V_KIND] = kind_of(self.value)
        ip[K.IP_K_FS], ip[K.IP_K_FW] = self.fragments(self.key)
        ip[K.IP_V_FS], ip[K.IP_V_FW] = self.fragments(self.value)
        ip[K.IP_R_FS], ip[K.IP_R_FW] = self.fragments(self.rope)
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
        for tok, slot in ((self.ktok, K.BUF_KTS), (self.vtok, K.BUF_VTS)):
            if tok.gran == "token_group":                 # whole float32 words (_whole_words' copies hold them)
                bufs[1, slot] = -(-int(bufs[1, slot]) // 4) * 4


def _sources(p: AttentionProblem):
    B, kv = p.B, p.kv
    if kv.kind == "dense":                          # [B, H, S, D]
        yield Source(p, kv.key, kv.value, kv.key_rope, np.arange(B, dtype=np.int64).reshape(B, 1), BIG, 0, 1, 2)
    elif kv.kind == "packed":                       # [H, T, D]; batch b starts at kv_offset
        tbl = np.array([g.kv_offset for g in p.geometry], np.int64).reshape(B, 1)
        yield Source(p, kv.key, kv.value, kv.key_rope, tbl, BIG, 1, 0, 1)
    elif kv.kind == "paged":                        # [NB, H, bs, D] + block table, read in place
        tbl = kv.block_table.to(torch.int64).contiguous().numpy()
        yield Source(p, kv.key, kv.value, kv.key_rope, tbl, kv.block_size, 0, 1, 2)
    elif kv.kind == "list":                         # per batch [H, S_b, D]
        tbl = np.zeros((B, 1), np.int64)
        for b in range(B):
            kr = None if kv.key_ropes is None else kv.key_ropes[b]
            yield Source(p, kv.keys[b], kv.values[b], kr, tbl, BIG, None, 0, 1, batch=b)
    else:  # pragma: no cover
        raise AssertionError(kv.kind)
