"""The shapes and dtype of a problem's user-visible outputs (pure shape logic: finalize produces them, a backend
that writes its output in the final layout -- decode's replay -- allocates them)."""
from __future__ import annotations

from typing import Tuple

import torch

from .attention import AttentionProblem
from .layout import output_shape


def expected_outputs(p: AttentionProblem) -> Tuple[tuple, torch.dtype, tuple]:
    """(attention_out shape, attention_out dtype, lse shape) exactly as `finalize` produces them."""
    out = output_shape(p.layout.out, p.B, p.N, p.Q_S, p.Dv, p.T)
    lse = (p.T, p.N, 1) if p.packed else (p.B, p.N, p.Q_S, 1)
    return tuple(out), p.out_dtype, lse
