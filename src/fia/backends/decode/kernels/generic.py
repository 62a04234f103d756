"""QK and PV of the generic build: the numba float32 loops for what the LLVM-IR micro-kernels (cpu/simd.py,
fma.py, vnni.py, amx.py) do not take -- int4 and MLA-rope K / V, head dims that are not multiples of 16, float32 K / V
without DP_F32. qk_block / pv_block read rows widened into a float32 chunk (rows.load_rows); qk_fused / pv_fused
widen each element straight from the cache.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ....cpu.fma import pv_fma, qk_fma
from ....cpu.numerics import FM, bf16_to_f32, fp16_to_f32
from ....cpu.simd import KIND_BF16, KIND_FP16, KIND_I8
from ....cpu import kernel_cache
from .params import IP_KT_BLK, IP_KT_BS, IP_KT_H, IP_KT_S, IP_VT_BLK, IP_VT_BS, IP_VT_H, IP_VT_S, KIND_FP4
from .rows import fp4_rows, load_rows, row_offsets, views

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


@njit(fastmath=FM, cache=True)
def qk_block(q, kf, s, R, n, dq):
    """s[r, c] = q[r, :dq] . kf[c, :dq] for r < R, c < n (2 rows x 4 keys per block)."""
    r = 0
    while r + 1 < R:
        c = 0
        while c + 3 < n:
            a00 = np.float32(0.0); a01 = np.float32(0.0); a02 = np.float32(0.0); a03 = np.float32(0.0)  # noqa: E702
            a10 = np.float32(0.0); a11 = np.float32(0.0); a12 = np.float32(0.0); a13 = np.float32(0.0)  # noqa: E702
            for d in range(dq):
                x0 = q[r, d]
                x1 = q[r + 1, d]
                y0 = kf[c, d]
                y1 = kf[c + 1, d]
                y2 = kf[c + 2, d]
                y3 = kf[c + 3, d]
                a00 += x0 * y0; a01 += x0 * y1; a02 += x0 * y2; a03 += x0 * y3  # noqa: E702
                a10 += x1 * y0; a11 += x1 * y1; a12 += x1 * y2; a13 += x1 * y3  # noqa: E702
            s[r, c] = a00; s[r, c + 1] = a01; s[r, c + 2] = a02; s[r, c + 3] = a03  # noqa: E702
            s[r + 1, c] = a10; s[r + 1, c + 1] = a11; s[r + 1, c + 2] = a12; s[r + 1, c + 3] = a13  # noqa: E702
            c += 4
        while c < n:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for d in range(dq):
                y = kf[c, d]
                a0 += q[r, d] * y
                a1 += q[r + 1, d] * y
            s[r, c] = a0
            s[r + 1, c] = a1
            c += 1
        r += 2
    if r < R:
        c = 0
        while c + 3 < n:
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(dq):
                x0 = q[r, d]
                a0 += x0 * kf[c, d]; a1 += x0 * kf[c + 1, d]; a2 += x0 * kf[c + 2, d]; a3 += x0 * kf[c + 3, d]  # noqa: E702
            s[r, c] = a0; s[r, c + 1] = a1; s[r, c + 2] = a2; s[r, c + 3] = a3  # noqa: E702
            c += 4
        while c < n:
            a0 = np.float32(0.0)
            for d in range(dq):
                a0 += q[r, d] * kf[c, d]
            s[r, c] = a0
            c += 1


@njit(fastmath=FM, cache=True)
def pv_block(p, vf, acc, R, n, dv):
    """acc[r, :dv] += sum_c p[r, c] * vf[c, :dv] (2 rows x 4 keys per block)."""
    c = 0
    while c + 3 < n:
        r = 0
        while r + 1 < R:
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            p10 = p[r + 1, c]; p11 = p[r + 1, c + 1]; p12 = p[r + 1, c + 2]; p13 = p[r + 1, c + 3]  # noqa: E702
            for d in range(dv):
                x0 = vf[c, d]
                x1 = vf[c + 1, d]
                x2 = vf[c + 2, d]
                x3 = vf[c + 3, d]
                acc[r, d] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
                acc[r + 1, d] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
            r += 2
        if r < R:
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            for d in range(dv):
                acc[r, d] += p00 * vf[c, d] + p01 * vf[c + 1, d] + p02 * vf[c + 2, d] + p03 * vf[c + 3, d]
        c += 4
    while c < n:
        for r in range(R):
            pr = p[r, c]
            for d in range(dv):
                acc[r, d] += pr * vf[c, d]
        c += 1


# bf16 / fp16 / int8 K and V straight from the cache: each element is widened where it is used, the
# 4 query rows of a block share every widened K/V vector (no conversion pass, no float32 chunk).
def cvt(buf, i, kind):
    """float32 of element i of a buffer whose element type says the format: uint16 = bf16, int16 =
    fp16 (bit patterns), int8 = int8. Resolved at compile time: no per-element branch."""


@overload(cvt, jit_options={"fastmath": FM})
def _cvt_impl(buf, i, kind):
    if buf.dtype == types.uint16:
        def impl(buf, i, kind):
            return bf16_to_f32(buf[i])
        return impl
    if buf.dtype == types.int16:
        def impl(buf, i, kind):
            return fp16_to_f32(np.uint16(buf[i]))
        return impl
    if buf.dtype == types.int8:
        def impl(buf, i, kind):
            return np.float32(buf[i])
        return impl
    return None


@njit(fastmath=FM, cache=True)
def qk_fused(q, buf, kind, offs, n, s, R, D):
    """s[r, c] = q[r, :D] . K[c, :D] with key c at element offs[c] of buf (blocks: 4 rows x 2 keys)."""
    D_ = np.uint64(D)
    r = 0
    while r + 3 < R:
        c = 0
        while c + 1 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            a00 = np.float32(0.0); a01 = np.float32(0.0); a10 = np.float32(0.0); a11 = np.float32(0.0)  # noqa: E702
            a20 = np.float32(0.0); a21 = np.float32(0.0); a30 = np.float32(0.0); a31 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                y0 = cvt(buf, o0 + d, kind)
                y1 = cvt(buf, o1 + d, kind)
                x0 = q[r, d]
                x1 = q[r + 1, d]
                x2 = q[r + 2, d]
                x3 = q[r + 3, d]
                a00 += x0 * y0; a01 += x0 * y1; a10 += x1 * y0; a11 += x1 * y1  # noqa: E702
                a20 += x2 * y0; a21 += x2 * y1; a30 += x3 * y0; a31 += x3 * y1  # noqa: E702
            s[r, c] = a00; s[r, c + 1] = a01; s[r + 1, c] = a10; s[r + 1, c + 1] = a11  # noqa: E702
            s[r + 2, c] = a20; s[r + 2, c + 1] = a21; s[r + 3, c] = a30; s[r + 3, c + 1] = a31  # noqa: E702
            c += 2
        if c < n:
            o0 = np.uint64(offs[c])
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                y0 = cvt(buf, o0 + d, kind)
                a0 += q[r, d] * y0; a1 += q[r + 1, d] * y0; a2 += q[r + 2, d] * y0; a3 += q[r + 3, d] * y0  # noqa: E702
            s[r, c] = a0; s[r + 1, c] = a1; s[r + 2, c] = a2; s[r + 3, c] = a3  # noqa: E702
        r += 4
    while r < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                x0 = q[r, d]
                a0 += x0 * cvt(buf, o0 + d, kind); a1 += x0 * cvt(buf, o1 + d, kind)  # noqa: E702
                a2 += x0 * cvt(buf, o2 + d, kind); a3 += x0 * cvt(buf, o3 + d, kind)  # noqa: E702
            s[r, c] = a0; s[r, c + 1] = a1; s[r, c + 2] = a2; s[r, c + 3] = a3  # noqa: E702
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            a0 = np.float32(0.0)
            for d in range(D_):
                a0 += q[r, d] * cvt(buf, o0 + d, kind)
            s[r, c] = a0
            c += 1
        r += 1


@njit(fastmath=FM, cache=True)
def pv_fused(p, buf, kind, offs, n, acc, R, Dv):
    """acc[r, :Dv] += sum_c p[r, c] * V[c, :Dv] with value c at element offs[c] of buf
    (blocks: 4 rows x 4 keys)."""
    Dv_ = np.uint64(Dv)
    r = 0
    while r + 3 < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            p10 = p[r + 1, c]; p11 = p[r + 1, c + 1]; p12 = p[r + 1, c + 2]; p13 = p[r + 1, c + 3]  # noqa: E702
            p20 = p[r + 2, c]; p21 = p[r + 2, c + 1]; p22 = p[r + 2, c + 2]; p23 = p[r + 2, c + 3]  # noqa: E702
            p30 = p[r + 3, c]; p31 = p[r + 3, c + 1]; p32 = p[r + 3, c + 2]; p33 = p[r + 3, c + 3]  # noqa: E702
            for d in range(Dv_):
                y0 = cvt(buf, o0 + d, kind)
                y1 = cvt(buf, o1 + d, kind)
                y2 = cvt(buf, o2 + d, kind)
                y3 = cvt(buf, o3 + d, kind)
                acc[r, d] += p00 * y0 + p01 * y1 + p02 * y2 + p03 * y3
                acc[r + 1, d] += p10 * y0 + p11 * y1 + p12 * y2 + p13 * y3
                acc[r + 2, d] += p20 * y0 + p21 * y1 + p22 * y2 + p23 * y3
                acc[r + 3, d] += p30 * y0 + p31 * y1 + p32 * y2 + p33 * y3
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            p00 = p[r, c]; p10 = p[r + 1, c]; p20 = p[r + 2, c]; p30 = p[r + 3, c]  # noqa: E702
            for d in range(Dv_):
                y0 = cvt(buf, o0 + d, kind)
                acc[r, d] += p00 * y0
                acc[r + 1, d] += p10 * y0
                acc[r + 2, d] += p20 * y0
                acc[r + 3, d] += p30 * y0
            c += 1
        r += 4
    while r < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            for d in range(Dv_):
                acc[r, d] += (p00 * cvt(buf, o0 + d, kind) + p01 * cvt(buf, o1 + d, kind)
                              + p02 * cvt(buf, o2 + d, kind) + p03 * cvt(buf, o3 + d, kind))
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            p00 = p[r, c]
            for d in range(Dv_):
                acc[r, d] += p00 * cvt(buf, o0 + d, kind)
            c += 1
        r += 1


# The generic build's QK / PV of a chunk, as the item driver calls them (items._qk / _pv). Overloads on the type
# of `generic`: with None (the build without the generic loops) they compile to nothing, which keeps the first
# build's compile time down; with an array, the loops below.
def qk_loops(c, ip, i, h, c0, n, src, cs, qv, kbu, rbu, vpf, generic):
    """Scores cs.s [R, n] of head h's chunk by the generic loops (see above)."""


def pv_loops(c, ip, i, h, c0, n, src, cs, vbu, generic):
    """The chunk's probabilities cs.s times its V rows into cs.tacc by the generic loops (see above)."""


@overload(qk_loops, inline="always", jit_options={"fastmath": FM})
def _qk_loops(c, ip, i, h, c0, n, src, cs, qv, kbu, rbu, vpf, generic):
    if isinstance(generic, types.NoneType):
        return lambda c, ip, i, h, c0, n, src, cs, qv, kbu, rbu, vpf, generic: None

    def impl(c, ip, i, h, c0, n, src, cs, qv, kbu, rbu, vpf, generic):
        R, D, s, koff, knext = c.R, c.D, cs.s, cs.koff, cs.knext
        if c.Dr == 0 and c.k_kind == KIND_BF16:
            qk_fused(qv, views(kbu)[1], c.k_kind, koff, n, s, R, D)
        elif c.Dr == 0 and c.k_kind == KIND_FP16:
            qk_fused(qv, views(kbu)[1].view(np.int16), c.k_kind, koff, n, s, R, D)
        elif c.Dr == 0 and c.k_kind == KIND_I8:
            qk_fused(qv, views(kbu)[0], c.k_kind, koff, n, s, R, D)
        elif c.k_kind == KIND_FP4:     # the chunk as bf16 (knext: group scales, then rows), then qk_fma
            row_offsets(src.kt_tbl, i, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], h * ip[IP_KT_H], ip[IP_KT_S], knext)
            fp4_rows(kbu, koff, 0, n, src.kgs, knext, cs.kf16, D, knext)
            qk_fma(qv.ctypes.data, qv.shape[1] * 4, cs.kf16.ctypes.data, KIND_BF16, knext.ctypes.data, n,
                   s.ctypes.data, s.shape[1], R, D, src.vbuf.ctypes.data, vpf.ctypes.data, n if c.pf else 0,
                   c.v_row, c.v_pf)
        else:
            k8, k16, k32, kfl = views(kbu)
            load_rows(k8, k16, k32, kfl, koff, n, c.k_kind, cs.kf, 0, D)
            if c.Dr > 0:
                r8, r16, r32, rfl = views(rbu)
                load_rows(r8, r16, r32, rfl, cs.roff, n, c.r_kind, cs.kf, D, c.Dr)
            qk_block(qv, cs.kf, s, R, n, c.dq)
    return impl


@overload(pv_loops, inline="always", jit_options={"fastmath": FM})
def _pv_loops(c, ip, i, h, c0, n, src, cs, vbu, generic):
    if isinstance(generic, types.NoneType):
        return lambda c, ip, i, h, c0, n, src, cs, vbu, generic: None

    def impl(c, ip, i, h, c0, n, src, cs, vbu, generic):
        R, Dv, s, voff, tacc = c.R, c.Dv, cs.s, cs.voff, cs.tacc
        if c.v_kind == KIND_BF16:
            pv_fused(s, views(vbu)[1], c.v_kind, voff, n, tacc, R, Dv)
        elif c.v_kind == KIND_FP16:
            pv_fused(s, views(vbu)[1].view(np.int16), c.v_kind, voff, n, tacc, R, Dv)
        elif c.v_kind == KIND_I8:
            pv_fused(s, views(vbu)[0], c.v_kind, voff, n, tacc, R, Dv)
        elif c.v_kind == KIND_FP4:     # as K (roff: unused without rope, which FP4 never has)
            roff = cs.roff
            row_offsets(src.vt_tbl, i, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], h * ip[IP_VT_H], ip[IP_VT_S], roff)
            fp4_rows(vbu, voff, 0, n, src.vgs, roff, cs.vf16, Dv, roff)
            pv_fma(s.ctypes.data, s.shape[1] * 4, cs.vf16.ctypes.data, KIND_BF16, roff.ctypes.data, n,
                   tacc.ctypes.data, Dv, R, Dv, src.kbuf.ctypes.data, cs.knext.ctypes.data, 0, c.k_row, c.k_pf)
        else:
            v8, v16, v32, vfl = views(vbu)
            load_rows(v8, v16, v32, vfl, voff, n, c.v_kind, cs.vf, 0, Dv)
            pv_block(s, cs.vf, tacc, R, n, Dv)
    return impl
