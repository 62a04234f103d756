"""One-pass bias statistics for the pse tile bounds (pse.py), Numba, CPU only.

For every bias row (head n, query row r) of pse [N, R, S2], read as the integer bit patterns of its floats
(int16: bf16 / fp16 only; float32 biases use the torch formulation):
* tile maxima  pmk[n, r, t] = key of max_{j in tile t} pse[n, r, j];
* row maximum  pbk[n, r] (key) and its first position jstar[n, r];
* nan[n, r] = 1 when the row holds a NaN (the caller then keeps every tile of the row, like the torch
  formulation whose NaN comparisons are false).

The key of a float's bits b is b ^ ((b >> (bits - 1)) & MAG): sign-magnitude turned into two's-complement
order, an involution (key(key(b)) == b). Integer max reductions vectorize without fastmath, float ones
need `nnan` (which would break the NaN test). The caller turns keys back into floats.

Why: the torch formulation (per-tile amax of a bf16 view, then gathers) ran at ~2 GB/s and cost ~1.6 s
of the S=8192 pse case (4.3 GB of bias); docs/performance.md ("pse: the tile pass") has the numbers.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...cpu import kernel_cache

kernel_cache.install("backends/prefill/pse_kernels.py", ())                  # the cache locator (cpu/kernel_cache.py), as for every kernel module


@njit(nogil=True, cache=True)
def row_stats(a, sn, sr, R, S2, inf_bits, tile, rows0, rows1, pmk, pbk, jstar, nan):
    """Rows [rows0, rows1) of the flattened (n, r) index space of a bias [N, R, S2] whose element (n, r, j)
    is a[n * sn + r * sr + j] (a: the storage span as a 1-D contiguous int16 array of bf16 / fp16 bits).

    Unsigned indices (no wraparound selects) and int16 arithmetic written out (numba would widen to
    int64) let LLVM vectorize the row loops 16 lanes wide: 2.5 -> 14-17 GB/s on one core, measured."""
    nt = pmk.shape[2]
    mag = np.int16(0x7FFF)
    sh = np.int16(15)
    lowest = np.int16(-32768)
    inf16 = np.int16(inf_bits)
    for idx in range(rows0, rows1):
        n = idx // R
        r = idx - n * R
        o = np.uint64(n * sn + r * sr)
        best = lowest
        bt = 0
        bm = np.int16(0)                               # largest magnitude bits: > inf_bits means a NaN
        for t in range(nt):
            j0 = t * tile
            j1 = min(S2, j0 + tile)
            tm = lowest
            for j in range(np.uint64(j0), np.uint64(j1)):
                b = a[o + j]
                k = np.int16(b ^ np.int16(np.int16(b >> sh) & mag))
                tm = max(tm, k)
                bm = max(bm, np.int16(b & mag))
            pmk[n, r, t] = tm
            if tm > best:
                best = tm
                bt = t
        j0 = bt * tile
        j1 = min(S2, j0 + tile)
        jb = j0
        for j in range(j0, j1):
            b = a[o + np.uint64(j)]
            if np.int16(b ^ np.int16(np.int16(b >> sh) & mag)) == best:
                jb = j
                break
        pbk[n, r] = best
        jstar[n, r] = jb
        nan[n, r] = 1 if bm > inf16 else 0
