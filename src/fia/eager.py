"""The eager implementations of the torch_npu entry points: parse -> choose backend -> run -> finalize.

Signatures, keyword names and defaults are those of torch_npu (SPEC 1.1), so NPU code runs unchanged.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import parse, replay
from .backends import registry
from .backends.base import run_inference
from .finalize import finalize
from .outvariants import out_variant, workspace_query

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
           "npu_fused_infer_attention_score_v2", "npu_attention_update",
           "_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_get_max_workspace",
           "_npu_fused_infer_attention_score_infer_output", "_npu_fused_infer_attention_score_v2_infer_output"]

_INT_MAX = 2147483647

Opt = Optional[Tensor]
KV = Union[Tensor, List[Tensor]]          # a dense or paged cache, or one tensor per batch (tensor-list KV)
Lengths = Optional[Sequence[int]]         # a list / tuple of ints, NumPy ints or an int32 / int64 tensor


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


def npu_fused_infer_attention_score(
        query: Tensor, key: KV, value: KV, *, pse_shift: Opt = None, atten_mask: Opt = None,
        actual_seq_lengths: Lengths = None, actual_seq_lengths_kv: Lengths = None, dequant_scale1: Opt = None,
        quant_scale1: Opt = None, dequant_scale2: Opt = None, quant_scale2: Opt = None, quant_offset2: Opt = None,
        antiquant_scale: Opt = None, antiquant_offset: Opt = None, key_antiquant_scale: Opt = None,
        key_antiquant_offset: Opt = None, value_antiquant_scale: Opt = None, value_antiquant_offset: Opt = None,
        block_table: Opt = None, query_padding_size: Opt = None, kv_padding_size: Opt = None,
        key_shared_prefix: Opt = None, value_shared_prefix: Opt = None, actual_shared_prefix_len: Lengths = None,
        query_rope: Opt = None, key_rope: Opt = None, key_rope_antiquant_scale: Opt = None,
        dequant_scale_query: Opt = None, num_heads: int = 1, scale: float = 1.0, pre_tokens: int = _INT_MAX,
        next_tokens: int = _INT_MAX, input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
        inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0, key_antiquant_mode: int = 0,
        value_antiquant_mode: int = 0, query_quant_mode: int = 0,
        softmax_lse_flag: bool = False) -> Tuple[Tensor, Tensor]:
    """FusedInferAttentionScore: prefill and decode in one op (SPEC 1.1). Returns (attention_out, softmax_lse).

    softmax(scale * Q K^T + pse + mask) V per batch b and query head n, on KV head n // (N / KV_N) (GQA / MQA).

    Args:
        query: float16 / bfloat16 (int8 with full quantization; float32 in portable validation), shaped by
            `input_layout` (SPEC 2): BSH [B, S, N*D], BSND [B, S, N, D], BNSD [B, N, S, D], TND [T, N, D]
            (T = all batches' query tokens, with cumulative lengths), NTD [N, T, D]; BNSD_BSND / BSH_NBSD /
            BSND_NBSD / BNSD_NBSD / TND_NTD / NTD_TND name the output layout after the underscore.
        key, value: the KV cache in the same layout with KV_N heads and KV_S tokens; or paged
            [num_blocks, block_size, KV_N*D] / [num_blocks, KV_N, block_size, D] with `block_table`; or a list of
            B tensors of batch 1 (tensor-list KV). int8 / int4 (packed eight to an int32) with the antiquant
            arguments (SPEC 10). MLA: value may be key's first Dv channels.
        pse_shift: float positional bias [B or 1, N, Q_S, KV_S] added to the scaled scores (SPEC 3).
        atten_mask: bool / int8 / uint8, 1 = masked: [Q_S, KV_S], [1 or B, Q_S, KV_S], [1 or B, 1, Q_S, KV_S]
            (Q_S = 1: [B, KV_S], [B, 1, KV_S], [B, 1, 1, KV_S]), or the 2048 x 2048 triu template that sparse
            modes 2-4 require (SPEC 5).
        actual_seq_lengths: query lengths per batch (list of ints, NumPy ints or an int tensor); cumulative
            for TND layouts.
        actual_seq_lengths_kv: KV lengths per batch (cumulative for TND, per batch for paged TND).
        dequant_scale1, quant_scale1, dequant_scale2: full int8 attention's scales (SPEC 11).
        quant_scale2, quant_offset2: output quantization to int8 (SPEC 12).
        antiquant_scale, antiquant_offset: K/V dequantization, index 0 key, 1 value (SPEC 10.1).
        key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset: separate K / V
            dequantization (SPEC 10.2), per tensor / channel / token / head by their mode.
        block_table: int32 [B, max_blocks] of block ids into a paged cache (SPEC 8).
        query_padding_size, kv_padding_size: left padding (an int64 tensor of one element, SPEC 4).
        key_shared_prefix, value_shared_prefix, actual_shared_prefix_len: one system prompt every batch attends
            first (SPEC 7).
        query_rope, key_rope: MLA rope parts, concatenated to query / key for the scores only (SPEC 9).
        key_rope_antiquant_scale: reserved (SPEC 10b).
        dequant_scale_query: per-token query scale of an int8 query (SPEC 11, 10b.3).
        num_heads: N, the query's heads. num_key_value_heads: KV_N (0 = N).
        scale: the factor on Q K^T (usually D ** -0.5).
        pre_tokens, next_tokens: the band of keys a query sees (sparse modes 0, 1, 4; SPEC 5).
        input_layout: see `query`.
        sparse_mode: 0 default (the mask with the pre / next band), 1 the mask alone, 2 left-up causal, 3
            right-down causal, 4 band on the bottom-right diagonal (SPEC 5).
        inner_precise: bit 0 high performance (1) / precision (0), bit 1 row-invalid correction: rows whose
            every key is masked output 0 (SPEC 6).
        block_size: tokens per block of a paged cache.
        antiquant_mode, key_antiquant_mode, value_antiquant_mode: the dequantization granularity (SPEC 10).
        query_quant_mode: the granularity of `dequant_scale_query`.
        softmax_lse_flag: also return the log-sum-exp of every row.

    Returns:
        attention_out: the query's layout with D replaced by the value head dim (SPEC 13), in the query's dtype
            (int8 when quantized). softmax_lse: float32 [B, N, Q_S, 1] ([T, N, 1] for TND layouts; +inf for
            rows that see no key) when softmax_lse_flag, else an empty float32 tensor of shape [0].
    """
    args = dict(locals())
    return _run(fused_problem(args))


def npu_incre_flash_attention(
        query: Tensor, key: KV, value: KV, *, padding_mask: Opt = None, pse_shift: Opt = None,
        atten_mask: Opt = None, actual_seq_lengths: Lengths = None, dequant_scale1: Opt = None,
        quant_scale1: Opt = None, dequant_scale2: Opt = None, quant_scale2: Opt = None, quant_offset2: Opt = None,
        antiquant_scale: Opt = None, antiquant_offset: Opt = None, block_table: Opt = None,
        kv_padding_size: Opt = None, num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH",
        num_key_value_heads: int = 0, block_size: int = 0, inner_precise: int = 1) -> Tensor:
    """IncreFlashAttention: decode only (Q_S == 1). Returns attention_out.

    Args:
        query: [B, 1, N*D] (BSH), [B, 1, N, D] (BSND) or [B, N, 1, D] (BNSD); float16 / bfloat16.
        key, value: the KV cache (dense, paged with `block_table`, or a list of B tensors), int8 / int4 with
            `antiquant_scale` / `antiquant_offset` (index 0 key, 1 value; SPEC 10.1).
        padding_mask: reserved, ignored.
        pse_shift: float bias [B or 1, N, 1, KV_S]. atten_mask: bool / int8 / uint8 [B, KV_S], [B, 1, KV_S] or
            [B, 1, 1, KV_S].
        actual_seq_lengths: the KV lengths per batch (this function has no query lengths).
        dequant_scale1, quant_scale1, dequant_scale2: full int8 attention (SPEC 11); quant_scale2,
            quant_offset2: int8 output (SPEC 12).
        block_table, block_size: paged KV (SPEC 8). kv_padding_size: KV left padding (SPEC 4).
        num_heads, num_key_value_heads (0 = num_heads), scale_value, input_layout: as the fused function.
        inner_precise: 1 (default) high precision.

    Returns:
        attention_out in the query's layout (value head dim), dtype of the query (int8 when quantized).
    """
    args = dict(locals())
    problem = parse.parse_incre(args)
    out, _ = _run(problem)
    return out


def npu_prompt_flash_attention(
        query: Tensor, key: KV, value: KV, *, padding_mask: Opt = None, atten_mask: Opt = None,
        pse_shift: Opt = None, actual_seq_lengths: Lengths = None, deq_scale1: Opt = None, quant_scale1: Opt = None,
        deq_scale2: Opt = None, quant_scale2: Opt = None, quant_offset2: Opt = None, num_heads: int = 1,
        scale_value: float = 1.0, pre_tokens: int = _INT_MAX, next_tokens: int = 0, input_layout: str = "BSH",
        num_key_value_heads: int = 0, actual_seq_lengths_kv: Lengths = None, sparse_mode: int = 0) -> Tensor:
    """PromptFlashAttention: prefill. Returns attention_out.

    Args:
        query, key, value: BSH [B, S, N*D], BSND [B, S, N, D], BNSD [B, N, S, D], TND [T, N, D] or BNSD_BSND
            (output BSND); key / value with KV_N heads (GQA); float16 / bfloat16 (int8 with full quantization).
        padding_mask: reserved, ignored.
        atten_mask: bool / int8 / uint8 (1 = masked), [Q_S, KV_S], [1 or B, Q_S, KV_S], [1 or B, 1, Q_S, KV_S]
            or the 2048 x 2048 template of sparse modes 2-4 (SPEC 5). pse_shift: float bias [B or 1, N, Q_S, KV_S].
        actual_seq_lengths, actual_seq_lengths_kv: query / KV lengths per batch (cumulative for TND).
        deq_scale1, quant_scale1, deq_scale2: full int8 attention (SPEC 11); quant_scale2, quant_offset2: int8
            output (SPEC 12).
        num_heads, num_key_value_heads (0 = num_heads), scale_value, input_layout: as the fused function.
        pre_tokens, next_tokens: the band of keys each query sees; next_tokens defaults to 0 here (causal with
            sparse_mode 0).
        sparse_mode: as the fused function; 10-14 mean "high precision" with sparse_mode - 10.

    Returns:
        attention_out in the query's layout (value head dim), dtype of the query (int8 when quantized).
    """
    args = dict(locals())
    problem = parse.parse_prompt(args)
    out, _ = _run(problem)
    return out


def npu_fused_infer_attention_score_v2(
        query: Tensor, key: KV, value: KV, *, query_rope: Opt = None, key_rope: Opt = None, pse_shift: Opt = None,
        atten_mask: Opt = None, actual_seq_qlen: Lengths = None, actual_seq_kvlen: Lengths = None,
        block_table: Opt = None, dequant_scale_query: Opt = None, dequant_scale_key: Opt = None,
        dequant_offset_key: Opt = None, dequant_scale_value: Opt = None, dequant_offset_value: Opt = None,
        dequant_scale_key_rope: Opt = None, quant_scale_out: Opt = None, quant_offset_out: Opt = None,
        quant_scale_p: Opt = None, learnable_sink: Opt = None, num_query_heads: int = 1, num_key_value_heads: int = 0,
        softmax_scale: float = 1.0, pre_tokens: int = _INT_MAX, next_tokens: int = _INT_MAX, input_layout: str = "BSH",
        sparse_mode: int = 0, block_size: int = 0, query_quant_mode: int = 0, key_quant_mode: int = 0,
        value_quant_mode: int = 0, inner_precise: int = 0, return_softmax_lse: bool = False,
        query_dtype: Optional[int] = None, key_dtype: Optional[int] = None, value_dtype: Optional[int] = None,
        query_rope_dtype: Optional[int] = None, key_rope_dtype: Optional[int] = None,
        key_shared_prefix_dtype: Optional[int] = None, value_shared_prefix_dtype: Optional[int] = None,
        dequant_scale_query_dtype: Optional[int] = None, dequant_scale_key_dtype: Optional[int] = None,
        dequant_scale_value_dtype: Optional[int] = None, dequant_scale_key_rope_dtype: Optional[int] = None,
        out_dtype: Optional[int] = None, **unknown) -> Tuple[Tensor, Tensor]:
    """FusedInferAttentionScoreV4 under its newer names (SPEC 1.1b). Returns (attention_out, softmax_lse).

    Args:
        query, key, value, query_rope, key_rope, pse_shift, atten_mask, block_table, block_size, input_layout,
            sparse_mode, pre_tokens, next_tokens, inner_precise: as `npu_fused_infer_attention_score`.
        actual_seq_qlen, actual_seq_kvlen: the query / KV lengths (that function's actual_seq_lengths[_kv]).
        dequant_scale_query, query_quant_mode: int8 query dequantization.
        dequant_scale_key / dequant_offset_key / dequant_scale_value / dequant_offset_value, key_quant_mode,
            value_quant_mode: K / V dequantization (its key_/value_antiquant_* arguments, SPEC 10.2).
        dequant_scale_key_rope, quant_scale_p: reserved (None only). quant_scale_out, quant_offset_out: int8
            output (SPEC 12).
        learnable_sink: float [N] per-head sink logits joining every row's softmax (SPEC 1.1b).
        num_query_heads, num_key_value_heads (0 = num_query_heads), softmax_scale: heads and scale.
        return_softmax_lse: also return the log-sum-exp of every row.
        *_dtype: reserved dtype overrides of torch_npu; only None is accepted.
        out_dtype: the output dtype (a torch_npu dtype number, e.g. 5 float16 / 15 bfloat16 / 1 int8, or a
            torch.dtype): float16 or bfloat16 for an int8 query, int8 with quant_scale_out; otherwise only the
            output's own dtype. None: SPEC 13's rule.

    Returns:
        attention_out as the fused function's; softmax_lse float32 [B, N, Q_S, 1] ([T, N, 1] for TND) when
        return_softmax_lse, else a (1,) float32 zero tensor.
    """
    args = dict(locals())
    problem = v2_problem(args)
    return v2_results(problem, *_run(problem))


def npu_attention_update(lse: Sequence[Tensor], local_out: Sequence[Tensor],
                         update_type: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
    """Merge partial attention results of the same rows over disjoint key sets (SPEC 1.1b), as
    context-parallel decoding does.

    Args:
        lse: K float32 tensors [R], each partial result's log-sum-exp (+inf: a partial that saw no key).
        local_out: K tensors [R, D], the partial outputs (float16 / bfloat16 / float32).
        update_type: 0 returns the merged output alone, 1 also the merged lse.

    Returns:
        (out [R, D] in local_out's dtype, lse_out [R] float32 when update_type == 1 else None).
    """
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


# ---------------------------------------------------------------------------------- graph-capture output allocation
def _npu_fused_infer_attention_score_infer_output(
        query: Tensor, value: Tensor, *, input_layout: str = "BSH", quant_scale2: Opt = None,
        block_table: Opt = None, num_heads: int = 1, num_key_value_heads: int = 0, softmax_lse_flag: bool = False,
        query_rope: Opt = None) -> Tuple[Tensor, Tensor]:
    """The outputs npu_fused_infer_attention_score would return, allocated and not computed (torch_npu's
    graph-capture helper: capture code passes them to ``.out``). Shapes and dtypes from the query, the value
    (its head dim; a paged cache with `block_table`), the layout and the output-dtype arguments (SPEC 13);
    softmax_lse is float32 [B, N, Q_S, 1] ([T, N, 1] for TND layouts) with softmax_lse_flag, else empty [0]."""
    return outputs_alloc(parse.infer_outputs(
        dict(query=query, value=value, input_layout=input_layout, quant_scale2=quant_scale2,
             block_table=block_table, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
             softmax_lse_flag=softmax_lse_flag, query_rope=query_rope),
        "_npu_fused_infer_attention_score_infer_output"), query, (0,))


def _npu_fused_infer_attention_score_v2_infer_output(
        query: Tensor, value: Tensor, *, query_dtype: Optional[int] = None, value_dtype: Optional[int] = None,
        input_layout: str = "BSH", quant_scale_out: Opt = None, block_table: Opt = None, num_query_heads: int = 1,
        num_key_value_heads: int = 0, return_softmax_lse: bool = False, query_rope: Opt = None,
        out_dtype: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """npu_fused_infer_attention_score_v2's outputs, allocated and not computed (torch_npu's signature;
    query_dtype / value_dtype are reserved: None only). With return_softmax_lse off, softmax_lse is the (1,)
    float32 tensor v2 returns (zero-filled)."""
    return outputs_alloc(parse.infer_outputs(
        dict(query=query, value=value, query_dtype=query_dtype, value_dtype=value_dtype, input_layout=input_layout,
             quant_scale2=quant_scale_out, block_table=block_table, num_heads=num_query_heads,
             num_key_value_heads=num_key_value_heads, softmax_lse_flag=return_softmax_lse, query_rope=query_rope,
             out_dtype=out_dtype),
        "_npu_fused_infer_attention_score_v2_infer_output", v2=True), query, (1,))


def outputs_alloc(spec, query: Tensor, no_lse: tuple) -> Tuple[Tensor, Tensor]:
    """(out shape, out dtype, lse shape or None) -> uninitialized tensors on the query's device; the lse
    stand-in without the flag is zero-filled (`no_lse`: its shape)."""
    shape, dtype, lse_shape = spec
    out = query.new_empty(shape, dtype=dtype)
    lse = query.new_empty(lse_shape, dtype=torch.float32) if lse_shape is not None else \
        query.new_zeros(no_lse, dtype=torch.float32)
    return out, lse
