"""One epilogue for every backend: output dtype, output layout, lse shape (SPEC 2, 13).

It also owns what the epilogue's outputs look like *before* anything runs (`expected_outputs`), the check
of caller-allocated outputs against that (the ``.out`` variants and aclnn phase 1), and the write into
them -- one place, so the functional results and the caller-tensor checks cannot drift apart.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .backends.base import BackendResult
from .errors import ACLNN_ERR_PARAM_NULLPTR, input_error
from .problem.layout import from_canonical
from .problem.attention import AttentionProblem
from .problem.outputs import expected_outputs, final_lse, final_outputs


def finalize(p: AttentionProblem, r: BackendResult):
    if p.out_quant is not None:     # SPEC 12: never-computed rows quantize their 0 like every other value
        return from_canonical(p.out_quant.apply(r.out, p.packed, p.out_dtype), p.layout.out), final_lse(p, r.lse)
    return final_outputs(p, r.out, r.lse)


# ---------------------------------------------------------------------------------- caller-allocated outputs
def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def check_output(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device, why: str = "") -> None:
    """`t` must be a tensor of exactly `shape`, `dtype` on `device`; the error names `name` (161001 if None)."""
    exp = f"a {_dt(dtype)} tensor of shape {tuple(shape)}{why}"
    if t is None:
        raise input_error(name, exp, "None", status=ACLNN_ERR_PARAM_NULLPTR)
    if not isinstance(t, torch.Tensor):
        raise input_error(name, exp, type(t).__name__)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise input_error(name, exp, f"a {_dt(t.dtype)} tensor of shape {tuple(t.shape)}")
    if t.device != device:
        raise input_error(name, f"a tensor on {device} (the query's device)", f"a tensor on {t.device}")


def check_outputs(p: AttentionProblem, attention_out, softmax_lse, names: Tuple[str, str], lse_why: str) -> None:
    """Validate the caller's outputs before anything runs. softmax_lse is checked only when the lse is
    requested: otherwise it is a placeholder that is never written (DECISIONS 17)."""
    shape, dtype, lse_shape = expected_outputs(p)
    check_output(names[0], attention_out, shape, dtype, p.device)
    if p.want_lse:
        check_output(names[1], softmax_lse, lse_shape, torch.float32, p.device, lse_why)


def write_outputs(p: AttentionProblem, r: BackendResult, attention_out: torch.Tensor, softmax_lse) -> None:
    """Run the epilogue and copy into the (already checked) caller tensors; the lse only when requested."""
    out, lse = finalize(p, r)
    with torch.no_grad():         # inference op: writing a caller buffer must not record autograd history
        attention_out.copy_(out)
        if p.want_lse:
            softmax_lse.copy_(lse)
