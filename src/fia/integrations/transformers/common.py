"""What the integration's modules share: its error, the template mask of sparse modes 2-4, and the one FIA call."""
from __future__ import annotations

from typing import Optional

import torch

import fia
from fia.replay import Site

NAME = "fia"
# the attention functions registered by register() (name -> function): transformers' patched checks ask it
REGISTERED: dict = {}
_templates: dict = {}                 # device -> the 2048x2048 triu template mask of sparse modes 2-4 (SPEC 5)


class FiaTransformersUnsupported(NotImplementedError):
    """transformers asked for an attention option that FIA cannot express."""


def unsupported(option: str, why: str):
    raise FiaTransformersUnsupported(f"attn_implementation='fia' does not support {option}: {why}. "
                                     "Use attn_implementation='eager' for this model / setting.")


def template(device) -> torch.Tensor:
    t = _templates.get(device)
    if t is None:
        t = _templates[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return t


def call_fia(query, key, value, kw: dict, portable: bool = False, guard: Optional[tuple] = None, lane=None):
    """fia.npu_fused_infer_attention_score (looked up at call time) -> (out, lse). float32 is not an NPU dtype
    (SPEC 1.4): float32 calls run under the portable validation mode, and so do calls the NPU's shape rules do not
    cover (`portable`); float16 / bfloat16 calls in the caller's mode (strict by default: what runs here also
    passes the NPU's checks). `guard`: what kw is made of besides the KV lengths' values and the int8 scales'
    data (fia.replay.Site): a repeated call -- a decode step of every layer -- then replays without its key; `lane`
    (fia.replay.Lane, an FiaCache layer's): without the site's lookup either, while K / V are the same buffers."""
    if portable or query.dtype == torch.float32:
        with fia.validation_mode("portable"):
            return _call(query, key, value, guard, kw, lane)
    return _call(query, key, value, guard, kw, lane)


_PUBLIC = fia.npu_fused_infer_attention_score
_SITE = Site("npu_fused_infer_attention_score", "transformers")


def _call(query, key, value, guard: Optional[tuple], kw: dict, lane=None):
    attn = fia.npu_fused_infer_attention_score
    if guard is None or attn is not _PUBLIC:            # (a wrapped entry point sees every call)
        return attn(query, key, value, **kw)
    return _SITE.call(guard, attn, query, key, value, kw, lane)


def lane_step(query, key, value, kw: dict, guard: tuple, lane):
    """call_fia(query, key, value, kw, guard=guard, lane=lane)'s output where `lane` serves the call (its noted replay,
    fia.replay.Lane.step: a decode step on the layer's buffers), else None -- reading kw's KV lengths and int8
    scales alone: a caller skips building the rest of the call."""
    if fia.npu_fused_infer_attention_score is not _PUBLIC:
        return None
    return lane.step(guard, query, key, value, kw, "portable" if query.dtype == torch.float32 else None)


# npu_fused_infer_attention_score's argument names -> _v2's (learnable sinks exist on _v2 only)
V2_NAMES = {"num_heads": "num_query_heads", "scale": "softmax_scale", "actual_seq_lengths": "actual_seq_qlen",
            "actual_seq_lengths_kv": "actual_seq_kvlen", "key_antiquant_scale": "dequant_scale_key",
            "value_antiquant_scale": "dequant_scale_value", "key_antiquant_mode": "key_quant_mode",
            "value_antiquant_mode": "value_quant_mode"}


def call_fia_v2(query, key, value, kw: dict, portable: bool = False):
    """call_fia through npu_fused_infer_attention_score_v2, kw in the v1 names (V2_NAMES)."""
    attn = fia.npu_fused_infer_attention_score_v2
    kw = {V2_NAMES.get(k, k): v for k, v in kw.items()}
    if portable or query.dtype == torch.float32:
        with fia.validation_mode("portable"):
            return attn(query, key, value, **kw)
    return attn(query, key, value, **kw)
