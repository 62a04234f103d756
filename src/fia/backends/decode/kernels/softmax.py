"""Softmax stage of a decode item: the online softmax over one chunk of scores (softmax_chunk: running max,
weights, the bf16 / int16 probabilities the dot-product PV kernels read), the two-level sums that keep float32
accumulation error at ~sqrt(chunks) terms (drain_chunk, drain_block), and the per-row int16 quantization of the
VNNI kernels' float operand (quant_i16).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ....cpu.numerics import FM, f32_to_bf16_bits, fexp
from ....cpu.simd import exp_rows, max_f32
from ....cpu import kernel_cache

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


@njit(fastmath=FM, cache=True)
def quant_i16(x, R, n, dst, sc):
    """dst[r, :n] = x[r, :n] / sc[r] rounded to int16, sc[r] = max |x[r, :n]| / 32767: the integer operand
    of the cpu/vnni.py kernels (one scale per row; error: half a step, 1.53e-5 of the row's largest
    magnitude). Returns False, leaving nothing usable, when x holds a NaN or an infinity: the caller then
    runs the float32 kernels, which propagate them (SPEC 14). Rows of tiny values (max < 1e-30, e.g.
    subnormal probabilities) are scaled in float64, where the reciprocal does not overflow (their float32
    scale itself is subnormal below ~4e-34 and 0 below ~2e-41: negligible beside a softmax sum >= 1 or
    scores of order 1)."""
    n_ = np.uint64(n)
    for r in range(R):
        t = np.float32(0.0)
        for c in range(n_):
            t += x[r, c] * np.float32(0.0)                 # NaN for any NaN or infinity
        if t != np.float32(0.0):
            return False
        mx = max_f32(x.ctypes.data + r * x.strides[0], n, np.float32(0.0), 1)
        sc[r] = np.float32(np.float64(mx) / 32767.0)
        if mx >= np.float32(1e-30):
            inv = np.float32(32767.0) / mx
            for c in range(n_):
                dst[r, c] = np.int16(np.rint(x[r, c] * inv))
        else:                                               # float64: 32767 / mx would overflow float32
            inv64 = 32767.0 / np.float64(mx) if mx > 0 else 0.0
            for c in range(n_):
                dst[r, c] = np.int16(np.rint(np.float64(x[r, c]) * inv64))
    return True


@njit(fastmath=FM, cache=True, inline="always")
def drain_chunk(cacc, hh, tacc, R, Dv):
    """cacc[hh, :R, :Dv] += tacc[:R, :Dv], then tacc = 0: a chunk's PV sums into its block of chunks (the item's
    two-level sums, see _items). Inlined and indexed: a call (or a row view) reference-counts its arrays, atomics
    that cost ~1 % per chunk helper (int8, one thread)."""
    for r in range(R):
        for d in range(np.uint64(Dv)):
            cacc[hh, r, d] += tacc[r, d]
            tacc[r, d] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def drain_block(acc, ll, vx, cacc, cll, cvx, hh, R, Dv):
    """The block of chunks' sums (cacc / cll / cvx[hh]) into the item's partial (acc, ll, vx), then zeroed."""
    for r in range(R):
        for d in range(np.uint64(Dv)):
            acc[r, d] += cacc[hh, r, d]
            cacc[hh, r, d] = 0.0
        ll[r] += cll[hh, r]
        cll[hh, r] = 0.0
        vx[r] += cvx[hh, r]
        cvx[hh, r] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def softmax_chunk(s, R, n, m, ll, vx, acc, Dv, p2, mode, wsc, kshift, cll, cvx, cacc, hh):
    """Online softmax of the chunk's scores s[:R, :n] (replaced by exp(s - running max)); the running max
    m, sum ll, the value extras vx and the accumulators acc [R, Dv] are rescaled, and so are the sums of the current
    block of chunks cll / cvx / cacc[hh] (see _items); the chunk's sum of weights is added to cll. The "max" is the
    scores' maximum plus kshift = ln 2^k, 2^k >= the item's keys: every weight is <= 2^-k, so the item's sums (of
    weights, acc) stay below 1 x max |V|, and a V of 3e38 does not overflow before merge normalizes. mode 1: also
    write the probabilities as bf16 bits to p2 (rounded to nearest even: what the hardware's cube unit multiplies,
    docs/DECISIONS.md 23); mode 2: also as int16 to p2 with the row scales wsc (quant_i16 fused into the
    pass: the row's largest probability is exp(chunk max - running max)). Returns False when mode 2 left
    p2 unusable (a NaN or infinite probability sum, or a chunk maximum below 1e-30 of the running one): the
    caller then runs quant_i16 (its float64 path, or the float32 kernels). Unsigned indices: signed ones
    stop LLVM from vectorizing the loops."""
    n_ = np.uint64(n)
    n16 = n_ & ~np.uint64(15)
    ok = True
    p2i = p2.view(np.int16)
    for r in range(R):
        mo = m[r]
        cm = max_f32(s.ctypes.data + r * s.strides[0], n, np.float32(-np.inf), 0)   # NaN scores: see max_f32
        cmk = cm + kshift
        mx = cmk if cmk > mo else mo
        alpha = fexp(mo - mx)
        # what the pass writes to p2 (pm) -- mode 2 without a usable row scale writes nothing (ok = False) --
        # then the whole 16-score blocks in cpu.simd.exp_rows (16 lanes), the tail here
        pm = mode
        inv = np.float32(0.0)
        if mode == 2:
            wmax = fexp(cm - mx)
            if wmax >= np.float32(1e-30):
                inv = np.float32(32767.0) / wmax
                wsc[r] = wmax / np.float32(32767.0)
            else:
                ok = False
                pm = 0
        ls = exp_rows(s.ctypes.data + r * s.strides[0], n, mx, p2.ctypes.data + r * p2.strides[0], pm, inv)
        for c in range(n16, n_):
            e = fexp(s[r, c] - mx)
            s[r, c] = e
            if pm == 1:
                p2[r, c] = f32_to_bf16_bits(e)
            elif pm == 2:
                p2i[r, c] = np.int16(min(np.rint(e * inv), np.float32(32767.0)))
            ls += e
        if mode == 2 and not (ls < np.float32(np.inf)):          # NaN or infinite: not quantized
            ok = False
        m[r] = mx
        if alpha != np.float32(1.0):
            ll[r] *= alpha
            cll[hh, r] *= alpha
            vx[r] *= alpha
            cvx[hh, r] *= alpha
            for d in range(np.uint64(Dv)):
                acc[r, d] *= alpha
                cacc[hh, r, d] *= alpha
        cll[hh, r] += ls
    return ok
