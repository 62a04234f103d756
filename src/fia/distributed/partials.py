"""Partial results of one rank's keys, as rows: layout <-> canonical views, the empty partial, and their merge
through npu_attention_update (fia's LSE merge, SPEC 1.1b), so a distributed result is exactly what that op gives.

Canonical forms follow the lse FIA returns: batched layouts [B, N, S, Dv] with lse [B, N, S]; token layouts
[T, N, Dv] with lse [T, N]. A partial that saw no key has lse +inf (FIA's marker) and contributes nothing.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import api

TOKEN_LAYOUTS = ("TND", "NTD")
OUT_LAYOUTS = ("BSH", "BSND", "BNSD", "NBSD", "TND", "NTD")


def out_layout(input_layout: str) -> str:
    """The output layout an input_layout names (the part after the underscore, if any)."""
    return input_layout.rpartition("_")[2]


def to_canonical(out: torch.Tensor, layout: str, num_heads: int) -> torch.Tensor:
    """attention_out in `layout` (an output layout) -> [B, N, S, Dv] or [T, N, Dv] (a view where possible)."""
    if layout == "BSH":
        b, s, h = out.shape
        return out.view(b, s, num_heads, h // num_heads).transpose(1, 2)
    if layout == "BSND":
        return out.transpose(1, 2)
    if layout == "NBSD":
        return out.permute(1, 0, 2, 3)
    if layout == "NTD":
        return out.transpose(0, 1)
    return out                                                         # BNSD, TND


def from_canonical(c: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, Dv] or [T, N, Dv] -> a contiguous attention_out in `layout`."""
    if layout == "BSH":
        b, n, s, d = c.shape
        return c.transpose(1, 2).reshape(b, s, n * d)
    if layout == "BSND":
        return c.transpose(1, 2).contiguous()
    if layout == "NBSD":
        return c.permute(1, 0, 2, 3).contiguous()
    if layout == "NTD":
        return c.transpose(0, 1).contiguous()
    return c.contiguous()


def empty_like_partial(out: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A partial that saw no key: output 0, lse +inf (what FIA returns for such rows)."""
    return torch.zeros_like(out), torch.full_like(lse, float("inf"))


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Canonical partials (same shapes) -> (merged out in their dtype, merged lse float32), row by row through
    npu_attention_update."""
    shape, lshape = outs[0].shape, lses[0].shape
    flat_out: List[torch.Tensor] = [o.reshape(-1, shape[-1]) for o in outs]             # K x [R, Dv]
    flat_lse: List[torch.Tensor] = [lse.reshape(-1).to(torch.float32) for lse in lses]  # K x [R]
    out, lse = api.npu_attention_update(flat_lse, flat_out, 1)
    return out.view(shape), lse.view(lshape)
