"""atten_mask, sparse_mode, pre/next tokens and pse_shift (SPEC 3, 5, 6)."""
from __future__ import annotations

from typing import Optional

import torch

from ..problem.attention import PRE_NEXT_CLAMP, MaskSpec
from .context import Ctx

MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
TEMPLATE = 2048
_UNSUPPORTED_MODES = {5: "prefix", 6: "global", 7: "dilated", 8: "block_local"}


def sparse_mode(ctx: Ctx, mode) -> int:
    mode = ctx.integer("sparse_mode", mode)
    if mode in _UNSUPPORTED_MODES:
        raise ctx.err("sparse_mode", "0, 1, 2, 3 or 4", mode, f"mode {mode} ({_UNSUPPORTED_MODES[mode]}) is not "
                      "supported by the operator")
    if mode not in (0, 1, 2, 3, 4):
        raise ctx.err("sparse_mode", "0, 1, 2, 3 or 4", mode)
    return mode


def _mask_dtype(ctx: Ctx, m: torch.Tensor, row_fix: bool) -> None:
    if m.dtype == torch.float16:
        # legacy float16 masks: accepted, but not with row-invalid correction (SPEC 6)
        if row_fix:
            raise ctx.err("atten_mask", "dtype bool, int8 or uint8 with inner_precise 2/3 (row-invalid "
                          "correction)", "dtype float16")
        return
    if m.dtype not in MASK_DTYPES:
        raise ctx.err("atten_mask", "dtype bool, int8 or uint8", f"dtype {str(m.dtype).replace('torch.', '')}")


def is_template(m: torch.Tensor) -> bool:
    return tuple(m.shape) in ((TEMPLATE, TEMPLATE), (1, TEMPLATE, TEMPLATE), (1, 1, TEMPLATE, TEMPLATE))


def _template(ctx: Ctx, m: Optional[torch.Tensor], mode: int) -> None:
    if m is None:
        raise ctx.err("atten_mask", f"the 2048x2048 lower-triangular template for sparse_mode {mode}", "None")
    if not is_template(m):
        raise ctx.err("atten_mask", f"shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) for "
                      f"sparse_mode {mode}", m)


def user_mask(ctx: Ctx, m: torch.Tensor, *, decode: bool, b: int, q_s: int, kv_s: int) -> torch.Tensor:
    """Validate a user mask's shape; return it as a [Bm, Qm, Km] view (Bm in {1, B}), nothing copied."""
    shape = tuple(m.shape)
    need = f"Q_S >= {q_s} rows and KV_S >= {kv_s} columns"
    if decode:
        exp = f"(B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B = {b} and KV_S >= {kv_s}"
    else:
        exp = (f"(Q_S, KV_S), (1 or B, Q_S, KV_S) or (1 or B, 1, Q_S, KV_S) with B = {b}, " + need)
    if m.dim() == 2:                    # decode: (B, KV_S) -> (B, 1, KV_S); prefill: (Q_S, KV_S) -> (1, Q_S, KV_S)
        v = m.unsqueeze(1 if decode else 0)
    elif m.dim() == 3:
        v = m
    elif m.dim() == 4 and shape[1] == 1:
        v = m[:, 0]
    else:
        raise ctx.err("atten_mask", exp, m)
    if v.shape[0] not in (1, b) or v.shape[1] < max(q_s, 1 if decode else 0) or v.shape[2] < kv_s:
        raise ctx.err("atten_mask", exp, m, "a mask may be larger than needed (top-left used), never smaller")
    return v


def pre_next(ctx: Ctx, pre, nxt):
    pre = ctx.integer("pre_tokens", pre)
    nxt = ctx.integer("next_tokens", nxt)
    return min(pre, PRE_NEXT_CLAMP), min(nxt, PRE_NEXT_CLAMP)


def check_band(ctx: Ctx, mode: int, pre: int, nxt: int, q_s: int, kv_s: int) -> None:
    """pre/next rules for an active band (sparse 0 with mask, sparse 4)."""
    if pre < 0 and nxt < 0:
        raise ctx.err("pre_tokens", "pre_tokens and next_tokens not both negative", f"pre_tokens = {pre}, "
                      f"next_tokens = {nxt}")
    if pre + nxt < 0:
        raise ctx.err("next_tokens", "-next_tokens <= pre_tokens (otherwise the band is empty)",
                      f"pre_tokens = {pre}, next_tokens = {nxt}")
    if mode == 0:
        if nxt < 0 and -nxt >= q_s:
            raise ctx.err("next_tokens", f"|next_tokens| < Q_S = {q_s} when negative", nxt)
        if pre < 0 and -pre >= kv_s:
            raise ctx.err("pre_tokens", f"|pre_tokens| < KV_S = {kv_s} when negative", pre)


def build_mask(ctx: Ctx, m, mode: int, pre: int, nxt: int, *, ignore_sparse: bool, decode_shapes: bool,
               packed: bool, left_padded: bool, row_fix: bool, b: int, q_s: int, kv_s: int) -> MaskSpec:
    """The effective mask spec.

    ignore_sparse: decode without rope (sparse_mode and pre/next are ignored, SPEC 5).
    decode_shapes: Q_S = 1, so the mask takes the decode shapes (B, KV_S), (B, 1, KV_S), (B, 1, 1, KV_S).
    q_s / kv_s: the extents the mask must cover (Q_S, and KV_S incl. prefix or paged positions).
    """
    if m is not None:
        m = ctx.tensor("atten_mask", m)
        _mask_dtype(ctx, m, row_fix)
    if ignore_sparse:
        # SPEC 5: for Q_S = 1 without rope, sparse_mode and pre/next are ignored; only a plain mask applies.
        # SPEC 15.11: with sparse 2-4 the template is checked for shape and otherwise ignored.
        if mode in (2, 3, 4):
            if m is not None:
                _template(ctx, m, mode)
            return MaskSpec("none", mode)
        if m is None:
            return MaskSpec("none", mode)
        return MaskSpec("user", mode, user_mask=user_mask(ctx, m, decode=True, b=b, q_s=1, kv_s=kv_s))
    decode = decode_shapes
    if packed and ctx.strict and not (mode == 0 and m is None) and mode not in (3, 4):
        raise ctx.hw("sparse_mode", "for TND layouts: 0 without atten_mask, or 3/4 with the template",
                     f"sparse_mode {mode}" + (" with a mask" if m is not None else ""))
    if mode == 0:
        if m is None:
            return MaskSpec("none", 0)
        um = user_mask(ctx, m, decode=decode, b=b, q_s=q_s, kv_s=kv_s)
        if left_padded or (pre >= q_s + kv_s and nxt >= q_s + kv_s):
            return MaskSpec("user", 0, pre, nxt, um)   # the band covers everything: the mask alone
        check_band(ctx, 0, pre, nxt, q_s, kv_s)
        return MaskSpec("band", 0, pre, nxt, um)
    if mode == 1:
        if m is None:
            raise ctx.err("atten_mask", "a full (Q_S, KV_S) mask for sparse_mode 1 (allMask)", "None")
        return MaskSpec("user", 1, user_mask=user_mask(ctx, m, decode=decode, b=b, q_s=q_s, kv_s=kv_s))
    _template(ctx, m, mode)
    if mode == 4:
        check_band(ctx, 4, pre, nxt, q_s, kv_s)
        return MaskSpec("band", 4, pre, nxt)
    return MaskSpec("band", mode)


def pse_shift(ctx: Ctx, p, *, q_dtype: torch.dtype, decode: bool, packed: bool, b: int, n: int, d: int,
              q_s: int, kv_s: int) -> Optional[torch.Tensor]:
    """Validate pse_shift; return it as [Bp, N, Qp, Kp] (a view)."""
    p = ctx.tensor("pse_shift", p)
    if p is None:
        return None
    want = torch.float16 if q_dtype == torch.int8 else q_dtype
    if p.dtype != want:
        raise ctx.err("pse_shift", f"dtype {str(want).replace('torch.', '')} (follows the query)",
                      f"dtype {str(p.dtype).replace('torch.', '')}")
    if packed and ctx.strict:
        raise ctx.hw("pse_shift", "None for TND layouts", p)
    if decode and d % 16 and ctx.strict:
        raise ctx.hw("pse_shift", "D % 16 == 0 for decode (Q_S = 1) with pse_shift", f"D = {d}")
    lead = "1" if b == 1 else f"{b} or 1"           # (never "1 or 1")
    exp = f"(B or 1, Q_N, >= Q_S, >= KV_S) = ({lead}, {n}, >= {q_s}, >= {kv_s})"
    if p.dim() != 4 or p.shape[0] not in (1, b) or p.shape[1] != n or p.shape[2] < q_s or p.shape[3] < kv_s:
        raise ctx.err("pse_shift", exp, p)
    return p


def inner_precise(ctx: Ctx, v, decode: bool) -> int:
    v = ctx.integer("inner_precise", v)
    allowed = (0, 1) if decode else (0, 1, 2, 3)
    if v not in allowed:
        raise ctx.err("inner_precise", " or ".join(map(str, allowed)) + (" for decode (Q_S = 1)" if decode else ""),
                      v)
    return v


def learnable_sink(ctx: Ctx, t, q_dtype: torch.dtype, n: int) -> Optional[torch.Tensor]:
    """learnable_sink: one float per query head, (Q_N,), float32 or the query dtype (SPEC 1.1b)."""
    t = ctx.tensor("learnable_sink", t)
    if t is None:
        return None
    if t.dtype not in (torch.float32, q_dtype) or not t.is_floating_point():
        raise ctx.err("learnable_sink", f"dtype float32 or {str(q_dtype).replace('torch.', '')}",
                      f"dtype {str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != (n,):
        raise ctx.err("learnable_sink", f"shape (Q_N,) = ({n},)", t)
    return t
