"""The attention function registered as "fia": transformers' call (as sdpa_attention_forward) -> one FIA call."""
from __future__ import annotations

import math

import torch

from . import batching, models
from .cache import layer_of
from .common import lane_step, template, unsupported
from .masks import mask_plan

# keyword arguments a decode step's guard does not cover (the step then takes the usual path)
_UNGUARDED = frozenset({"kv_padding_size", "atten_mask", "learnable_sink", "query_rope", "key_rope"})
# keyword arguments of a prefill call its guard covers (_prefill_guard): scalars, the lengths, the template mask
_PREFILL_GUARDED = frozenset({"sparse_mode", "pre_tokens", "next_tokens", "actual_seq_lengths_kv", "atten_mask"})
_PREFILL_DATA = frozenset({"actual_seq_lengths_kv", "atten_mask"})     # (in the guard by name, not value)
# keyword arguments transformers passes that no FIA argument depends on: a call with only these may take its lane
_INERT = frozenset({"position_ids", "use_cache", "cache_position"})


def fia_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                          sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature (as sdpa_attention_forward): returns ([B, S, N, Dv], None)."""
    if attention_mask is None and softcap is None and not dropout and _INERT.issuperset(kwargs):
        layer = layer_of(key)                                      # an FiaCache decode step its lane replays
        if layer is not None and layer.lane.state is not None and query.dim() == 4 and query.shape[2] == 1:
            kw, guard = _cache_step(layer, query, key, scaling)
            out = lane_step(query, key, value, kw, guard, layer.lane)
            if out is not None:
                return out.transpose(1, 2), None                   # (the same result as the path below)
    if softcap is not None:
        unsupported(f"attention logit soft-capping (softcap={softcap})", "FIA has no logit soft-capping")
    if dropout and dropout > 0:
        unsupported(f"attention dropout (dropout={dropout})", "FIA is an inference operator; call model.eval()")
    if kwargs.get("output_attentions"):
        unsupported("output_attentions=True", "FIA never materializes attention probabilities")
    if kwargs.get("position_bias") is not None:
        unsupported("position_bias", "pass it as an explicit pse_shift through FIA's API instead")
    if key.dim() != 4 or query.dim() != 4:
        unsupported("non 4-D query/key/value", "expected [B, N, S, D]")
    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        return batching.paged_decode_forward(module, query, key, value, scaling, kwargs)
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None and query.shape[0] == 1:
        return batching.packed_forward(module, query, key, value, scaling, is_causal, sliding_window, kwargs)
    b, n, q_len, d = query.shape
    kv_n, kv_len = key.shape[1], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = float(scaling) if scaling is not None else d ** -0.5
    layer = layer_of(key)                                          # an FiaCache buffer: its length is known
    key_scales, value_scales = (None, None) if layer is None else (layer.key_scales, layer.value_scales)
    if layer is not None and attention_mask is None and q_len == 1:
        kw, _ = _cache_step(layer, query, key, scaling)
    elif layer is not None and attention_mask is None:             # (transformers skipped an all-causal mask)
        kw = {"actual_seq_lengths_kv": [layer.length]}
        if q_len > 1 and causal:
            kw["sparse_mode"] = 3                                  # right-down: the new tokens end the window
    elif layer is not None and attention_mask.shape[-1] < kv_len:     # the mask covers the positions written
        written = attention_mask.shape[-1]
        plan = mask_plan(attention_mask, q_len, written, bool(causal), sliding_window)
        kw = _on_buffers(plan, written, kv_len)
        if kw is None:                                             # a general mask: the buffers cut to its keys
            kv_len = written
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
            if key_scales is not None:
                key_scales, value_scales = key_scales[:, :, :kv_len], value_scales[:, :, :kv_len]
            kw = dict(plan)
    else:
        kw = dict(mask_plan(attention_mask, q_len, kv_len, bool(causal), sliding_window))
    if kwargs.get("s_aux") is not None:                            # gpt-oss: FIA's learnable sinks (SPEC 1.1b)
        kw = models.sink_plan(kwargs["s_aux"], n, query.dtype, kw, attention_mask, q_len, kv_len)
    if kw.get("sparse_mode") in (3, 4):
        kw["atten_mask"] = template(query.device)
    if key.dtype == torch.int8 and "key_antiquant_scale" not in kw:    # an int8 FiaCache's decode step (masked)
        if layer is None or key_scales is None or q_len != 1:
            unsupported("int8 key / value states", "only an int8 FiaCache's decode steps pass them (with its scales)")
        kw.update(key_antiquant_scale=key_scales, value_antiquant_scale=value_scales,
                  key_antiquant_mode=3, value_antiquant_mode=3)   # per token and KV head, [B, KV_N, capacity]
    layout = "BNSD_BSND" if q_len > 1 else "BNSD"
    dv = value.shape[-1]
    query, key, value, portable = models.fit_head_dims(query, key, value, kw)     # DeepSeek-V3: D 192, Dv 128
    guard = None
    if q_len == 1 and not portable and _UNGUARDED.isdisjoint(kw):      # a decode step: fia.replay.Site's guard
        guard = _guard(n, kv_n, scale, kw)
    elif q_len > 1 and not portable and _PREFILL_GUARDED.issuperset(kw) and \
            kw.get("atten_mask", tmpl := template(query.device)) is tmpl:   # a prefill call repeated by every layer
        guard = _prefill_guard(n, kv_n, scale, kw)
    kw.update(num_heads=n, num_key_value_heads=kv_n, input_layout=layout, scale=scale)
    out, _ = models.call(query, key, value, kw, portable, guard, None if layer is None or q_len > 1 else layer.lane)
    if out.shape[-1] != dv:
        out = out[..., :dv]                                        # the zero-padded value channels
    if q_len == 1:
        out = out.transpose(1, 2)                                  # [B, N, 1, D] -> [B, 1, N, D] (no copy)
    return out, None


def _guard(n: int, kv_n: int, scale: float, kw: dict) -> tuple:
    """fia.replay.Site's guard of a decode step's call: everything kw is made of but the KV lengths' values and the
    int8 scales' data (their metadata is in)."""
    lens = kw.get("actual_seq_lengths_kv")
    guard = (n, kv_n, scale, math.copysign(1.0, scale), tuple(kw), None if lens is None else len(lens))
    ks = kw.get("key_antiquant_scale")
    if ks is not None:
        vs = kw["value_antiquant_scale"]
        guard += (ks.shape, ks.stride(), vs.shape, vs.stride())
    return guard


def _prefill_guard(n: int, kv_n: int, scale: float, kw: dict) -> tuple:
    """fia.replay.Site's guard of a prefill call whose kw holds only scalars, a KV lengths list (its values are the
    replay's to check) and the template mask (the one object `template` hands out): all of them but the lengths."""
    lens = kw.get("actual_seq_lengths_kv")
    return (n, kv_n, scale, math.copysign(1.0, scale), tuple(kw), None if lens is None else len(lens),
            *(x for name, x in kw.items() if name not in _PREFILL_DATA))


def _cache_step(layer, query: torch.Tensor, key: torch.Tensor, scaling) -> tuple:
    """(kw, guard) of an FiaCache layer's decode step without a mask, before the call's common arguments: its length
    (the buffers' unused tail is right padding); an int8 layer's scales, per token and KV head [B, KV_N, capacity]."""
    kw = {"actual_seq_lengths_kv": [layer.length]}
    if key.dtype == torch.int8 and layer.key_scales is not None:
        kw.update(key_antiquant_scale=layer.key_scales, value_antiquant_scale=layer.value_scales,
                  key_antiquant_mode=3, value_antiquant_mode=3)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return kw, _guard(query.shape[1], key.shape[1], scale, kw)


def _on_buffers(plan: dict, written: int, capacity: int):
    """A mask plan over the `written` positions of an FiaCache layer, for its buffers of `capacity` positions (the
    same call signature every step): padding sizes count from the buffers' end, no lengths means all written
    ones. None for a general mask (its width is the mask's)."""
    if "atten_mask" in plan:
        return None
    kw = dict(plan)
    if "kv_padding_size" in kw:
        kw["kv_padding_size"] = kw["kv_padding_size"] + (capacity - written)
    elif "actual_seq_lengths_kv" not in kw:
        kw["actual_seq_lengths_kv"] = [written]
    return kw
