"""Sequence features: left padding (SPEC 4), shared prefix (SPEC 7), MLA rope (SPEC 9)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..problem.layout import Layout, to_canonical
from ..problem.attention import SharedPrefix
from .context import Ctx, dtype_name
from .tensors import QueryDims, heads_and_dim

ROPE_D = 64


def padding_size(ctx: Ctx, name: str, x, b: int) -> Optional[Tuple[int, ...]]:
    """query_padding_size / kv_padding_size -> one left padding per batch (B entries), negative counting as 0:
    an integer tensor of one element (every batch) or of B elements (shape (B), per batch: FusedInferAttention-
    ScoreV4's table), or a Python int."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int64, torch.int32) or (x.numel() != 1 and (x.dim() != 1 or x.numel() != b)):
            exp = "a one-element int64 tensor" + ("" if b == 1 else f" or one of shape (B,) = ({b},)")
            raise ctx.err(name, exp, x)
        vals = [int(v) for v in ctx.host(name, x).reshape(-1).tolist()]
        if len(vals) == 1:
            vals = vals * b
    else:
        vals = [ctx.integer(name, x)] * b
    return tuple(max(v, 0) for v in vals)


def left_window(total: int, pad: int, act: int):
    """Valid window [total - pad - act, total - pad); None when it starts below 0 (batch output is zeros)."""
    lo = total - pad - act
    return None if lo < 0 else (lo, total - pad)


def shared_prefix(ctx: Ctx, layout: Layout, qd: QueryDims, key, kp, vp, plen_raw, kv_dtype,
                  pack: int = 1) -> Optional[SharedPrefix]:
    if kp is None and vp is None:
        if plen_raw is not None:
            raise ctx.err("actual_shared_prefix_len", "None without key_shared_prefix/value_shared_prefix",
                          plen_raw)
        return None
    if kp is None or vp is None:
        missing = "key_shared_prefix" if kp is None else "value_shared_prefix"
        raise ctx.err(missing, "a tensor (key_shared_prefix and value_shared_prefix come together)", "None")
    kp = ctx.tensor("key_shared_prefix", kp)
    vp = ctx.tensor("value_shared_prefix", vp)
    if layout.packed:
        raise ctx.err("key_shared_prefix", "None for TND layouts (no shared prefix with TND)", kp)
    for name, t in (("key_shared_prefix", kp), ("value_shared_prefix", vp)):
        if t.dim() != layout.rank or t.shape[0] != 1:
            raise ctx.err(name, f"a {layout.rank}-D tensor in layout {layout.inp} with batch 1", t)
        if t.dtype != kv_dtype:
            raise ctx.err(name, f"dtype {dtype_name(kv_dtype)} (the key's)", f"dtype {dtype_name(t.dtype)}")
    if layout.inp != "BSH" and kp.shape[1 if layout.inp == "BNSD" else 2] != qd.KV_N:
        raise ctx.err("key_shared_prefix", f"KV_N = {qd.KV_N} heads like key", kp)
    if layout.inp == "BSH" and kp.shape[2] % qd.KV_N:
        raise ctx.err("key_shared_prefix", f"H divisible by KV_N = {qd.KV_N} like key", kp)
    _, d = heads_and_dim(ctx, layout, kp, qd.KV_N, "key_shared_prefix", "num_key_value_heads")
    if d * pack != qd.D:
        raise ctx.err("key_shared_prefix", f"head dim D = {qd.D // pack} like key", kp)
    if layout.inp == "BSH" and vp.shape[2] % qd.KV_N:
        # checked before the canonical view: unflatten would raise a RuntimeError on an indivisible H
        raise ctx.err("value_shared_prefix", f"H divisible by KV_N = {qd.KV_N} like value", vp)
    kc = to_canonical(kp, layout.inp, qd.KV_N)[0]          # [KV_N, P_S, D]
    vc = to_canonical(vp, layout.inp, qd.KV_N)[0]          # [KV_N, P_S, Dv]
    if vp.shape != kp.shape and vc.shape[:2] != kc.shape[:2]:
        raise ctx.err("value_shared_prefix", f"the shape of key_shared_prefix {tuple(kp.shape)}", vp)
    if vc.shape[:2] != kc.shape[:2]:
        raise ctx.err("value_shared_prefix", f"the heads and S of key_shared_prefix {tuple(kp.shape)}", vp)
    ps = kc.shape[1]
    plen = ctx.int_list("actual_shared_prefix_len", plen_raw)
    if plen is None:
        p = ps
    else:
        if len(plen) != 1:
            raise ctx.err("actual_shared_prefix_len", "a one-element list", f"{len(plen)} entries")
        p = plen[0]
        if p < 0 or p > ps:
            raise ctx.err("actual_shared_prefix_len", f"a value in [0, {ps}] (the prefix S)", p)
    return SharedPrefix(kc[:, :p], vc[:, :p])


def rope_pair(ctx: Ctx, layout: Layout, query: torch.Tensor, qr, kr, qd: QueryDims):
    """query_rope / key_rope: both or neither; shaped like query/key except D (64 in strict mode)."""
    if qr is None and kr is None:
        return None, None
    if qr is None or kr is None:
        missing = "query_rope" if qr is None else "key_rope"
        raise ctx.err(missing, "a tensor (query_rope and key_rope come together)", "None")
    qr = ctx.tensor("query_rope", qr)
    kr = ctx.tensor("key_rope", kr)
    if qr.dtype != query.dtype and query.dtype != torch.int8:
        raise ctx.err("query_rope", f"dtype {dtype_name(query.dtype)} (the query's)", f"dtype {dtype_name(qr.dtype)}")
    if qr.dim() != query.dim() or qr.shape[:-1] != query.shape[:-1]:
        raise ctx.err("query_rope", f"the shape of query {tuple(query.shape)} except the last dim", qr)
    _, dr = heads_and_dim(ctx, layout, qr, qd.N, "query_rope", "num_heads")
    if ctx.strict and dr != ROPE_D:
        raise ctx.hw("query_rope", f"rope head dim {ROPE_D}", f"D = {dr}")
    if dr <= 0:
        raise ctx.err("query_rope", "a positive rope head dim", qr)
    return to_canonical(qr, layout.inp, qd.N), kr
