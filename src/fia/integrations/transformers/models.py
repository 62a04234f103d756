"""What some model families hand the attention function beyond a Llama-style call, mapped onto FIA's arguments.

- Attention sinks (gpt-oss passes ``s_aux``: one learnable logit per query head, concatenated to each row's scores
  before the softmax and dropped after it) are FIA's ``learnable_sink`` (SPEC 1.1b: the same formula), which only
  ``npu_fused_infer_attention_score_v2`` takes. _v2 has no padding sizes, so a left-padded mask goes in as FIA's
  general mask there; every other mask keeps its lengths / sparse mode plan (band mode 4 for sliding layers).
- A value head dim Dv different from the query / key one D (DeepSeek-V3's MLA: nope 128 + rope 64 vs value 128),
  DECISIONS 48: a call that runs in portable mode anyway (float32, or the caller's portable mode) splits query /
  key into [..., :Dv] and FIA's ``query_rope`` / ``key_rope`` (no copy); a strict-mode call (bf16 / fp16 by
  default) zero-pads the narrower side to one head dim, which the NPU's BNSD rules accept, and the caller cuts
  the output back to Dv. Both are exact: zero channels add nothing to a score and give output channels of 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fia

from .common import call_fia, call_fia_v2, unsupported
from .masks import general_plan

# the keys of a mask plan (masks.mask_plan) that a general mask replaces
_MASK_KEYS = ("actual_seq_lengths_kv", "kv_padding_size", "sparse_mode", "pre_tokens", "next_tokens", "atten_mask")


def sink_kw(sinks, num_heads: int, q_dtype: torch.dtype) -> dict:
    """{"learnable_sink": sinks [N]} for FIA (float32 or the query dtype, SPEC 1.1b); {} without sinks."""
    if sinks is None:
        return {}
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != num_heads:
        unsupported(f"attention sinks (s_aux) of shape {tuple(getattr(sinks, 'shape', ()))}",
                    f"FIA's learnable_sink is one logit per query head, shape ({num_heads},)")
    s = sinks.detach()
    return {"learnable_sink": s if s.dtype == q_dtype else s.float()}


def sink_plan(sinks: torch.Tensor, num_heads: int, q_dtype: torch.dtype, kw: dict, attention_mask, q_len: int,
              kv_len: int) -> dict:
    """kw (a mask plan) with ``learnable_sink`` = `sinks` [N]; a left-padded plan becomes the general mask."""
    sink = sink_kw(sinks, num_heads, q_dtype)
    if "kv_padding_size" in kw:                         # _v2 cannot take padding sizes: the mask itself
        kw = {k: v for k, v in kw.items() if k not in _MASK_KEYS}
        kw.update(general_plan(attention_mask, q_len, kv_len))
    kw.update(sink)
    return kw


def call(query, key, value, kw: dict, portable: bool = False, guard=None, lane=None):
    """call_fia (with its replay guard and lane), or call_fia_v2 when kw has learnable_sink (only _v2 takes it)."""
    if "learnable_sink" in kw:
        return call_fia_v2(query, key, value, kw, portable)
    return call_fia(query, key, value, kw, portable, guard, lane)


def fit_head_dims(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict):
    """(query, key, value, portable) for a call whose value head dim differs from the query / key one (DECISIONS
    48); query / key [B, N, S, D], value [B, KV_N, S_kv, Dv]. The output's channels past Dv are 0: cut them."""
    d, dv = query.shape[-1], value.shape[-1]
    if dv == d:
        return query, key, value, False
    portable = query.dtype == torch.float32 or fia.get_validation_mode() == "portable"
    if dv < d and portable and key.dtype != torch.int8:
        kw.update(query_rope=query[..., dv:], key_rope=key[..., dv:])     # q.k = q[:Dv].k[:Dv] + q[Dv:].k[Dv:]
        return query[..., :dv], key[..., :dv], value, True
    if dv < d:                       # strict: MLA's rope split is TND-only there (SPEC 14b.3); D itself is fine
        return query, key, F.pad(value, (0, d - dv)), False
    return F.pad(query, (0, dv - d)), F.pad(key, (0, dv - d)), value, False
