"""The eager implementations of the torch_npu entry points: parse -> choose backend -> run -> finalize.

Signatures, keyword names and defaults are those of torch_npu (SPEC 1.1), so NPU code runs unchanged.
"""
from __future__ import annotations

import torch

from . import parse, replay
from .backends import registry
from .backends.base import run_inference
from .finalize import finalize
from .outvariants import out_variant, workspace_query

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
           "npu_fused_infer_attention_score_v2", "npu_attention_update",
           "_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_get_max_workspace"]

_INT_MAX = 2147483647


def _run(problem):
    backend = registry.select(problem)
    result = run_inference(backend, problem)
    replay.note(problem, backend)          # (for fia.replay: what ran a call that may replay later)
    return finalize(problem, result)


# argument dict -> problem, one per fused entry point; shared by the function, its .out variant, its
# workspace query and its graph-mode fake kernel (fia.graph), so they all accept exactly the same calls
def fused_problem(args: dict):
    return parse.parse_fused(args, api="npu_fused_infer_attention_score")


def v2_problem(args: dict):
    args = dict(args)
    unknown = args.pop("unknown", None) or {}     # the keywords the v2 signature collected
    return parse.parse_v2(args, unknown)


def v2_results(problem, out, lse):
    """v2's return convention: with return_softmax_lse off, a (1,) float32 zero tensor (its document)."""
    if not problem.want_lse:
        lse = out.new_zeros(1, dtype=torch.float32)
    return out, lse


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
    return _run(fused_problem(args))


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


def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                       atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                       block_table=None, dequant_scale_query=None, dequant_scale_key=None,
                                       dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
                                       dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None,
                                       learnable_sink=None, num_query_heads=1, num_key_value_heads=0,
                                       softmax_scale=1.0, pre_tokens=_INT_MAX, next_tokens=_INT_MAX,
                                       input_layout="BSH", sparse_mode=0, block_size=0, query_quant_mode=0,
                                       key_quant_mode=0, value_quant_mode=0, inner_precise=0,
                                       return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None,
                                       query_rope_dtype=None, key_rope_dtype=None, key_shared_prefix_dtype=None,
                                       value_shared_prefix_dtype=None, dequant_scale_query_dtype=None,
                                       dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
                                       dequant_scale_key_rope_dtype=None, **unknown):
    """FusedInferAttentionScoreV4 under its newer names (SPEC 1.1b). Returns (attention_out, softmax_lse);
    with return_softmax_lse=False the second output is a (1,) float32 zero tensor."""
    args = dict(locals())
    problem = v2_problem(args)
    return v2_results(problem, *_run(problem))


def npu_attention_update(lse, local_out, update_type=0):
    """Merge partial attention results of the same rows over disjoint key sets (SPEC 1.1b).

    lse: list of K float32 [R]; local_out: list of K [R, D]. Returns (out [R, D] in local_out's dtype,
    lse_out [R] float32 when update_type == 1 else None)."""
    from .merge import attention_update
    return attention_update(lse, local_out, update_type)


# ---------------------------------------------------------------------------------- out= variants (SPEC 1.1b)
npu_fused_infer_attention_score.out = out_variant(npu_fused_infer_attention_score, fused_problem, "softmax_lse_flag")
npu_fused_infer_attention_score_v2.out = out_variant(npu_fused_infer_attention_score_v2, v2_problem,
                                                     "return_softmax_lse")
_npu_fused_infer_attention_score_get_max_workspace = workspace_query(
    npu_fused_infer_attention_score, fused_problem, "_npu_fused_infer_attention_score_get_max_workspace")
_npu_fused_infer_attention_score_v2_get_max_workspace = workspace_query(
    npu_fused_infer_attention_score_v2, v2_problem, "_npu_fused_infer_attention_score_v2_get_max_workspace")
