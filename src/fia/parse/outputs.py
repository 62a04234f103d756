"""torch_npu's graph-capture output helpers (`_npu_fused_infer_attention_score[_v2]_infer_output`): the shapes and
dtype of a call's outputs from the query, the value, the layout and the output-dtype arguments -- no key, so no
full parse (the call's own parse validates everything else when `.out` runs). DECISIONS 40."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..config import is_strict
from ..problem.layout import output_shape
from .context import Ctx, describe, dtype_name
from .tensors import parse_layout, query_dims, value_dim

_ALIASES_V2 = {"quant_scale2": "quant_scale_out", "num_heads": "num_query_heads",
               "softmax_lse_flag": "return_softmax_lse"}


# torch_npu's dtype numbers (`int? out_dtype`: ATen's ScalarType numbering for the standard dtypes) -> dtype
DTYPE_CODES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
               6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}
for _code, _name in ((23, "float8_e5m2"), (24, "float8_e4m3fn")):
    if hasattr(torch, _name):
        DTYPE_CODES[_code] = getattr(torch, _name)
DTYPE_NUMBERS = {dt: code for code, dt in DTYPE_CODES.items()}
FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))   # quantized outputs


def output_dtype(ctx: Ctx, a: dict, query: torch.Tensor, quantized: bool) -> torch.dtype:
    """attention_out's dtype: int8 when quantized, the rope's (else float16) for an int8 query, else the query's;
    v2's out_dtype may choose among what the call allows."""
    if quantized:
        dtype = torch.int8
    elif query.dtype == torch.int8:
        q_rope = a.get("query_rope")
        dtype = q_rope.dtype if q_rope is not None else torch.float16
    else:
        dtype = query.dtype
    if a.get("out_dtype") is not None:
        dtype = _requested_out_dtype(ctx, a["out_dtype"], dtype, query.dtype, quantized)
    return dtype


def _requested_out_dtype(ctx: Ctx, v, default: torch.dtype, q_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """npu_fused_infer_attention_score_v2's out_dtype (a torch_npu dtype number, or a torch.dtype): the output
    dtype of an int8 query (float16 / bfloat16) or of a quantized output (int8, or FP8: float8_e4m3fn /
    float8_e5m2, saturating). Without either, only the output's own dtype (the query's) is accepted.
    (DECISIONS 38)"""
    if isinstance(v, torch.dtype):
        dt = v
    elif isinstance(v, int) and not isinstance(v, bool) and v in DTYPE_CODES:
        dt = DTYPE_CODES[v]
    else:
        raise ctx.err("out_dtype", "None, a torch dtype or torch_npu's dtype number (5 float16, 15 bfloat16, "
                      "1 int8, ...)", describe(v))
    if quantized:
        allowed, why = (torch.int8,) + FP8, "int8 or FP8 (float8_e4m3fn / float8_e5m2: the output is quantized " \
            "by quant_scale2)"
    elif q_dtype == torch.int8:
        allowed, why = (torch.float16, torch.bfloat16), "float16 or bfloat16 (the output of an int8 query)"
    else:
        allowed = (default,)
        why = (f"{dtype_name(default)}, the output's dtype (out_dtype selects the output dtype only for an int8 "
               "query or a quantized output)")
    if dt not in allowed:
        raise ctx.err("out_dtype", why, dtype_name(dt))
    return dt


def infer_outputs(a: dict, api: str, v2: bool = False) -> Tuple[tuple, torch.dtype, Optional[tuple]]:
    """(attention_out shape, its dtype, softmax_lse shape or None when the lse flag is off)."""
    ctx = Ctx(api, is_strict(), dict(_ALIASES_V2) if v2 else {})
    query = ctx.tensor("query", a["query"], optional=False)
    value = ctx.tensor("value", a["value"], optional=False)
    for name in ("quant_scale2", "block_table", "query_rope"):
        ctx.tensor(name, a.get(name))
    for name in ("query_dtype", "value_dtype"):
        if a.get(name) is not None:
            raise ctx.err(name, "None (reserved argument)", a[name])
    layout = parse_layout(ctx, a["input_layout"])
    qd = query_dims(ctx, layout, query, a["num_heads"], a["num_key_value_heads"])
    pack = 8 if value.dtype == torch.int32 else 1          # int4 packed eight to an int32 (SPEC 10.4)
    if a.get("block_table") is not None:                   # paged caches: (blocks, bs, H), (blocks, KV_N, bs, D), NZ
        if value.dim() == 3:
            if value.shape[2] % qd.KV_N:
                raise ctx.err("value", f"H divisible by num_key_value_heads = {qd.KV_N}", value)
            dv = value.shape[2] // qd.KV_N
        elif value.dim() == 4:
            dv = value.shape[3]
        elif value.dim() == 5:
            dv = value.shape[2] * value.shape[4]
        else:
            raise ctx.err("value", "a paged cache of rank 3, 4 or 5 (with block_table)", value)
    else:
        if value.dim() != layout.rank:
            raise ctx.err("value", f"a {layout.rank}-D tensor for input_layout {layout.name}", value)
        dv = value_dim(ctx, layout, value, qd.KV_N)
    dv *= pack
    b, s, t = (0, 0, qd.S) if layout.packed else (qd.B, qd.S, 0)
    out = output_shape(layout.out, b, qd.N, s, dv, t)
    dtype = output_dtype(ctx, a, query, a.get("quant_scale2") is not None)
    flag = a["softmax_lse_flag"]
    if not isinstance(flag, (bool, int)) or flag not in (0, 1):
        raise ctx.err("softmax_lse_flag", "a bool", repr(flag))
    lse = None
    if flag:
        lse = (t, qd.N, 1) if layout.packed else (b, qd.N, s, 1)
    return tuple(out), dtype, lse

