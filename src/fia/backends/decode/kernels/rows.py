"""Gather stage of a decode item: where a chunk's K / V rows lie (row_offsets: dense or paged, any strides), the
NZ fragment layout packed into row order (nz_pack / nz_lines), rows widened to float32 (load_rows; FP4 rows decoded
to bf16, fp4_rows), the touch pass over several heads' rows (touch_rows) and the even / odd channel order of the
8-lane bf16 FMA kernels (eo_rows).

Hot loops index 2-D arrays directly (a[r, d]) and never take row views: a view costs an atomic reference count
update, and those serialize threads that share an array.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ....cpu.fp4 import fp4_group_bf16
from ....cpu.numerics import FM, copy32, u32_as_f32, bf16_to_f32, fp16_to_f32
from ....cpu.simd import KIND_BF16, KIND_F32, KIND_FP16, KIND_I4, KIND_I8
from ....cpu import kernel_cache
from .params import KIND_FP4

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


# Hot loops index 2-D arrays directly (a[r, d]) and never take row views: a view costs an atomic
# reference count update, and those serialize threads that share an array.
@njit(fastmath=FM, cache=True, inline="always")
def views(buf):
    """The typed views of a byte buffer: (int8, uint16, int32, float32), each cut to whole elements.
    One kernel specialization serves every dtype: the dtype is a runtime `kind`."""
    n = buf.shape[0]
    return (buf.view(np.int8), buf[:n - n % 2].view(np.uint16), buf[:n - n % 4].view(np.int32),
            buf[:n - n % 4].view(np.float32))


@njit(fastmath=FM, cache=True)
def load_rows(b8, b16, b32, bf, offs, nr, kind, dst, d0, n):
    """dst[c, d0:d0 + n] = float32 of the n logical elements at element offs[c] of the buffer, c < nr
    (element = one value of its kind; int4: one int32 holding eight values).

    Indices are unsigned on purpose: a signed computed index makes numba emit a wraparound select
    per element, which stops LLVM from vectorizing the loop (10x slower)."""
    n_ = np.uint64(n)
    d0_ = np.uint64(d0)
    if kind == KIND_BF16:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = bf16_to_f32(b16[o + d])
    elif kind == KIND_FP16:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = fp16_to_f32(b16[o + d])
    elif kind == KIND_I8:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = np.float32(b8[o + d])
    elif kind == KIND_I4:
        # eight values per int32, low nibble first (SPEC 10.4): on a little-endian machine byte k of a
        # row holds value 2k in its low and value 2k + 1 in its high nibble (two's complement each)
        for c in range(nr):
            o = np.uint64(offs[c]) * np.uint64(4)
            for k in range(n_ // np.uint64(2)):
                x = np.int32(b8[o + k])                  # sign-extended byte
                lo = x & 0xF
                dst[c, d0_ + np.uint64(2) * k] = np.float32(lo - ((lo & 8) << 1))
                dst[c, d0_ + np.uint64(2) * k + np.uint64(1)] = np.float32(x >> 4)
    else:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = bf[o + d]


@njit(fastmath=FM, cache=True, inline="always")
def e8m0_to_f32(e):
    """FLOAT8_E8M0 byte -> 2^(e - 127) as float32 (0 -> 2^-127, a subnormal; 0xFF -> NaN)."""
    u = np.uint32(e)
    return u32_as_f32(np.uint32(0x00400000) if u == 0 else (np.uint32(0x7FC00000) if u == 255 else u << np.uint32(23)))


@njit(fastmath=FM, cache=True)
def fp4_rows(b8, offs, c0, nr, sc8, soffs, dst, n, rows):
    """Row c - c0 of dst (bf16 bits, rows n apart), c0 <= c < c0 + nr, = e2m1(value) * 2^(E - 127) for the n FP4
    values at byte offset offs[c] of b8 (value 2k in the low, 2k + 1 in the high nibble of byte k) and their E8M0 exponents E, one per 32
    values, at byte offset soffs[c] of sc8 (SPEC 10b.1); rows[c] = its element offset (for qk_fma / pv_fma). Exact in
    bf16: the float32 product has at most two significant bits (0, NaN and inf included)."""
    ng = n // 32
    src = b8.ctypes.data
    out = dst.ctypes.data
    for c in range(c0, c0 + nr):
        o = src + offs[c]
        so = np.uint64(soffs[c])
        base = (c - c0) * n
        for gi in range(ng):                            # 16 bytes -> 32 bf16 (cpu/fp4.py)
            fp4_group_bf16(out + 2 * (base + 32 * gi), o + 16 * gi, e8m0_to_f32(sc8[so + np.uint64(gi)]))
        rows[c] = np.int64(base)


@njit(cache=True, inline="always")
def elem_layout(kind, d):
    """(bytes per element, elements per row of d values) of a buffer kind (int4: int32 of eight values)."""
    if kind == KIND_F32:
        return 4, d
    if kind == KIND_I8:
        return 1, d
    if kind == KIND_I4:
        return 4, d // 8
    if kind == KIND_FP4:
        return 1, d // 2
    return 2, d


@njit(fastmath=FM, cache=True)
def nz_pack(buf, offs, n, es, d, fs, fw, dst):
    """The n rows at element offsets offs[c] of an NZ cache (SPEC 8b: a row is d / fw fragments of fw elements
    of es bytes, fs elements apart) copied side by side into the byte scratch dst; offs[c] becomes row c's
    element offset there. Every kernel then reads them as the rows of an ND cache: the same sums in the same
    order (NZ results equal the 4-D cache's), for one copy of the chunk through L1."""
    fb = fw * es
    nf = d // fw
    rb = d * es
    fsb = fs * es
    src = buf.ctypes.data
    out = dst.ctypes.data
    if fb == 32 and nf <= 8:                           # every NZ cache of SPEC 8b: 32 int8 or 16 bf16 / fp16;
        for c in range(n):                             # row by row for few fragments, else column by column
            o = src + offs[c] * es                     # (MLA D = 512: 32 streams), whichever measured faster
            t = out + c * rb                           # (docs/performance.md, "Kernel choices: the measurements")
            for f in range(nf):
                copy32(t + f * 32, o + f * fsb)
    elif fb == 32:
        for f in range(nf):
            for c in range(n):
                copy32(out + c * rb + f * 32, src + offs[c] * es + f * fsb)
    else:
        for c in range(n):
            b0 = np.uint64(offs[c] * es)
            t0 = np.uint64(c * rb)
            for f in range(np.uint64(nf)):
                for j in range(np.uint64(fb)):
                    dst[t0 + f * np.uint64(fb) + j] = buf[b0 + f * np.uint64(fsb) + j]
    for c in range(n):
        offs[c] = c * d


@njit(fastmath=FM, cache=True, inline="always")
def nz_lines(offs, n, d, fw, fs):
    """The kernels' prefetch rows for n NZ rows at element offsets offs[c] (rewritten in place): row p becomes
    the d elements of fragment column p % (d / fw) of rows p - p % (d / fw) .. (a run of d / fw slots, side by side
    in a block), so that requesting n "rows" of d elements requests every fragment of the n rows."""
    nf = d // fw
    for p in range(n):
        f = p % nf
        offs[p] = offs[p - f] + f * fs


@njit(fastmath=FM, cache=True, inline="always")
def row_offsets(tbl, i, c0, n, bs, s_blk, base, s_s, dst):
    """dst[c] = element offset of key position c0 + c (c < n) of query group i: block tbl[i, p // bs]
    (the paged block, or the batch for unpaged storage with bs = "infinite") times s_blk + base + the
    slot (p % bs) times s_s; one block segment at a time (affine inside a block)."""
    bi = c0 // bs
    sl = c0 - bi * bs
    c = 0
    while c < n:
        seg = min(n - c, bs - sl)
        o = tbl[i, bi] * s_blk + base + sl * s_s
        c_ = np.uint64(c)
        for j in range(np.uint64(seg)):                  # unsigned: vectorizes
            dst[c_ + j] = o + np.int64(j) * s_s
        c += seg
        sl += seg
        if sl == bs:
            sl = 0
            bi += 1


@njit(fastmath=FM, cache=True, inline="always")
def touch_rows(buf, offs, n, es, span):
    """Read the span bytes at element offset offs[c] (elements of es bytes) of buf for keys c < n, front to
    back, and return their xor: demand loads that bring a chunk's rows of several KV heads into the caches in
    address order (DP_TOUCH). The 8-byte words that hold them, cut to the buffer."""
    w = buf[:buf.shape[0] - buf.shape[0] % 8].view(np.uint64)
    nw = np.uint64(w.shape[0])
    x = np.uint64(0)
    for c in range(n):
        b0 = np.uint64(offs[c] * es)
        j0 = b0 >> np.uint64(3)
        j1 = min((b0 + np.uint64(span) + np.uint64(7)) >> np.uint64(3), nw)
        for j in range(j0, j1):
            x ^= w[j]
    return x


@njit(fastmath=FM, cache=True, inline="always")
def _copy_strided(src, o, st, dst, c, n):
    """dst[c:c + n] = src[o], src[o + st], ... (unsigned indices: the unit-stride loop vectorizes)."""
    o_, c_ = np.uint64(o), np.uint64(c)
    if st == 1:
        for j in range(np.uint64(n)):
            dst[c_ + j] = src[o_ + j]
    else:
        for j in range(n):
            dst[c + j] = src[o + j * st]


@njit(fastmath=FM, cache=True)
def eo_rows(x, R, D, tmp, back, w):
    """x[r, :D] (D % w == 0) per w channels: the even-indexed ones, then the odd-indexed ones (the layout of
    cpu.fma.KIND_BF16_EO's halves, w = 2 x the kernels' lanes: the query for qk_fma), or back from it (pv_fma's
    accumulators). tmp: scratch of >= w floats in row 0."""
    h = w // 2
    for r in range(R):
        for j in range(0, D, w):
            for i in range(w):
                tmp[0, i] = x[r, j + i]
            if back:
                for i in range(h):
                    x[r, j + 2 * i] = tmp[0, i]
                    x[r, j + 2 * i + 1] = tmp[0, h + i]
            else:
                for i in range(h):
                    x[r, j + i] = tmp[0, 2 * i]
                    x[r, j + h + i] = tmp[0, 2 * i + 1]
