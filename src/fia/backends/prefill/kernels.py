"""Numba kernels of the prefill flash path (flash.py): K / V packing and the blocked online softmax.

Work item = (batch entry b, kv head h, query block of QB positions): its rows are the G query heads of kv
head h times the QB positions (row r = g * QB + ii: head h * G + g, position i0 + ii), so every packed K / V
tile is used by the whole GQA group. Per key tile of KT keys: scores with one GEMM (cpu/gemm.py; on CPUs
without AVX-512 the 8-lane cpu/gemm_narrow.py), the online softmax in float32 (running max m, sum l; for bf16
the probabilities are rounded to bf16 for the PV product, as ATen's bf16 flash kernel and the hardware do:
bf16 bits for `vdpbf16ps`, or float32 values rounded to bf16 for the 8-lane FMAs; float16 / float32 keep them
in float32), then O += P . V
with a second GEMM. Key tiles outside every row's band window (top-left causal, or i - pre <= j <= i + next)
and tiles a user mask covers entirely are never computed; the additive mask is read per tile. Output in the
query's dtype (O / l rounded to nearest even) and lse = m + log(l) in float32; a row without any finite
score gets output 0 and lse -inf.

Unsigned loop indices where numba should vectorize (a signed computed index adds a wraparound select per
element, decode.kernels.rows.load_rows).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from ...cpu.numerics import (FM, addr_ptr, bf16_to_f32, claim, f32_as_u32, f32_to_bf16_bits, f32_to_half_bits,
                             fexp, fexp2, fp16_to_f32, round_bf16_value)
from ...cpu import kernel_cache
from ...cpu.simd import max_f32, mul_exact, sub_exact
from ...cpu import gemm, gemm_narrow
from ...cpu.fma import NARROW
from ...cpu.gemm import gemm_bf16, gemm_bf16w, gemm_f16, gemm_f32
from ...cpu.gemm_narrow import gemm_bf16n, gemm_f16n, gemm_f32n

# register blocks of the GEMMs this CPU runs: 16-lane (gemm.py) or, without AVX-512, 8-lane (gemm_narrow.py)
ROWS, COLS = (gemm_narrow.ROWS, gemm_narrow.COLS) if NARROW else (gemm.ROWS, gemm.COLS)
_GEMM_F16, _GEMM_F32 = (gemm_f16n, gemm_f32n) if NARROW else (gemm_f16, gemm_f32)
_GEMM_BF16W = gemm_bf16n if NARROW else gemm_bf16w        # float32 A . pair-packed bf16 B (no vdpbf16ps)

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install("backends/prefill/kernels.py", ("cpu/numerics.py", "cpu/simd.py", "cpu/fma.py", "cpu/vnni.py",
                                                     "cpu/amx.py", "cpu/gemm.py", "cpu/gemm_narrow.py", "cpu/fp4.py"))

LOG2E = np.float32(1.4426950408889634)

__all__ = ["COLS", "ROWS", "pack_items", "flash_items"]  # (and their argument layouts, PA_* / FA_*)


@njit(cache=True, inline="always")
def _split(it, H, n):
    """Item it = (b * H + h) * n + x -> (b, h, x)."""
    return it // (n * H), (it // n) % H, it % n


# pack_items' argument array pa (int64): K's and V's element spans, their element strides, S
PA_KN, PA_VN, PA_KS, PA_VS, PA_S, PA_LEN = 0, 1, 2, 5, 8, 9


@njit(nogil=True, cache=True)
def pack_items(items, counter, kp, vp, vmag, pa, k_addr, v_addr):
    """Pack the K and V tiles of (b, h, tile t) items (it = (b * H + h) * nt + t), taken through `counter`.
    K and V are read in place from the addresses of their first elements (uint16 bits of bf16 / float16, or
    float32 -- the type kp's implies, _elems; the caller keeps them alive for the call); pa int64 [PA_LEN]: how
    many elements from there they span, their element strides (batch, head, key; element (b, h, key, d) at
    ks[0] * b + ks[1] * h + ks[2] * key + d) and S: keys >= S pack as zeros.
    bf16 (kp uint32 [Bq, H, nt, D / 2, KT], vp uint32 [Bq, H, nt, KT / 2, Dv]): kp[b, h, t, p, c] =
    (K[2p], K[2p + 1]) of key t * KT + c, vp[b, h, t, c2, d] = (V[key 2 c2, d], V[key 2 c2 + 1, d]).
    float16 / float32 (kp [Bq, H, nt, D, KT], vp [Bq, H, nt, KT, Dv], K's element type): the key tile
    transposed, the value rows as they are. vmag[it]: the largest magnitude bits (sign cleared) of the tile's
    values (V's bits as uint16 / uint32; infinity and NaN above every finite value) -- the caller's check for
    values the kernels' sums would overflow (backend._tame) without a pass over V of its own."""
    H, nt = kp.shape[1], kp.shape[2]
    k16, v16 = _elems(k_addr, pa[PA_KN], kp), _elems(v_addr, pa[PA_VN], kp)
    vbits = _elem_bits(v_addr, pa[PA_VN], kp)
    ks, vs, S = pa[PA_KS:PA_KS + 3], pa[PA_VS:PA_VS + 3], pa[PA_S]
    while True:
        it = claim(items, counter)
        if it < 0:
            break
        b, h, t = _split(it, H, nt)
        _pack_tile(k16, v16, ks, vs, kp, vp, S, b, h, t)
        vmag[it] = _tile_magnitude(vbits, vs, S, b, h, t * kp.shape[4], vp.shape[4], kp.shape[4])


def _elems(addr, n, kp):
    """The n elements at addr as the kernels read q / k / v / output / mask: uint16 bits where the packed tiles kp
    are uint32 (bf16) or uint16 (float16), float32 where they are float32."""


@overload(_elems, inline="always")
def _elems_impl(addr, n, kp):
    if kp.dtype == types.float32:
        return lambda addr, n, kp: carray(addr_ptr(addr), n, np.float32)
    return lambda addr, n, kp: carray(addr_ptr(addr), n, np.uint16)


def _elem_bits(addr, n, kp):
    """_elems' bits: uint16, or uint32 for float32 elements."""


@overload(_elem_bits, inline="always")
def _elem_bits_impl(addr, n, kp):
    if kp.dtype == types.float32:
        return lambda addr, n, kp: carray(addr_ptr(addr), n, np.uint32)
    return lambda addr, n, kp: carray(addr_ptr(addr), n, np.uint16)


@njit(cache=True, inline="always")
def _tile_magnitude(vbits, vs, S, b, h, k0, Dv, KT):
    """The largest |V| of keys [k0, k0 + KT) as bits with the sign cleared (uint16 / uint32 elements)."""
    mask = np.uint32(0x7FFF) if vbits.itemsize == 2 else np.uint32(0x7FFFFFFF)
    top = np.uint32(0)
    for key in range(k0, min(k0 + KT, S)):
        base = np.uint64(vs[0] * b + vs[1] * h + vs[2] * key)          # (unsigned: no wraparound select)
        for d in range(np.uint64(Dv)):
            top = max(top, np.uint32(vbits[base + d]) & mask)
    return np.int64(top)


def _pack_tile(k16, v16, ks, vs, kp, vp, S, b, h, t):
    """One tile of pack_items (the packing follows kp's dtype)."""


@overload(_pack_tile)
def _pack_tile_impl(k16, v16, ks, vs, kp, vp, S, b, h, t):
    if kp.dtype == types.uint32:
        return lambda k16, v16, ks, vs, kp, vp, S, b, h, t: _pack_bf16(k16, v16, ks, vs, kp, vp, S, b, h, t)
    return lambda k16, v16, ks, vs, kp, vp, S, b, h, t: _pack_rows(k16, v16, ks, vs, kp, vp, S, b, h, t)


@njit(cache=True, inline="always")
def _pair(lo, hi):
    """Two bf16 bit patterns as one dword (lo in the low half): a vdpbf16ps operand pair."""
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(16))


@njit(cache=True)
def _pack_bf16(k16, v16, ks, vs, kp, vp, S, b, h, t):
    D2, KT, Dv = kp.shape[3], kp.shape[4], vp.shape[4]
    k0 = t * KT
    kb, vb = ks[0] * b + ks[1] * h, vs[0] * b + vs[1] * h
    for c in range(KT):
        key = k0 + c
        if key < S:
            r = np.uint64(kb + ks[2] * key)                 # (unsigned indices: no wraparound select)
            for p in range(np.uint64(D2)):
                kp[b, h, t, p, c] = _pair(k16[r + np.uint64(2) * p], k16[r + np.uint64(2) * p + np.uint64(1)])
        else:
            for p in range(D2):
                kp[b, h, t, p, c] = np.uint32(0)
    for c2 in range(KT // 2):
        ka = k0 + 2 * c2
        if ka + 1 < S:
            r, r2 = np.uint64(vb + vs[2] * ka), np.uint64(vb + vs[2] * (ka + 1))
            for d in range(np.uint64(Dv)):
                vp[b, h, t, c2, d] = _pair(v16[r + d], v16[r2 + d])
        elif ka < S:
            r = np.uint64(vb + vs[2] * ka)
            for d in range(np.uint64(Dv)):
                vp[b, h, t, c2, d] = np.uint32(v16[r + d])
        else:
            for d in range(Dv):
                vp[b, h, t, c2, d] = np.uint32(0)


@njit(cache=True)
def _pack_rows(k16, v16, ks, vs, kp, vp, S, b, h, t):
    D, KT, Dv = kp.shape[3], kp.shape[4], vp.shape[4]
    k0 = t * KT
    kb, vb = ks[0] * b + ks[1] * h, vs[0] * b + vs[1] * h
    for c in range(KT):
        key = k0 + c
        if key < S:
            rk, rv = np.uint64(kb + ks[2] * key), np.uint64(vb + vs[2] * key)     # (unsigned: no wraparound)
            for d in range(np.uint64(D)):
                kp[b, h, t, d, c] = k16[rk + d]
            for d in range(np.uint64(Dv)):
                vp[b, h, t, c, d] = v16[rv + d]
        else:
            for d in range(D):
                kp[b, h, t, d, c] = 0
            for d in range(Dv):
                vp[b, h, t, c, d] = 0


def _pval(pb, e):
    """The probability e as stored for the PV product: bf16 bits (uint16 scratch) or float32."""


@overload(_pval, jit_options={"fastmath": FM})
def _pval_impl(pb, e):
    if pb.dtype == types.uint16:
        return lambda pb, e: f32_to_bf16_bits(e)
    return lambda pb, e: e


def _prob_scratch(sc, pb):
    """Where a tile's probabilities go: float32 ones over the scores themselves (each written after its score
    is read; 96 KB less in L2, which holds the tile's scores, K / V tiles and accumulators: ~320 KB of a
    512 KB L2 on AMD Zen 3), bf16 bits into pb. Taken inside the function that loops over both, so that
    LLVM sees one pointer (two array arguments that overlap would send its vectorized loops to the scalar
    fallback)."""


@overload(_prob_scratch)
def _prob_scratch_impl(sc, pb):
    if pb.dtype == types.uint16:
        return lambda sc, pb: pb
    return lambda sc, pb: sc


def _qk(qs, kt, c0, c1, sc, RP, KT, D):
    """sc[:RP, c0:c1] = qs . key tile kt (bf16: query bits . packed pairs, or float32 query . packed pairs where
    AVX512-BF16 is missing; float16 / float32: float32 query . K^T rows)."""


@overload(_qk)
def _qk_impl(qs, kt, c0, c1, sc, RP, KT, D):
    if kt.dtype == types.uint32 and qs.dtype == types.float32:
        def impl_bf16n(qs, kt, c0, c1, sc, RP, KT, D):
            _GEMM_BF16W(qs.ctypes.data, D * 4, kt.ctypes.data + 4 * c0, KT * 4, D // 2, sc.ctypes.data + 4 * c0,
                        KT * 4, RP, c1 - c0, 0)
        return impl_bf16n
    if kt.dtype == types.uint32:
        def impl(qs, kt, c0, c1, sc, RP, KT, D):
            gemm_bf16(qs.ctypes.data, D * 2, kt.ctypes.data + 4 * c0, KT * 4, D // 2, sc.ctypes.data + 4 * c0,
                      KT * 4, RP, c1 - c0, 0)
        return impl
    if kt.dtype == types.uint16:
        def impl_f16(qs, kt, c0, c1, sc, RP, KT, D):
            _GEMM_F16(qs.ctypes.data, D * 4, kt.ctypes.data + 2 * c0, KT * 2, D, sc.ctypes.data + 4 * c0, KT * 4,
                     RP, c1 - c0, 0)
        return impl_f16

    def impl_f32(qs, kt, c0, c1, sc, RP, KT, D):
        _GEMM_F32(qs.ctypes.data, D * 4, kt.ctypes.data + 4 * c0, KT * 4, D, sc.ctypes.data + 4 * c0, KT * 4,
                 RP, c1 - c0, 0)
    return impl_f32


def _pv(pb, vt, c0, c1, o, RP, KT, Dv):
    """o[:RP] += pb[:, c0:c1] . value tile vt (bf16 pairs packed, with bf16 or, where AVX512-BF16 is missing,
    float32 probabilities; or float16 / float32 rows)."""


@overload(_pv)
def _pv_impl(pb, vt, c0, c1, o, RP, KT, Dv):
    if vt.dtype == types.uint32 and pb.dtype == types.float32:
        def impl_bf16n(pb, vt, c0, c1, o, RP, KT, Dv):
            _GEMM_BF16W(pb.ctypes.data + 4 * c0, KT * 4, vt.ctypes.data + (c0 // 2) * Dv * 4, Dv * 4,
                        (c1 - c0) // 2, o.ctypes.data, Dv * 4, RP, Dv, 1)
        return impl_bf16n
    if vt.dtype == types.uint32:
        def impl(pb, vt, c0, c1, o, RP, KT, Dv):
            gemm_bf16(pb.ctypes.data + 2 * c0, KT * 2, vt.ctypes.data + (c0 // 2) * Dv * 4, Dv * 4,
                      (c1 - c0) // 2, o.ctypes.data, Dv * 4, RP, Dv, 1)
        return impl
    if vt.dtype == types.uint16:
        def impl_f16(pb, vt, c0, c1, o, RP, KT, Dv):
            _GEMM_F16(pb.ctypes.data + 4 * c0, KT * 4, vt.ctypes.data + c0 * Dv * 2, Dv * 2, c1 - c0,
                     o.ctypes.data, Dv * 4, RP, Dv, 1)
        return impl_f16

    def impl_f32(pb, vt, c0, c1, o, RP, KT, Dv):
        _GEMM_F32(pb.ctypes.data + 4 * c0, KT * 4, vt.ctypes.data + c0 * Dv * 4, Dv * 4, c1 - c0,
                 o.ctypes.data, Dv * 4, RP, Dv, 1)
    return impl_f32


def _val(x, f16):
    """float32 of one element: a float32 as is; uint16 bits as float16 (f16) or bf16."""


@overload(_val, jit_options={"fastmath": FM})
def _val_impl(x, f16):
    if isinstance(x, types.Float):
        return lambda x, f16: np.float32(x)
    return lambda x, f16: fp16_to_f32(x) if f16 else bf16_to_f32(x)


def _outv(out, x, f16):
    """x as stored in the output array: float32, or uint16 bits of float16 (f16) / bf16."""


@overload(_outv, jit_options={"fastmath": FM})
def _outv_impl(out, x, f16):
    if isinstance(out.dtype, types.Float):
        return lambda out, x, f16: x
    return lambda out, x, f16: f32_to_half_bits(x) if f16 else f32_to_bf16_bits(x)


def _inf_from(out, f16):
    """The smallest float32 magnitude bits that the output stores as infinity (NaN: above): float32's infinity,
    or what rounds to the float16 / bf16 infinity (to nearest even: 65520, and 0x7F7F8000's tie)."""


@overload(_inf_from)
def _inf_from_impl(out, f16):
    if isinstance(out.dtype, types.Float):
        return lambda out, f16: np.uint32(0x7F800000)
    return lambda out, f16: np.uint32(0x477FF000) if f16 else np.uint32(0x7F7F8000)


@njit(fastmath=FM, cache=True, inline="always")
def _masked(ub, i, es):
    """Whether the user-mask element at byte i masks its key: nonzero (bool / int8 / uint8, es = 1), or
    a nonzero float16 value (es = 2; -0.0 keeps the key)."""
    if es == 1:
        return ub[i] != 0
    return (ub[i] | (ub[i + 1] & np.uint8(0x7F))) != 0


@njit(fastmath=FM, cache=True)
def _tile_open(ub, us, i0, nq, k0, pre, nxt, c0, c1, nk):
    """Whether some row i0 .. i0 + nq - 1 keeps a key of tile columns [c0, c1) (inside its band window, below
    nk, and not user-masked). us: [row stride bytes, bytes per element, present]."""
    for ii in range(nq):
        i = i0 + ii
        jlo = max(c0, i - pre - k0)
        jhi = min(c1, nk, i + nxt + 1 - k0)
        base = us[0] * i + us[1] * k0
        for j in range(jlo, jhi):
            if not _masked(ub, base + us[1] * j, us[1]):
                return True
    return False


@njit(fastmath=FM, cache=True, inline="always")
def _softmax_row(sc, pb, o, m, l, r, jlo, jhi, c0, c1, scale, mask, mbase, mf16, ub, ubase, us, Dv, rnd):
    """Online softmax of row r over the tile's scores sc[r, jlo:jhi] (the other columns of the computed
    range [c0, c1) are masked): scores scaled (+ mask), running max / sum updated, the accumulator row
    rescaled, probabilities into pb[r, c0:c1] (_pval; zeros outside [jlo, jhi)). mbase >= 0: the additive
    mask of column jlo is mask[mbase] (unit stride along keys; _val: float32, or bf16 / float16 bits by
    mf16). ubase >= 0: the user mask (us[1] bytes per element, see _masked) of column jlo starts at byte
    ub[ubase]; its masked keys score -inf. rnd: float32 probabilities rounded to bf16 values (bf16 calls on
    8-lane CPUs, the contract of the bf16 path; the sum l takes them unrounded, as there)."""
    lo, hi = np.uint64(jlo), np.uint64(max(jlo, jhi))
    for j in range(np.uint64(c0), lo):
        pb[r, j] = 0
    for j in range(hi, np.uint64(c1)):
        pb[r, j] = 0
    fold = mbase < 0 and ubase < 0 and scale > np.float32(0.0)      # the exp loop scales (sc keeps raw products)
    if mbase >= 0 and mf16:
        mb = np.uint64(mbase) - lo
        for j in range(lo, hi):
            sc[r, j] = sc[r, j] * scale + _val(mask[mb + j], True)
    elif mbase >= 0:
        mb = np.uint64(mbase) - lo
        for j in range(lo, hi):
            sc[r, j] = sc[r, j] * scale + _val(mask[mb + j], False)
    elif not fold:
        for j in range(lo, hi):
            sc[r, j] = sc[r, j] * scale
    if ubase >= 0:
        u0 = np.uint64(ubase)
        if us[1] == 1:
            for j in range(lo, hi):
                if ub[u0 + (j - lo)] != 0:
                    sc[r, j] = np.float32(-np.inf)
        else:
            for j in range(lo, hi):
                if _masked(ub, u0 + 2 * (j - lo), 2):
                    sc[r, j] = np.float32(-np.inf)
    cm = max_f32(sc.ctypes.data + r * sc.strides[0] + 4 * jlo, hi - lo, np.float32(-np.inf), 0)
    if fold:
        cm = cm * scale                                # rounding is monotonic: the maximum of the scaled scores
    mo = m[r]
    mx = cm if cm > mo else mo
    if mx == np.float32(-np.inf):                      # nothing finite yet: the row stays empty ...
        for j in range(lo, hi):
            if sc[r, j] != sc[r, j]:                   # ... unless a score is NaN (max_f32 skips NaN)
                l[r] = np.float32(np.nan)
            pb[r, j] = 0                               # (pb may be sc itself: _prob_scratch)
        return
    alpha = fexp(mo - mx)
    sx = scale if fold else np.float32(1.0)
    ls = np.float32(0.0)
    if rnd:
        for j in range(lo, hi):
            e = fexp2(sub_exact(mul_exact(sc[r, j], sx), mx) * LOG2E)
            ls += e
            pb[r, j] = round_bf16_value(e)
    else:
        for j in range(lo, hi):
            e = fexp2(sub_exact(mul_exact(sc[r, j], sx), mx) * LOG2E)
            ls += e
            pb[r, j] = _pval(pb, e)
    l[r] = l[r] * alpha + ls
    m[r] = mx
    if alpha != np.float32(1.0):
        for d in range(np.uint64(Dv)):
            o[r, d] *= alpha


@njit(fastmath=FM, cache=True)
def _softmax_tile(sc, pb, o, m, l, b, n0, RB, i0, nq, QB, k0, c0, c1, nk, pre, nxt, sf, mask, ms, mf16, ub, us, Dv,
                  rnd):
    """_softmax_row over the rows of one key tile (computed columns [c0, c1) of the tile at key k0): rows
    r = g * QB + ii < RB are head n0 + g at position i0 + ii (ii < nq); the others (padding) get zero
    probabilities. One call per tile: a call per row spent ~140 cycles passing its arguments."""
    pw = _prob_scratch(sc, pb)
    for r in range(sc.shape[0]):
        g, ii = divmod(r, QB)
        if r >= RB or ii >= nq:
            for j in range(c0, c1):
                pw[r, j] = 0
            continue
        i = i0 + ii
        jlo = min(max(c0, i - pre - k0), c1)
        jhi = max(min(nk, i + nxt + 1 - k0), jlo)
        mbase = -1
        if ms[3] != 0:
            mbase = ms[0] * b + ms[1] * (n0 + g) + ms[2] * i + k0 + jlo
        ubase = -1
        if us[2] != 0:
            ubase = us[0] * i + us[1] * (k0 + jlo)
        _softmax_row(sc, pw, o, m, l, r, jlo, jhi, c0, c1, sf, mask, mbase, mf16, ub, ubase, us, Dv, rnd)


# flash_items' argument array fa (int64): the query's element span, the output's, the lse's batch entries Bq, the
# additive mask's and the user mask's addresses and spans (0, 0: none), then the query's geometry qg, the output's
# strides, the masks' strides and flags, S, the band, QB, the f16 / wide flags and the bounds of V's magnitude bits
# that call for scaling V first (0, 0: never; see flash_items)
(FA_QN, FA_ON, FA_BQ, FA_M, FA_MN, FA_U, FA_UN, FA_QG, FA_OS, FA_MS, FA_US, FA_S, FA_PRE, FA_NXT, FA_QB, FA_F16,
 FA_WIDE, FA_TAME, FA_LEN) = (0, 1, 2, 3, 4, 5, 6, 7, 13, 16, 20, 23, 24, 25, 26, 27, 28, 29, 31)
TAMED = np.float32(-2.0)        # istat[:, 1] of a launch that computed nothing: V needs scaling first


@njit(nogil=True, cache=True)
def flash_items(items, counter, kp, vp, vmag, istat, fa, scale, q_addr, o_addr, lse_addr):
    """Items it = (b * H + h) * nqb + qb (see the module doc), taken through the atomic `counter`. The caller keeps
    every tensor addressed alive for the call.
    - q_addr: the query's first element (read in place: _elems, uint16 bits of bf16, of float16 when f16, or
      float32, then f16 is set), fa[FA_QN] elements from there; qg = fa[FA_QG:FA_QG + 6]: N, L, D, then the
      element strides of its batch / head / row dims (element (b, n, i, d) at qg[3] * b + qg[4] * n + qg[5] * i + d);
    - o_addr: the output's first element in the query's element type, element (b, n, i, d) at ostr[0] * b +
      ostr[1] * n + ostr[2] * i + d (ostr = fa[FA_OS:FA_OS + 3]); lse_addr: the lse [Bq, N, L] float32
      (contiguous), Bq = fa[FA_BQ];
    - an additive mask in the query's element type, element (b, n, i, j) at ms[0] * b + ms[1] * n + ms[2] * i + j
      (strides 0 where it broadcasts), read only when ms[3] != 0;
    - a user mask shared by all entries and heads (bytes of element (i, j) at us[0] * i + us[1] * j, us[1] = 1:
      nonzero masks, 2: float16 nonzero masks; used when us[2] != 0);
    - S; row i keeps keys i - pre <= j <= i + nxt (top-left causal: nxt = 0, pre >= L; no band: both >= L + S);
      QB query positions per item; f16; wide: float32 query rows and probabilities (all but bf16 with vdpbf16ps;
      bf16 on 8-lane CPUs: the query widened, the probabilities rounded to bf16 values);
    - vmag: pack_items' magnitude bits of V's tiles; where their largest lies strictly between fa[FA_TAME] and
      fa[FA_TAME + 1] (finite values above the kernels' safe range, no NaN) nothing is computed and every item's
      istat[:, 1] is TAMED: the caller scales V and launches again (backend._tame's rule).
    kp / vp: pack_items' tiles. Key tiles no row of an item keeps are skipped (band, then user mask), and so are
    the 64-column blocks at either side of a tile that no row's band keeps. istat float32 [items, 2]: per item, the
    smallest lse it wrote (NaN when one is NaN) and -1 when an output element it stored is infinite or NaN, else 0
    (the caller's checks of the results, without passes over them: one min over the items)."""
    top = 0
    for x in vmag:
        top = max(top, x)
    if fa[FA_TAME] < top < fa[FA_TAME + 1]:
        istat[:, 1] = TAMED
        return
    H, KT = kp.shape[1], kp.shape[4]
    q16, out16 = _elems(q_addr, fa[FA_QN], kp), _elems(o_addr, fa[FA_ON], kp)
    lse = carray(addr_ptr(lse_addr), (fa[FA_BQ], fa[FA_QG], fa[FA_QG + 1]), np.float32)     # [Bq, N, L]
    mask = _elems(fa[FA_M], fa[FA_MN], kp)
    ub = carray(addr_ptr(fa[FA_U]), fa[FA_UN], np.uint8)
    qg, ostr, ms, us = fa[FA_QG:FA_QG + 6], fa[FA_OS:FA_OS + 3], fa[FA_MS:FA_MS + 4], fa[FA_US:FA_US + 3]
    S, pre, nxt, QB, f16 = fa[FA_S], fa[FA_PRE], fa[FA_NXT], fa[FA_QB], fa[FA_F16] != 0
    N, D = qg[0], qg[2]
    RP = ((N // H) * QB + ROWS - 1) // ROWS * ROWS
    if fa[FA_WIDE]:     # float32 query rows and probabilities (the GEMMs widen float16 / bf16 K / V; the
        #                 probabilities overwrite the scores: _prob_scratch, pb unused)
        _items(items, counter, q16, qg, kp, vp, out16, ostr, lse, mask, ms, ub, us, S, pre, nxt, scale, QB,
               np.zeros((RP, D), np.float32), np.zeros((1, 1), np.float32), f16, True, istat)
    else:               # bf16 bits of the query rows and probabilities (vdpbf16ps operands)
        _items(items, counter, q16, qg, kp, vp, out16, ostr, lse, mask, ms, ub, us, S, pre, nxt, scale, QB,
               np.zeros((RP, D), np.uint16), np.zeros((RP, KT), np.uint16), False, False, istat)


@njit(nogil=True, cache=True)
def _items(items, counter, q16, qg, kp, vp, out16, ostr, lse, mask, ms, ub, us, S, pre, nxt, scale, QB, qs, pb, f16,
           wide, istat):
    """flash_items' loop with its query-row scratch qs [RP, D] and probability scratch pb [RP, KT] (their
    dtypes choose the GEMMs: _qk, _pv, _pval; float32 probabilities overwrite the scores: _prob_scratch)."""
    H, KT = kp.shape[1], kp.shape[4]
    Dv = vp.shape[4]
    N, L, D = qg[0], qg[1], qg[2]
    rnd = wide and not f16                        # bf16 with float32 probabilities: rounded to bf16 values
    G = N // H
    nqb = (L + QB - 1) // QB
    RB = G * QB
    RP = qs.shape[0]
    sc = np.empty((RP, KT), np.float32)           # scores of one tile
    o = np.empty((RP, Dv), np.float32)            # accumulators
    m = np.empty(RP, np.float32)
    l = np.empty(RP, np.float32)
    sf = np.float32(scale)
    while True:
        it = claim(items, counter)
        if it < 0:
            break
        b, h, qb = _split(it, H, nqb)
        i0 = qb * QB
        nq = min(QB, L - i0)
        for g in range(G):
            for ii in range(QB):
                r = g * QB + ii
                qb0 = np.uint64(qg[3] * b + qg[4] * (h * G + g) + qg[5] * (i0 + ii))     # (unsigned: see rows)
                if ii < nq and wide:
                    for d in range(np.uint64(D)):
                        qs[r, d] = _val(q16[qb0 + d], f16)
                elif ii < nq:
                    for d in range(np.uint64(D)):
                        qs[r, d] = q16[qb0 + d]
                else:
                    for d in range(D):
                        qs[r, d] = 0
        o[:, :] = np.float32(0.0)
        m[:] = np.float32(-np.inf)
        l[:] = np.float32(0.0)
        # keys some row of the item keeps: [klo, khi)
        klo = max(0, i0 - pre)
        khi = min(S, i0 + nq + nxt)
        for t in range(klo // KT, (khi + KT - 1) // KT if khi > klo else 0):
            k0 = t * KT
            c0 = (max(klo - k0, 0) // COLS) * COLS                  # computed columns [c0, c1) of the tile
            c1 = (min(khi - k0, KT) + COLS - 1) // COLS * COLS
            nk = min(KT, S - k0)                                     # keys that exist
            if us[2] != 0 and not _tile_open(ub, us, i0, nq, k0, pre, nxt, c0, c1, nk):
                continue                                             # every key of the tile user-masked
            _qk(qs, kp[b, h, t], c0, c1, sc, RP, KT, D)
            _softmax_tile(sc, pb, o, m, l, b, h * G, RB, i0, nq, QB, k0, c0, c1, nk, pre, nxt, sf, mask, ms, f16,
                          ub, us, Dv, rnd)
            _pv(_prob_scratch(sc, pb), vp[b, h, t], c0, c1, o, RP, KT, Dv)
        lmin = np.float32(np.inf)
        bad = False
        for g in range(G):
            n = h * G + g
            for ii in range(nq):
                r = g * QB + ii
                ob = ostr[0] * b + ostr[1] * n + ostr[2] * (i0 + ii)
                if l[r] == np.float32(0.0):                  # no key: 0 (even where P = 0 met a NaN value)
                    for d in range(Dv):
                        out16[ob + d] = 0
                    lse[b, n, i0 + ii] = np.float32(-np.inf)
                    lmin = np.float32(-np.inf) if lmin == lmin else lmin
                    continue
                inv = np.float32(1.0) / l[r]                 # l NaN: a NaN row, as the products give
                top = np.uint32(0)                           # the row's largest magnitude bits
                for d in range(Dv):
                    y = o[r, d] * inv
                    out16[ob + d] = _outv(out16, y, f16)
                    top = max(top, f32_as_u32(y) & np.uint32(0x7FFFFFFF))
                bad |= top >= _inf_from(out16, f16)          # stored as infinity or NaN
                x = m[r] + np.log(l[r])
                lse[b, n, i0 + ii] = x
                if (f32_as_u32(x) & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    lmin = x                                 # NaN: stays
                elif lmin == lmin and x < lmin:
                    lmin = x
        istat[it, 0] = lmin
        istat[it, 1] = np.float32(-1.0) if bad else np.float32(0.0)      # (-1: one min finds both)
