"""parse_fused: raw npu_fused_infer_attention_score arguments -> AttentionProblem.

The order of checks follows the data flow: tensors and layout, heads and dims, lengths, masks, pse,
precision flags. Every check runs before any computation.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import is_strict
from ..spec.problem import AttentionProblem, BatchGeometry
from . import lengths as L
from . import masking as M
from . import tensors as T
from .context import Ctx
from .later import reject_unimplemented


def parse_fused(a: dict, api: str = "npu_fused_infer_attention_score", aliases: Optional[dict] = None,
                *, decode_only: bool = False) -> AttentionProblem:
    ctx = Ctx(api, is_strict(), dict(aliases or {}))
    query = ctx.tensor("query", a["query"], optional=False)
    if a["key"] is None:
        raise ctx.require("key", None)
    if a["value"] is None:
        raise ctx.require("value", None)
    layout = T.parse_layout(ctx, a["input_layout"])
    T.query_dtype(ctx, query)
    reject_unimplemented(ctx, a)
    if query.dtype == torch.int8:
        from ..errors import FiaUnsupportedError
        raise FiaUnsupportedError(f"{ctx.n('query')}: int8 query (full quantization) is not implemented yet",
                                  {"reference": ["full int8 quantization not implemented"]})

    dims, qc, kv, kv_phys = T.parse_qkv(ctx, layout, query, a["key"], a["value"], a["num_heads"],
                                        a["num_key_value_heads"], allow_dv_differs=layout.packed)
    kdt = T.kv_dtype(ctx, query, kv)
    if kdt != query.dtype:
        if kdt in (torch.int8, torch.int32):
            from ..errors import FiaUnsupportedError
            raise FiaUnsupportedError(f"{ctx.n('key')}: quantized KV (int8/int4) is not implemented yet",
                                      {"reference": ["KV dequantization not implemented"]})
        raise ctx.err("key", f"dtype {T.dtype_name(query.dtype)} (the query's)", f"dtype {T.dtype_name(kdt)}")

    q_lens_raw = ctx.int_list("actual_seq_lengths", a["actual_seq_lengths"])
    kv_lens_raw = ctx.int_list("actual_seq_lengths_kv", a["actual_seq_lengths_kv"])

    if layout.packed:
        q_off = L.cumulative(ctx, "actual_seq_lengths", q_lens_raw, dims.Q_S)
        b = len(q_off) - 1
        t_kv = kv.key.shape[1]
        kv_off = L.cumulative(ctx, "actual_seq_lengths_kv", kv_lens_raw, t_kv)
        if len(kv_off) != len(q_off):
            raise ctx.err("actual_seq_lengths_kv", f"{b} entries like actual_seq_lengths", f"{len(kv_off) - 1}")
        if ctx.strict and dims.Q_S > L.MAX_T:
            raise ctx.hw("query", f"T <= {L.MAX_T}", f"T = {dims.Q_S}")
        q_rows = [q_off[i + 1] - q_off[i] for i in range(b)]
        kv_rows = [kv_off[i + 1] - kv_off[i] for i in range(b)]
        geometry = tuple(BatchGeometry(q_rows[i], 0, q_rows[i], kv_rows[i], 0, kv_rows[i],
                                       q_offset=q_off[i], kv_offset=kv_off[i]) for i in range(b))
        t = dims.Q_S
        q_s = max(q_rows, default=0)
        kv_s = max(kv_rows, default=0)
        decode = b > 0 and all(r == 1 for r in q_rows)
    else:
        b, t, q_s = dims.B, 0, dims.Q_S
        kv_s = max(kv_phys, default=0)
        decode = q_s == 1
        if decode:
            q_lens = (1,) * b   # SPEC 4: the query list is meaningless for decode
        else:
            q_lens = L.per_batch(ctx, "actual_seq_lengths", q_lens_raw, b, (q_s,) * b)
        kv_lens = L.per_batch(ctx, "actual_seq_lengths_kv", kv_lens_raw, b, kv_phys)
        geometry = tuple(BatchGeometry(q_s, 0, q_lens[i], kv_phys[i], 0, kv_lens[i]) for i in range(b))

    if decode_only and not decode:
        raise ctx.err("query", "Q_S = 1 (decode only)", query)
    if ctx.strict and not decode and query.dtype in T.FLOAT_STRICT and dims.D % 16:
        raise ctx.hw("query", "head dim D % 16 == 0 for float16/bfloat16", f"D = {dims.D}")

    ip = M.inner_precise(ctx, a["inner_precise"], decode)
    mode = M.sparse_mode(ctx, a["sparse_mode"])
    pre, nxt = M.pre_next(ctx, a["pre_tokens"], a["next_tokens"])
    mask = M.build_mask(ctx, a["atten_mask"], mode, pre, nxt, decode=decode, packed=layout.packed,
                        left_padded=False, row_fix=bool(ip & 2), b=b, q_s=q_s, kv_s=kv_s)
    pse = M.pse_shift(ctx, a["pse_shift"], q_dtype=query.dtype, decode=decode, packed=layout.packed, b=b,
                      n=dims.N, d=dims.D, q_s=q_s, kv_s=kv_s)
    scale = ctx.number("scale", a["scale"])
    lse_flag = a["softmax_lse_flag"]
    if not isinstance(lse_flag, (bool, int)) or lse_flag not in (0, 1):
        raise ctx.err("softmax_lse_flag", "a bool", lse_flag)

    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    return AttentionProblem(
        api=api, layout=layout, B=b, N=dims.N, KV_N=dims.KV_N, Q_S=q_s, KV_S=kv_s, D=dims.D, Dv=dims.Dv, T=t,
        dtype=query.dtype, out_dtype=query.dtype, compute_dtype=compute, query=qc, kv=kv, geometry=geometry,
        mask=mask, pse=pse, scale=scale, row_invalid_fix=bool(ip & 2), high_precision=not (ip & 1),
        want_lse=bool(lse_flag), is_decode=decode, strict=ctx.strict)
