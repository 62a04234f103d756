"""The kernel of cpu/kv_append.py: new key / value states appended to an int8 KV cache in one compiled pass (the
int8 FiaCache's update, integrations/transformers/cache.py `quantize_int8`): each token and head quantized
symmetrically -- scale = max |x| / 127 (1 where that is not positive: an all-zero row, or a NaN in it), codes =
x / scale rounded half to even, clamped to [-127, 127], a NaN code 0 -- written at positions [n, n + T) of the
codes and scales buffers.

Why: the same quantization in torch ops is ~14 operations a layer and step, ~90 us inside a model against ~13 us
for a bf16 cache's two slice writes. Every step is the torch one's in float32 (the maximum, the division, round
half to even; no fast-math), so both give the same codes and scales (tests/cpu/test_kv_append.py checks the
definition, tests/clients/test_integration_transformers_cache.py the torch ops). The tensors go in by address and
element strides (a NumPy view of each cost several us in a model): ints only, one specialization for every dtype
and layout.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from . import kernel_cache
from .numerics import addr_ptr, bf16_to_f32, fp16_to_f32

kernel_cache.install("cpu/kv_append_kernels.py", ("cpu/numerics.py", "cpu/fma.py", "cpu/simd.py"))   # (conversions)

KIND_F32, KIND_BF16, KIND_F16 = 0, 1, 2      # the states' dtype (`kind`)
_127 = np.float32(127.0)
_ONE = np.float32(1.0)


@njit(cache=True, inline="always")
def _load_row(addr, kind, span, off, sd, D, row):
    """row[:D] = the float32 values of the states' elements off + d * sd (d < D) at addr (span elements)."""
    if kind == KIND_F32:
        s32 = carray(addr_ptr(addr), (span,), np.float32)
        for d in range(D):
            row[d] = s32[off + d * sd]
    else:
        s16 = carray(addr_ptr(addr), (span,), np.uint16)
        if kind == KIND_BF16:
            for d in range(D):
                row[d] = bf16_to_f32(s16[off + d * sd])
        else:
            for d in range(D):
                row[d] = fp16_to_f32(s16[off + d * sd])


@njit(cache=True, inline="always")
def _quantize_row(row, D, codes, c0):
    """codes[c0:c0 + D] = row's int8 codes; returns its scale (see the module doc)."""
    m = np.float32(0.0)
    nan = False
    for d in range(D):
        a = abs(row[d])
        if a > m:
            m = a
        elif a != a:
            nan = True
    scale = m / _127
    if nan or not scale > 0:
        scale = _ONE
    for d in range(D):
        q = row[d] / scale
        if q != q:
            codes[c0 + d] = 0
        else:
            r = np.rint(q)
            codes[c0 + d] = np.int8(max(min(r, _127), -_127))
    return scale


@njit(cache=True, inline="always")
def _append(addr, kind, sb, sh, st, sd, B, H, T, D, codes_addr, scales_addr, C, n, row):
    span = 1 + (B - 1) * sb + (H - 1) * sh + (T - 1) * st + (D - 1) * sd
    codes = carray(addr_ptr(codes_addr), (B * H * C * D,), np.int8)        # [B, H, C, D]
    scales = carray(addr_ptr(scales_addr), (B * H * C,), np.float32)        # [B, H, C]
    for b in range(B):
        for h in range(H):
            for t in range(T):
                _load_row(addr, kind, span, b * sb + h * sh + t * st, sd, D, row)
                pos = (b * H + h) * C + n + t
                scales[pos] = _quantize_row(row, D, codes, pos * D)


@njit(cache=True, nogil=True)
def append_int8(k_addr, v_addr, kind, ksb, ksh, kst, ksd, vsb, vsh, vst, vsd, B, H, T, D, Dv, kc_addr, vc_addr,
                ks_addr, vs_addr, C, n):
    """Key states [B, H, T, D] at k_addr (element strides ksb, ksh, kst, ksd) and value states [B, H, T, Dv] at
    v_addr, of dtype `kind`, into the codes [B, H, C, D] / [B, H, C, Dv] (int8, contiguous) at kc_addr / vc_addr
    and scales [B, H, C] (float32, contiguous) at ks_addr / vs_addr, positions [n, n + T)."""
    row = np.empty(max(D, Dv), np.float32)
    _append(k_addr, kind, ksb, ksh, kst, ksd, B, H, T, D, kc_addr, ks_addr, C, n, row)
    _append(v_addr, kind, vsb, vsh, vst, vsd, B, H, T, Dv, vc_addr, vs_addr, C, n, row)
