"""Merging partial attention results through their LSEs (npu_attention_update, SPEC 1.1b).

The same primitive serves split-KV decoding: out = Σ_k exp(lse_k − L) · out_k with L = logsumexp_k lse_k.
A partial whose lse is +inf (FIA's "no key" marker) or −inf contributes nothing; rows where every
partial is empty give 0 and lse +inf. A NaN lse is not a marker: it makes its row NaN (SPEC 14).
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple

import torch

from .errors import input_error

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def merge_partials(lse: torch.Tensor, out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """lse [K, R] float, out [K, R, D] float -> (out [R, D], lse [R]) in float32 (float64 stays float64)."""
    dt = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse = lse.to(dt)
    # +inf / -inf mark an empty partial; a NaN lse is NOT empty: it propagates into its rows (SPEC 14)
    valid = ~torch.isinf(lse)                                              # [K, R]
    l = torch.where(valid, lse, torch.full_like(lse, -float("inf")))
    m = l.amax(dim=0)                                                      # [R]
    any_valid = valid.any(dim=0)
    m_safe = torch.where(any_valid, m, torch.zeros_like(m))
    w = torch.where(valid, torch.exp(l - m_safe), torch.zeros_like(l))     # [K, R]
    tot = w.sum(dim=0)                                                     # [R]
    merged_lse = torch.where(any_valid, m_safe + torch.log(tot), torch.full_like(m, float("inf")))
    w = w / torch.where(any_valid, tot, torch.ones_like(tot))
    # zero weights must not turn NaN/inf garbage in empty partials into NaN
    o = torch.where(w.unsqueeze(-1) > 0, out.to(dt), torch.zeros((), dtype=dt, device=out.device))
    merged = (w.unsqueeze(-1) * o).sum(dim=0)                             # [R, D]
    return merged, merged_lse


def attention_update(lse: Sequence[torch.Tensor], local_out: Sequence[torch.Tensor],
                     update_type: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not isinstance(lse, (list, tuple)) or not lse:
        raise input_error("lse", "a non-empty list of float32 [R] tensors", type(lse).__name__)
    if not isinstance(local_out, (list, tuple)) or len(local_out) != len(lse):
        raise input_error("local_out", f"a list of {len(lse)} [R, D] tensors (one per lse)",
                          type(local_out).__name__ if not isinstance(local_out, (list, tuple))
                          else f"{len(local_out)} tensors")
    # an int (a tensor or list would make `in (0, 1)` compare elementwise)
    if isinstance(update_type, bool) or not isinstance(update_type, numbers.Integral) or update_type not in (0, 1):
        raise input_error("update_type", "0 (no lse output) or 1 (lse output)", repr(update_type))
    for i, (l, o) in enumerate(zip(lse, local_out)):
        if not isinstance(l, torch.Tensor) or l.dtype != torch.float32 or l.dim() != 1:
            raise input_error("lse", "float32 [R] tensors", f"element {i}: " + (
                f"dtype {l.dtype}, shape {tuple(l.shape)}" if isinstance(l, torch.Tensor) else type(l).__name__))
        if not isinstance(o, torch.Tensor) or o.dim() != 2 or o.shape[0] != l.shape[0]:
            raise input_error("local_out", f"[R, D] tensors with R = {l.shape[0]} like lse[{i}]",
                              f"element {i}: " + (f"shape {tuple(o.shape)}" if isinstance(o, torch.Tensor)
                                                  else type(o).__name__))
        # float outputs only: an integer / bool local_out would be merged and cast back silently (a complex
        # one would lose its imaginary part) -- the NPU operator takes float16 / bfloat16 / float32
        if o.dtype not in _OUT_DTYPES:
            raise input_error("local_out", "float16, bfloat16, float32 or float64 tensors",
                              f"element {i}: dtype {str(o.dtype).replace('torch.', '')}")
        # one device for every tensor (torch.stack would raise a RuntimeError; a meta tensor has no data)
        for name, t in (("lse", l), ("local_out", o)):
            if t.device != lse[0].device:
                raise input_error(name, f"tensors on {lse[0].device} (the device of lse[0])",
                                  f"element {i} on {t.device}")
        if o.shape != local_out[0].shape or o.dtype != local_out[0].dtype or l.shape != lse[0].shape:
            raise input_error("local_out", f"the same shape and dtype in every element ({tuple(local_out[0].shape)}, "
                              f"{local_out[0].dtype})", f"element {i}: {tuple(o.shape)}, {o.dtype}")
    out, l = merge_partials(torch.stack(list(lse)), torch.stack(list(local_out)))
    return out.to(local_out[0].dtype), (l.to(torch.float32) if update_type == 1 else None)
