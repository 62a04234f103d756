"""New key / value states appended to an int8 KV cache in one compiled pass (the int8 FiaCache's update,
integrations/transformers/cache.py `quantize_int8`): each token and head quantized symmetrically -- scale =
max |x| / 127 (1 where that is not positive: an all-zero row, or a NaN in it), codes = x / scale rounded half to
even, clamped to [-127, 127], a NaN code 0 -- written at positions [n, n + T) of the codes and scales buffers.

Why: the same quantization in torch ops is ~14 operations a layer and step, ~90 us inside a model against ~13 us
for a bf16 cache's two slice writes. Every step is the torch one's in float32 (the maximum, the division, round
half to even; no fast-math), so both give the same codes and scales (tests/cpu/test_kv_append.py checks the
definition, tests/clients/test_integration_transformers_cache.py the torch ops). The tensors go in by address and element strides (a NumPy view of each cost several us in a
model): ints only, one specialization for every dtype and layout.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit

from . import jit
from .numerics import addr_ptr, bf16_to_f32, fp16_to_f32

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


KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16, torch.float16: KIND_F16}
SET = "kv-int8"
jit.register(jit.KernelSet(SET, "fia.cpu.kv_append", ("append_int8",), "fia.kernel_warmup:run_kv_int8"))


def _takes(states: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, B: int, H: int, T: int, C: int) -> bool:
    """Whether append_int8 may write the states [B, H, T, D] into codes [B, H, C, D] / scales [B, H, C]."""
    return (states.device.type == "cpu" and codes.device.type == "cpu" and scales.device.type == "cpu"
            and codes.dim() == 4 and codes.shape[:3] == (B, H, C) and states.shape == (B, H, T, codes.shape[3])
            and scales.shape == (B, H, C) and codes.dtype == torch.int8 and scales.dtype == torch.float32
            and codes.is_contiguous() and scales.is_contiguous())


def append(key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           key_scales: torch.Tensor, value_scales: torch.Tensor, n: int) -> bool:
    """append_int8 on tensors: states [B, H, T, D] / [B, H, T, Dv] (float32, bf16 or fp16, any strides) into the
    codes [B, H, C, D] / [B, H, C, Dv] and scales [B, H, C] at positions [n, n + T). False, with nothing written,
    where the kernel is not compiled yet (its background build is requested) or the tensors are not what it
    takes (CPU, those dtypes and shapes, contiguous buffers, positions inside them): the caller's torch ops run."""
    kind = KINDS.get(key_states.dtype)
    if kind is None or value_states.dtype != key_states.dtype or key_states.dim() != 4 or keys.dim() != 4:
        return False
    (B, H, C), T = keys.shape[:3], key_states.shape[2]
    if not (0 <= n and n + T <= C and _takes(key_states, keys, key_scales, B, H, T, C)
            and _takes(value_states, values, value_scales, B, H, T, C)):
        return False
    if not jit.ready((SET,)):
        jit.request((SET,))
        return False
    append_int8(key_states.data_ptr(), value_states.data_ptr(), kind, *key_states.stride(), *value_states.stride(),
                B, H, T, keys.shape[3], values.shape[3], keys.data_ptr(), values.data_ptr(), key_scales.data_ptr(),
                value_scales.data_ptr(), C, n)
    return True
