"""A problem's user-visible outputs: their shapes and dtype (finalize produces them, a backend that writes its output
in the final layout -- decode's replay -- allocates them), and the epilogue of an unquantized output (finalize's,
and the prefill replay's)."""
from __future__ import annotations

from typing import Tuple

import torch

from .attention import AttentionProblem
from .layout import from_canonical, output_shape


def expected_outputs(p: AttentionProblem) -> Tuple[tuple, torch.dtype, tuple]:
    """(attention_out shape, attention_out dtype, lse shape) exactly as `finalize` produces them."""
    out = output_shape(p.layout.out, p.B, p.N, p.Q_S, p.Dv, p.T)
    lse = (p.T, p.N, 1) if p.packed else (p.B, p.N, p.Q_S, 1)
    return tuple(out), p.out_dtype, lse


def final_outputs(p: AttentionProblem, out: torch.Tensor, lse) -> tuple:
    """(attention_out, softmax_lse) of an unquantized canonical output [B, N, Q_S, Dv] / [N, T, Dv] and lse
    [B, N, Q_S] / [N, T] (None: not computed): the output dtype and layout, the lse float32 [B, N, Q_S, 1] /
    [T, N, 1] where it is wanted, else an empty float32 tensor (SPEC 2, 13)."""
    return from_canonical(out if out.dtype == p.out_dtype else out.to(p.out_dtype), p.layout.out), final_lse(p, lse)


def final_lse(p: AttentionProblem, lse) -> torch.Tensor:
    if not p.want_lse or lse is None:
        return torch.empty(0, dtype=torch.float32, device=p.device)
    if p.packed:
        return lse.to(torch.float32).permute(1, 0).unsqueeze(-1).contiguous()     # [T, N, 1]
    return lse.to(torch.float32).unsqueeze(-1)                                    # [B, N, Q_S, 1]
