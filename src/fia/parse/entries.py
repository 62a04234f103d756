"""npu_incre_flash_attention / npu_prompt_flash_attention mapped onto the fused argument set."""
from __future__ import annotations

import difflib

import torch

from .core import parse_fused

_INT_MAX = 2147483647

# every keyword of npu_fused_infer_attention_score with its default
FUSED_DEFAULTS = dict(
    pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None, dequant_scale1=None,
    quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
    value_antiquant_offset=None, block_table=None, query_padding_size=None, kv_padding_size=None,
    key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
    key_rope=None, key_rope_antiquant_scale=None, dequant_scale_query=None, num_heads=1, scale=1.0,
    pre_tokens=_INT_MAX, next_tokens=_INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
    inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
    query_quant_mode=0, softmax_lse_flag=False)


def parse_incre(a: dict):
    """IncreFlashAttention: decode only; its actual_seq_lengths are the KV lengths; padding_mask ignored."""
    f = dict(FUSED_DEFAULTS)
    f.update(query=a["query"], key=a["key"], value=a["value"], pse_shift=a["pse_shift"], atten_mask=a["atten_mask"],
             actual_seq_lengths_kv=a["actual_seq_lengths"], dequant_scale1=a["dequant_scale1"],
             quant_scale1=a["quant_scale1"], dequant_scale2=a["dequant_scale2"], quant_scale2=a["quant_scale2"],
             quant_offset2=a["quant_offset2"], antiquant_scale=a["antiquant_scale"],
             antiquant_offset=a["antiquant_offset"], block_table=a["block_table"],
             kv_padding_size=a["kv_padding_size"], num_heads=a["num_heads"], scale=a["scale_value"],
             input_layout=a["input_layout"], num_key_value_heads=a["num_key_value_heads"],
             block_size=a["block_size"], inner_precise=a["inner_precise"])
    sc, q = a["antiquant_scale"], a["query"]
    if isinstance(sc, torch.Tensor) and isinstance(q, torch.Tensor) and sc.dim() == 3 and \
            sc.dtype == torch.float32 and q.dtype in (torch.float16, torch.bfloat16):
        # per-token: IncreFlashAttentionV4 has no mode argument; its antiquantScale / antiquantOffset of shape
        # (2, B, S) (float32) say per-token, as the fused function's antiquant_mode=1 (SPEC 10.1; DECISIONS 41)
        f["antiquant_mode"] = 1
    aliases = {"actual_seq_lengths_kv": "actual_seq_lengths", "scale": "scale_value"}
    return parse_fused(f, "npu_incre_flash_attention", aliases, decode_only=True)


def parse_prompt(a: dict):
    """PromptFlashAttention: sparse_mode 10..14 = high precision with sparse_mode - 10; behaves as inner_precise 1."""
    f = dict(FUSED_DEFAULTS)
    mode = a["sparse_mode"]
    inner = 1
    if isinstance(mode, int) and not isinstance(mode, bool) and 10 <= mode <= 14:
        mode, inner = mode - 10, 0
    f.update(query=a["query"], key=a["key"], value=a["value"], pse_shift=a["pse_shift"], atten_mask=a["atten_mask"],
             actual_seq_lengths=a["actual_seq_lengths"], actual_seq_lengths_kv=a["actual_seq_lengths_kv"],
             dequant_scale1=a["deq_scale1"], quant_scale1=a["quant_scale1"], dequant_scale2=a["deq_scale2"],
             quant_scale2=a["quant_scale2"], quant_offset2=a["quant_offset2"], num_heads=a["num_heads"],
             scale=a["scale_value"], pre_tokens=a["pre_tokens"], next_tokens=a["next_tokens"],
             input_layout=a["input_layout"], num_key_value_heads=a["num_key_value_heads"], sparse_mode=mode,
             inner_precise=inner)
    aliases = {"dequant_scale1": "deq_scale1", "dequant_scale2": "deq_scale2", "scale": "scale_value"}
    return parse_fused(f, "npu_prompt_flash_attention", aliases)


# npu_fused_infer_attention_score_v2 keyword -> the fused (v1) keyword it maps onto (SPEC 1.1b)
V2_MAP = {
    "query_rope": "query_rope", "key_rope": "key_rope", "pse_shift": "pse_shift", "atten_mask": "atten_mask",
    "actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
    "block_table": "block_table", "dequant_scale_query": "dequant_scale_query",
    "dequant_scale_key": "key_antiquant_scale", "dequant_offset_key": "key_antiquant_offset",
    "dequant_scale_value": "value_antiquant_scale", "dequant_offset_value": "value_antiquant_offset",
    "quant_scale_out": "quant_scale2", "quant_offset_out": "quant_offset2",
    "num_query_heads": "num_heads", "num_key_value_heads": "num_key_value_heads", "softmax_scale": "scale",
    "pre_tokens": "pre_tokens", "next_tokens": "next_tokens", "input_layout": "input_layout",
    "sparse_mode": "sparse_mode", "block_size": "block_size", "query_quant_mode": "query_quant_mode",
    "key_quant_mode": "key_antiquant_mode", "value_quant_mode": "value_antiquant_mode",
    "inner_precise": "inner_precise", "return_softmax_lse": "softmax_lse_flag",
    # reserved in both spellings: the fused parser's one rule (RESERVED_TENSORS in core.py, DECISIONS 39)
    "dequant_scale_key_rope": "key_rope_antiquant_scale",
    # not a fused keyword: the output dtype override the fused parser reads when present (DECISIONS 38)
    "out_dtype": "out_dtype",
}
# reserved: None (their default) accepted, anything else is an input error
V2_RESERVED = ("query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
               "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
               "dequant_scale_key_dtype", "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype",
               "quant_scale_p")


def unknown_keyword(api: str, name: str, known=()):
    """The input error of a keyword `name` that entry point `api` does not take (every path raises this one:
    eager, meta / fake tensors, tracing); `known`: its keywords, for a close match in the hint."""
    from ..errors import input_error
    v2 = "attention_score_v2" in api                 # (the function, its .out and its workspace query)
    if v2 and name in FUSED_DEFAULTS:
        return input_error(name, "an argument of npu_fused_infer_attention_score_v2 (it is only reachable "
                           "through npu_fused_infer_attention_score)", "a value",
                           "call npu_fused_infer_attention_score for this feature")
    if not v2 and V2_MAP.get(name) in known:         # a v2 name in a v1 call
        hint = f"did you mean {V2_MAP[name]}? {name} is npu_fused_infer_attention_score_v2's name for it"
    else:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]}?" if close else None
    return input_error(name, f"a keyword of {api}", "an unknown keyword", hint)


def parse_v2(a: dict, extra: dict):
    """npu_fused_infer_attention_score_v2: the same operator under new names. `extra`: unknown keywords."""
    from ..errors import input_error
    for name in extra:
        raise unknown_keyword("npu_fused_infer_attention_score_v2", name, tuple(V2_MAP) + V2_RESERVED)
    for name in V2_RESERVED:
        if a.get(name) is not None:
            raise input_error(name, "None (reserved argument)", repr(a[name]) if not hasattr(a[name], "shape")
                              else f"tensor of shape {tuple(a[name].shape)}")
    f = dict(FUSED_DEFAULTS)
    f.update(query=a["query"], key=a["key"], value=a["value"], learnable_sink=a["learnable_sink"])
    for v2, v1 in V2_MAP.items():
        f[v1] = a[v2]
    aliases = {v1: v2 for v2, v1 in V2_MAP.items()}
    return parse_fused(f, "npu_fused_infer_attention_score_v2", aliases)
