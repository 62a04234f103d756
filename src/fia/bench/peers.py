"""torch.nn.functional.scaled_dot_product_attention given the problem a case poses.

The peer is the torch-only way to get the same result, and everything it needs is inside the timed call:
* GQA: `enable_gqa=True` (K/V keep KV_N heads).
* paged KV: SDPA has no block table, so the used blocks are gathered into a dense [B, KV_N, S_kv, D] first.
* int8 KV: dequantized to the query dtype first, `x = x_q · scale` (per channel or per token).
* causal (sparse_mode 2, Q_S == KV_S): `is_causal=True`.
* band (sparse_mode 4): a bool mask [S_q, S_kv] (SDPA's convention: True = takes part), built once.
* pse_shift: passed as the float additive `attn_mask` [1, N, S_q, S_kv] (S = scale·QKᵀ + pse in both).
* pse_shift with the causal mask: the equivalent float mask, pse with -inf above the diagonal (built once).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..problem.quant import dequant_fp4
from .cases import Inputs, from_nz


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor, S_kv: int) -> torch.Tensor:
    """pool [blocks, KV_N, bs, D], block_table int32 [B, nb] -> dense [B, KV_N, S_kv, D]."""
    B, nb = block_table.shape
    _, KV_N, bs, D = pool.shape
    g = pool[block_table.long()]                                   # [B, nb, KV_N, bs, D]
    return g.permute(0, 2, 1, 3, 4).reshape(B, KV_N, nb * bs, D)[:, :, :S_kv]


def dequant(xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [B, KV_N, S, D] with scale [1, KV_N, 1, D] (per channel) or [1, B, S] (per token) -> dtype."""
    if scale.dim() == 3:                                           # per token: [1, B, S] -> [B, 1, S, 1]
        scale = scale[0][:, None, :, None]
    return (xq.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def band_keep(S_q: int, S_kv: int, pre: int, nxt: int) -> torch.Tensor:
    """SDPA bool mask [S_q, S_kv], True = attend, of sparse_mode 4 (band on the bottom-right diagonal)."""
    pre, nxt = pre - S_kv + S_q, nxt + S_kv - S_q
    i = torch.arange(S_q)[:, None]
    j = torch.arange(S_kv)[None]
    return (j <= i + nxt) & (j >= i - pre)


def sdpa_call(inp: Inputs, compute_dtype: torch.dtype | None = None) -> Callable[[], torch.Tensor]:
    """A no-argument callable returning SDPA's output [B, N, S_q, D] for the case's problem.

    compute_dtype (e.g. float32) makes a golden variant: every input is cast to it inside the call.
    """
    c = inp.case
    dt = compute_dtype or c.torch_dtype
    q = inp.q if compute_dtype is None else inp.q.to(dt)           # [B, N, S_q, D]
    mask, causal = None, False
    if c.mask == "causal":
        causal = True
    elif c.mask == "band":
        mask = band_keep(c.S_q, c.S_kv, c.pre, c.next)             # [S_q, S_kv] bool
    elif c.mask == "pse":
        mask = inp.pse if compute_dtype is None else inp.pse.to(dt)  # [1, N, S_q, S_kv]
    elif c.mask == "psecausal":
        above = torch.ones(c.S_q, c.S_kv, dtype=torch.bool).triu_(1)  # [S_q, S_kv] j > i
        mask = inp.pse.to(dt).masked_fill(above, float("-inf"))     # [1, N, S_q, S_kv]

    def kv():
        if c.storage == "paged":
            k = gather_paged(inp.key, inp.block_table, c.S_kv)
            v = gather_paged(inp.value, inp.block_table, c.S_kv)
        elif c.storage in ("int8-paged", "int8-nz"):                # gathered (NZ: as rows), then dequantized
            pool = from_nz if c.storage == "int8-nz" else (lambda t: t)
            return (dequant(gather_paged(pool(inp.key), inp.block_table, c.S_kv), inp.k_scale, dt),
                    dequant(gather_paged(pool(inp.value), inp.block_table, c.S_kv), inp.v_scale, dt))
        elif c.storage.startswith("int8"):
            return dequant(inp.key, inp.k_scale, dt), dequant(inp.value, inp.v_scale, dt)
        elif c.storage == "fp4":                                    # FP4 x E8M0 group scales dequantized first
            return (dequant_fp4(inp.key, inp.k_scale[0], torch.float32).to(dt),
                    dequant_fp4(inp.value, inp.v_scale[0], torch.float32).to(dt))
        else:
            k, v = inp.key, inp.value                              # [B, KV_N, S_kv, D]
        return k.to(dt), v.to(dt)

    def run() -> torch.Tensor:
        k, v = kv()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=inp.scale,
                                              enable_gqa=True)
    return run
