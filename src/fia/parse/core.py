"""parse_fused: raw npu_fused_infer_attention_score arguments -> AttentionProblem.

The order of checks follows the data flow: tensors and layout, heads and dims, KV storage, lengths
and padding, prefix, masks, pse, precision flags. Every check runs before any computation.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import is_strict
from ..errors import FiaUnsupportedError
from ..spec.problem import AttentionProblem, BatchGeometry
from . import lengths as L
from . import masking as M
from . import sequence as Q
from . import tensors as T
from .context import Ctx, dtype_name
from .later import reject_unimplemented
from .paged import paged_kv

_IMPLEMENTED = frozenset({"block_table", "query_padding_size", "kv_padding_size", "key_shared_prefix",
                          "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope"})


def parse_fused(a: dict, api: str = "npu_fused_infer_attention_score", aliases: Optional[dict] = None,
                *, decode_only: bool = False) -> AttentionProblem:
    ctx = Ctx(api, is_strict(), dict(aliases or {}))
    query = ctx.tensor("query", a["query"], optional=False)
    key = T.kv_arg(ctx, "key", a["key"])
    value = T.kv_arg(ctx, "value", a["value"])
    layout = T.parse_layout(ctx, a["input_layout"])
    T.query_dtype(ctx, query)
    reject_unimplemented(ctx, a, _IMPLEMENTED)
    if query.dtype == torch.int8:
        raise FiaUnsupportedError(f"{ctx.n('query')}: int8 query (full quantization) is not implemented yet",
                                  {"reference": ["full int8 quantization not implemented"]})
    qd = T.query_dims(ctx, layout, query, a["num_heads"], a["num_key_value_heads"])
    T.same_kind(ctx, key, value)
    key, value = T.split_list(layout, query, key, value)
    is_list = isinstance(key, tuple)
    q_rope, key_rope = Q.rope_pair(ctx, layout, query, a["query_rope"], a["key_rope"], qd)
    paged = a["block_table"] is not None

    q_lens_raw = ctx.int_list("actual_seq_lengths", a["actual_seq_lengths"])
    kv_lens_raw = ctx.int_list("actual_seq_lengths_kv", a["actual_seq_lengths_kv"])

    # ---- batches and query rows
    if layout.packed:
        q_off = L.cumulative(ctx, "actual_seq_lengths", q_lens_raw, qd.S)
        b = len(q_off) - 1
        q_rows = [q_off[i + 1] - q_off[i] for i in range(b)]
        if ctx.strict and qd.S > L.MAX_T:
            raise ctx.hw("query", f"T <= {L.MAX_T}", f"T = {qd.S}")
        decode = b > 0 and all(r == 1 for r in q_rows)
        q_s = max(q_rows, default=0)
    else:
        b, q_s = qd.B, qd.S
        q_off = (0,) * (b + 1)
        decode = q_s == 1
        q_rows = [q_s] * b
    if decode_only and not decode:
        raise ctx.err("query", "Q_S = 1 (decode only)", query)

    # ---- KV storage
    allow_dv = layout.packed or q_rope is not None
    if paged:
        if kv_lens_raw is None:
            raise ctx.err("actual_seq_lengths_kv", "per-batch KV lengths (required with block_table)", "None")
        bt = ctx.tensor("block_table", a["block_table"])
        bs = ctx.integer("block_size", a["block_size"])
        cap = bt.shape[-1] * bs if bt.dim() == 2 and bs > 0 else 2 ** 62
        kv_lens = L.per_batch(ctx, "actual_seq_lengths_kv", kv_lens_raw, b, (cap,) * b)
        kv_dt = key.dtype if isinstance(key, torch.Tensor) else query.dtype
        kv, dv, kv_s = paged_kv(ctx, layout, qd, b, key, value, key_rope, bt, bs, kv_lens, decode=decode,
                                kv_dtype=kv_dt)
        kv_phys = (kv_s,) * b
        kv_off = (0,) * (b + 1)
    elif is_list:
        kv, dv, kv_phys = T.list_kv(ctx, layout, qd, key, value, key_rope)
        kv_off = (0,) * (b + 1)
    else:
        kv, dv, kv_phys = T.dense_kv(ctx, layout, qd, key, value, key_rope, allow_dv_differs=allow_dv)
        if layout.packed:
            kv_off = L.cumulative(ctx, "actual_seq_lengths_kv", kv_lens_raw, kv.key.shape[1])
            if len(kv_off) != len(q_off):
                raise ctx.err("actual_seq_lengths_kv", f"{b} entries like actual_seq_lengths", len(kv_off) - 1)
            kv_phys = tuple(kv_off[i + 1] - kv_off[i] for i in range(b))
        else:
            kv_off = (0,) * (b + 1)
    kd, vd = T.kv_dtypes(ctx, kv)
    if kd != vd:
        raise ctx.err("value", f"dtype {dtype_name(kd)} (the key's)", f"dtype {dtype_name(vd)}")
    if kd != query.dtype:
        if kd in (torch.int8, torch.int32):
            raise FiaUnsupportedError(f"{ctx.n('key')}: quantized KV (int8/int4) is not implemented yet",
                                      {"reference": ["KV dequantization not implemented"]})
        raise ctx.err("key", f"dtype {dtype_name(query.dtype)} (the query's)", f"dtype {dtype_name(kd)}")
    if key_rope is not None:
        kr = kv.key_rope
        if key_rope.dtype != kd:
            raise ctx.err("key_rope", f"dtype {dtype_name(kd)} (the key's)", f"dtype {dtype_name(key_rope.dtype)}")
        if kr.shape[-1] != q_rope.shape[-1]:
            raise ctx.err("key_rope", f"rope head dim {q_rope.shape[-1]} (query_rope's)", key_rope)
    if ctx.strict and not decode and query.dtype in T.FLOAT_STRICT and qd.D % 16:
        raise ctx.hw("query", "head dim D % 16 == 0 for float16/bfloat16", f"D = {qd.D}")

    # ---- lengths and left padding (SPEC 4)
    qpad = Q.padding_size(ctx, "query_padding_size", a["query_padding_size"])
    kvpad = Q.padding_size(ctx, "kv_padding_size", a["kv_padding_size"])
    if paged and (qpad is not None or kvpad is not None):
        raise ctx.err("query_padding_size" if qpad is not None else "kv_padding_size",
                      "None with block_table (paged KV does not support left padding)", "a padding size")
    if layout.packed and (qpad is not None or kvpad is not None):
        raise ctx.err("query_padding_size" if qpad is not None else "kv_padding_size",
                      "None for TND layouts (no left padding)", "a padding size")
    qpad_on = qpad is not None and q_lens_raw is not None and not decode
    kvpad_on = kvpad is not None and kv_lens_raw is not None and kv.kind == "dense"   # lists: right padding
    if layout.packed:
        q_lens = tuple(q_rows)
        kv_lens = kv_lens if paged else kv_phys
    else:
        q_lens = (1,) * b if decode else L.per_batch(ctx, "actual_seq_lengths", q_lens_raw, b, (q_s,) * b)
        if not paged:
            kv_lens = L.per_batch(ctx, "actual_seq_lengths_kv", kv_lens_raw, b, kv_phys)

    # ---- shared prefix (SPEC 7)
    prefix = Q.shared_prefix(ctx, layout, qd, key, a["key_shared_prefix"], a["value_shared_prefix"],
                             a["actual_shared_prefix_len"], kd)
    if prefix is not None:
        for bad, what in ((paged, "block_table (paged KV)"), (is_list, "tensor-list key/value"),
                          (qpad_on or kvpad_on, "left padding"), (q_rope is not None, "MLA rope")):
            if bad:
                raise ctx.err("key_shared_prefix", f"None with {what}: shared prefix does not combine with it",
                              "a shared prefix")
        if prefix.value.shape[-1] != dv:
            raise ctx.err("value_shared_prefix", f"head dim {dv} like value", f"D = {prefix.value.shape[-1]}")
    p_len = 0 if prefix is None else prefix.length

    geometry = []
    for i in range(b):
        qw = Q.left_window(q_rows[i], qpad, q_lens[i]) if qpad_on else (0, q_lens[i])
        kw = Q.left_window(kv_phys[i], kvpad, kv_lens[i]) if kvpad_on else (0, kv_lens[i])
        if qw is None or kw is None:      # the window starts below 0: the batch's output is zeros
            qw, kw = (0, 0), (0, 0)
        geometry.append(BatchGeometry(q_rows[i], qw[0], qw[1], kv_phys[i], kw[0], kw[1], p_len,
                                      q_offset=q_off[i], kv_offset=kv_off[i]))

    # ---- masks, pse, precision (SPEC 3, 5, 6)
    kv_ext = max(kv_phys, default=0) + p_len      # columns a mask / pse must cover (prefix first)
    ip = M.inner_precise(ctx, a["inner_precise"], decode)
    mode = M.sparse_mode(ctx, a["sparse_mode"])
    pre, nxt = M.pre_next(ctx, a["pre_tokens"], a["next_tokens"])
    mask = M.build_mask(ctx, a["atten_mask"], mode, pre, nxt, ignore_sparse=decode and q_rope is None,
                        decode_shapes=decode, packed=layout.packed, left_padded=qpad_on or kvpad_on,
                        row_fix=bool(ip & 2), b=b, q_s=q_s, kv_s=kv_ext)
    pse = M.pse_shift(ctx, a["pse_shift"], q_dtype=query.dtype, decode=decode, packed=layout.packed, b=b,
                      n=qd.N, d=qd.D, q_s=q_s, kv_s=kv_ext)
    scale = ctx.number("scale", a["scale"])
    lse_flag = a["softmax_lse_flag"]
    if not isinstance(lse_flag, (bool, int)) or lse_flag not in (0, 1):
        raise ctx.err("softmax_lse_flag", "a bool", lse_flag)

    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    kv_s = max(kv_phys, default=0)
    return AttentionProblem(
        api=api, layout=layout, B=b, N=qd.N, KV_N=qd.KV_N, Q_S=q_s, KV_S=kv_s, D=qd.D, Dv=dv,
        T=qd.S if layout.packed else 0, dtype=query.dtype, out_dtype=query.dtype, compute_dtype=compute,
        query=T.to_canonical(query, layout.inp, qd.N), kv=kv, geometry=tuple(geometry), mask=mask, pse=pse,
        scale=scale, row_invalid_fix=bool(ip & 2), high_precision=not (ip & 1), want_lse=bool(lse_flag),
        is_decode=decode, strict=ctx.strict, query_rope=q_rope, prefix=prefix)
