"""One epilogue for every backend: output dtype, output layout, lse shape (SPEC 2, 13)."""
from __future__ import annotations

import torch

from .backends.base import BackendResult
from .spec.layout import from_canonical
from .spec.problem import AttentionProblem


def finalize(p: AttentionProblem, r: BackendResult):
    if p.out_quant is not None:     # SPEC 12: never-computed rows quantize their 0 like every other value
        out = from_canonical(p.out_quant.apply(r.out, p.packed), p.layout.out)
    else:
        out = from_canonical(r.out.to(p.out_dtype), p.layout.out)
    if not p.want_lse or r.lse is None:
        lse = torch.empty(0, dtype=torch.float32, device=p.device)
    elif p.packed:
        lse = r.lse.to(torch.float32).permute(1, 0).unsqueeze(-1).contiguous()     # [T, N, 1]
    else:
        lse = r.lse.to(torch.float32).unsqueeze(-1)                                 # [B, N, Q_S, 1]
    return out, lse
