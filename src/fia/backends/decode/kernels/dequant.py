"""Dequantization of int8 / int4 / FP4 K and V in the decode kernels (SPEC 10: x = (x_q + offset) * scale), folded
out of the inner loops: per-channel / per-tensor / per-head factors prepared once per call (fill_factors), per-token
ones read per chunk (token_scales), and the exceptional tokens -- factors so large, or NaN / infinite, that folding
would change what overflows -- computed element by element as the reference does (exact_key_tokens,
exact_value_tokens).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from ....cpu.numerics import FM, addr_ptr, bf16_to_f32, fp16_to_f32
from ....cpu.simd import KIND_BF16, KIND_F32, prefetch_span
from ....cpu import kernel_cache
from .params import EXC_FACTOR, FS_ADDR, FS_GRAN, FS_KIND, FS_SHAPE, FS_STRIDE, GRAN_CHANNEL, GRAN_HEAD, I8_QK_MAX_ERR
from .rows import _copy_strided, load_rows, views

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


@njit(cache=True)
def fill_factors(specs, kchan, vcs, vco):
    """The dequant factors applied outside the loop as float32 from the factor tensors in place: rows of specs
    [4, FS_LEN] (key scale, key offset, value scale, value offset; address 0: absent) give each tensor's
    address, element kind, granularity (GRAN_*: one value for all, H x D values, one per head), and shape /
    element strides padded to 4 dims (shape 1). Key scale / offset go to kchan[0] / kchan[1] [H, D], value
    scale / offset to vcs / vco [H, Dv]; the values in the tensor's logical order (as torch's reshape).
    Returns whether a scale / offset pair lies outside EXC_FACTOR (NaN / infinite included): folded out of the loop,
    such factors would not give the reference's element-wise inf * 0 and overflows (backend.py then runs the call
    with the reference's formulas)."""
    for f in range(4):
        addr = specs[f, FS_ADDR]
        if addr == 0:
            continue
        out = kchan[min(f, 1)] if f < 2 else (vcs if f == 2 else vco)
        flat = out.reshape(-1)                             # [H * D] (contiguous)
        H, Dd = out.shape
        kind = specs[f, FS_KIND]
        gran = specs[f, FS_GRAN]
        last = 0
        for d in range(4):
            last += (specs[f, FS_SHAPE + d] - 1) * specs[f, FS_STRIDE + d]
        es = 4 if kind == KIND_F32 else 2
        buf = carray(addr_ptr(addr), ((last + 1) * es,), np.uint8)
        b16 = buf.view(np.uint16) if es == 2 else buf[:0].view(np.uint16)
        b32 = buf.view(np.float32) if es == 4 else buf[:0].view(np.float32)
        n0, n1, n2, n3 = specs[f, FS_SHAPE], specs[f, FS_SHAPE + 1], specs[f, FS_SHAPE + 2], specs[f, FS_SHAPE + 3]
        s0, s1, s2 = specs[f, FS_STRIDE], specs[f, FS_STRIDE + 1], specs[f, FS_STRIDE + 2]
        s3 = specs[f, FS_STRIDE + 3]
        i = 0
        for a in range(n0):
            for b in range(n1):
                for c in range(n2):
                    o = a * s0 + b * s1 + c * s2
                    for _e in range(n3):
                        if kind == KIND_F32:
                            x = b32[o]
                        elif kind == KIND_BF16:
                            x = bf16_to_f32(b16[o])
                        else:
                            x = fp16_to_f32(b16[o])
                        o += s3
                        if gran == GRAN_CHANNEL:
                            flat[i] = x
                        elif gran == GRAN_HEAD:
                            for j in range(Dd):
                                out[i, j] = x
                        else:
                            for j in range(H * Dd):
                                flat[j] = x
                        i += 1
    bad = False
    for k in range(2):                                     # (key: kchan[0] / kchan[1]; value: vcs / vco)
        if specs[2 * k, FS_ADDR] == 0:
            continue
        sc = kchan[0] if k == 0 else vcs
        has_off = specs[2 * k + 1, FS_ADDR] != 0
        off = kchan[min(1, kchan.shape[0] - 1)] if k == 0 else vco
        for a in range(sc.shape[0]):
            for d in range(sc.shape[1]):
                x = abs(sc[a, d]) * (np.float32(128.0) + (abs(off[a, d]) if has_off else np.float32(0.0)))
                if not x <= EXC_FACTOR:
                    bad = True
    return bad


@njit(fastmath=FM, cache=True)
def token_scales(tbl, i, h, c0, n, tb, s_blk, s_h, s_s, mode, sc, off, dst_s, dst_o):
    """Per-token dequant factors of the chunk's keys [c0, c0 + n) of query group i, KV head h: scale into
    dst_s (and offset into dst_o when mode == 2). Token p's factor is element tbl[i, p // tb] * s_blk +
    h * s_h + (p % tb) * s_s (by batch, or by paged block: the same addressing as the keys, row_offsets),
    copied one block segment at a time (contiguous factors: a vectorized copy)."""
    bi = c0 // tb
    sl = c0 - bi * tb
    c = 0
    while c < n:
        seg = min(n - c, tb - sl)
        o = tbl[i, bi] * s_blk + h * s_h + sl * s_s
        _copy_strided(sc, o, s_s, dst_s, c, seg)
        if mode == 2:
            _copy_strided(off, o, s_s, dst_o, c, seg)
        c += seg
        sl += seg
        if sl == tb:
            sl = 0
            bi += 1


@njit(cache=True, inline="always")
def request_tokens(tbl, i, h, c0, n, tb, s_blk, s_h, s_s, mode, sc, off):
    """Request (prefetcht1) the per-token factors token_scales will copy for keys [c0, c0 + n): those of the first
    block segment, where they are contiguous (s_s == 1). Issued during the chunk before, they arrive with its PV
    instead of stalling the next gather (K / V from DRAM: token_scales was 5 % of an int8 call)."""
    if s_s != 1 or n <= 0:
        return
    bi = c0 // tb
    sl = c0 - bi * tb
    o = tbl[i, bi] * s_blk + h * s_h + sl
    nb = 4 * min(n, tb - sl)
    prefetch_span(sc.ctypes.data + 4 * o, nb)
    if mode == 2:
        prefetch_span(off.ctypes.data + 4 * o, nb)


@njit(fastmath=FM, cache=True, inline="always")
def exceptional(sc, off, mode, n):
    """Whether a token of the chunk (< n) has per-token factors outside EXC_FACTOR (see there; NaN included).
    A count of compares, not an early exit or a max: the loop vectorizes (a float max without nnan does not)."""
    bad = 0
    if mode == 2:
        for c in range(np.uint64(n)):
            bad += 0 if abs(sc[c]) * (np.float32(128.0) + abs(off[c])) <= EXC_FACTOR else 1
    else:
        for c in range(np.uint64(n)):
            bad += 0 if abs(sc[c]) * np.float32(128.0) <= EXC_FACTOR else 1
    return bad != 0


@njit(fastmath=FM, cache=True, inline="always")
def exceptional_row(c, sc, off, mode, x8, x16, x32, xfl, kind, xoff, D, dst, offs):
    """Whether token c's dequant factors are exceptional (past EXC_FACTOR); if so dst[0, :D] = its row dequantized
    element by element in float32, (x + offset) * scale_c, as the reference does."""
    o = off[c] if mode == 2 else np.float32(0.0)
    t = sc[c]
    if abs(t) * (np.float32(128.0) + abs(o)) <= EXC_FACTOR:
        return False
    offs[0] = xoff[c]
    load_rows(x8, x16, x32, xfl, offs, 1, kind, dst, 0, D)
    for d in range(D):
        dst[0, d] = (dst[0, d] + o) * t
    return True


@njit(fastmath=FM, cache=True)
def exact_key_tokens(s, R, n, sc, off, mode, kbuf, k_kind, koff, qraw, D, scale, kf, offs):
    """The scores s[:R, c] of the chunk's exceptional key tokens c (exceptional), as the reference computes them:
    (q . ((k + offset) * scale_c)) * softmax scale, the key dequantized element by element in float32; qraw [R, D]:
    the rows' query (times dequant_scale_query)."""
    k8, k16, k32, kfl = views(kbuf)
    for c in range(n):
        if not exceptional_row(c, sc, off, mode, k8, k16, k32, kfl, k_kind, koff, D, kf, offs):
            continue
        for r in range(R):
            a = np.float32(0.0)
            for d in range(D):
                a += qraw[r, d] * kf[0, d]
            s[r, c] = a * scale


@njit(fastmath=FM, cache=True)
def exact_value_tokens(s, R, n, sc, off, mode, vbuf, v_kind, voff, Dv, tacc, vf, offs):
    """The chunk's exceptional value tokens c (exceptional): tacc[r, :] += w[r, c] * ((v + offset) * scale_c), the
    value dequantized element by element in float32 as the reference does; their weights and factors are then
    zeroed, so the other paths (weights times scale, offset extras) leave them out."""
    v8, v16, v32, vfl = views(vbuf)
    for c in range(n):
        if not exceptional_row(c, sc, off, mode, v8, v16, v32, vfl, v_kind, voff, Dv, vf, offs):
            continue
        for r in range(R):
            w = s[r, c]
            for d in range(Dv):
                tacc[r, d] += w * vf[0, d]
            s[r, c] = np.float32(0.0)
        sc[c] = np.float32(0.0)
        off[c] = np.float32(0.0)


@njit(fastmath=FM, cache=True, inline="always")
def _i8_tokens_ok(qerr, tsk, n):
    """Whether the int16 query keeps the chunk's scores within I8_QK_MAX_ERR under its per-token key scales
    (every |scale| <= I8_QK_MAX_ERR / qerr; a count of compares: vectorizes, see exceptional)."""
    lim = I8_QK_MAX_ERR / qerr if qerr > np.float32(0.0) else np.float32(np.inf)
    bad = 0
    for c in range(np.uint64(n)):
        bad += 0 if abs(tsk[c]) <= lim else 1
    return bad == 0
