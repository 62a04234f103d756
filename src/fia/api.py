"""torch_npu-compatible entry points: parse -> choose backend -> run -> finalize.

Signatures, keyword names and defaults are those of torch_npu (SPEC 1.1), so NPU code runs unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import parse
from .backends import registry
from .finalize import finalize

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention"]

_INT_MAX = 2147483647


def _run(problem):
    backend = registry.select(problem)
    result = backend.run(problem)
    return finalize(problem, result)


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, dequant_scale_query=None,
                                    num_heads=1, scale=1.0, pre_tokens=_INT_MAX, next_tokens=_INT_MAX,
                                    input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                                    block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                    query_quant_mode=0, softmax_lse_flag=False):
    """FusedInferAttentionScore (prefill and decode in one op). Returns (attention_out, softmax_lse).

    attention_out has the query's layout with D replaced by the value head dim (SPEC 2, 13);
    softmax_lse is float32 [B, N, Q_S, 1] ([T, N, 1] for TND layouts) when softmax_lse_flag, else an
    empty float32 tensor of shape [0].
    """
    args = dict(locals())
    problem = parse.parse_fused(args, api="npu_fused_infer_attention_score")
    return _run(problem)


def npu_incre_flash_attention(query, key, value, *, padding_mask=None, pse_shift=None, atten_mask=None,
                              actual_seq_lengths=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                              quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
                              block_table=None, kv_padding_size=None, num_heads=1, scale_value=1.0,
                              input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1):
    """IncreFlashAttention: decode only (Q_S == 1); `actual_seq_lengths` are the KV lengths. Returns attention_out."""
    args = dict(locals())
    problem = parse.parse_incre(args)
    out, _ = _run(problem)
    return out


def npu_prompt_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                               actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                               quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                               pre_tokens=_INT_MAX, next_tokens=0, input_layout="BSH", num_key_value_heads=0,
                               actual_seq_lengths_kv=None, sparse_mode=0):
    """PromptFlashAttention (prefill). next_tokens defaults to 0; sparse_mode 10..14 = high precision mode-10.

    Returns attention_out.
    """
    args = dict(locals())
    problem = parse.parse_prompt(args)
    out, _ = _run(problem)
    return out
