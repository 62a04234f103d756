"""The int8 KV cache's append on tensors (integrations/transformers' FiaCache): the checks, the kernel set and the
launch of cpu/kv_append_kernels.py's one compiled pass (its module doc: what it computes and why)."""
from __future__ import annotations

import torch

from . import jit
from .kv_append_kernels import KIND_BF16, KIND_F16, KIND_F32, append_int8

KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16, torch.float16: KIND_F16}
SET = "kv-int8"
jit.register(jit.KernelSet(SET, "fia.cpu.kv_append_kernels", ("append_int8",), "fia.kernel_warmup:run_kv_int8"))


def _takes(states: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, B: int, H: int, T: int, C: int) -> bool:
    """Whether append_int8 may write the states [B, H, T, D] into codes [B, H, C, D] / scales [B, H, C]."""
    return (states.device.type == "cpu" and codes.device.type == "cpu" and scales.device.type == "cpu"
            and states.layout == torch.strided and states.numel() > 0
            and codes.dim() == 4 and codes.shape[:3] == (B, H, C) and states.shape == (B, H, T, codes.shape[3])
            and scales.shape == (B, H, C) and codes.dtype == torch.int8 and scales.dtype == torch.float32
            and codes.is_contiguous() and scales.is_contiguous())


def append(key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           key_scales: torch.Tensor, value_scales: torch.Tensor, n: int) -> bool:
    """append_int8 on tensors: states [B, H, T, D] / [B, H, T, Dv] (float32, bf16 or fp16, any strides) into the
    codes [B, H, C, D] / [B, H, C, Dv] and scales [B, H, C] at positions [n, n + T). False, with nothing written,
    where the kernel is not compiled yet (its background build is requested) or the tensors are not what it
    takes (CPU, strided and not empty, those dtypes and shapes, contiguous buffers, positions inside them): the
    caller's torch ops run."""
    if key_states.dtype not in KINDS or value_states.dtype != key_states.dtype or key_states.dim() != 4 \
            or keys.dim() != 4:
        return False
    (B, H, C), T = keys.shape[:3], key_states.shape[2]
    if not (0 <= n and n + T <= C and _takes(key_states, keys, key_scales, B, H, T, C)
            and _takes(value_states, values, value_scales, B, H, T, C)):
        return False
    if not jit.ready((SET,)):
        jit.request((SET,))
        return False
    launch(key_states, value_states, keys, values, key_scales, value_scales, n)
    return True


def launch(key_states, value_states, keys, values, key_scales, value_scales, n: int) -> None:
    """append_int8 on tensors append() has checked (or the warm-up's), compiling it where it is not yet."""
    B, H, T, _ = key_states.shape
    append_int8(key_states.data_ptr(), value_states.data_ptr(), KINDS[key_states.dtype], *key_states.stride(),
                *value_states.stride(), B, H, T, keys.shape[3], values.shape[3], keys.data_ptr(), values.data_ptr(),
                key_scales.data_ptr(), value_scales.data_ptr(), keys.shape[2], n)
