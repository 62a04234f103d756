"""Continuous batching (``model.generate_batch``, transformers' ``PagedAttentionCache``): packed prefill / mixed batches
as one TND call, the block-table decode path on the page pool in place, and the two transformers checks that let
"fia" through."""
from __future__ import annotations

import math

import torch

from . import models
from .common import REGISTERED, template, unsupported


def _cu_lengths(cu, module, what: str) -> list:
    if isinstance(cu, dict):                                      # per layer type (hybrid models), not yet selected
        cu = cu.get(getattr(module, "layer_type", None) or "full_attention", None) if len(cu) > 1 else \
            next(iter(cu.values()))
        if cu is None:
            unsupported(f"{what} per layer type without the module's layer_type", "cannot pick the layer's lengths")
    return [int(x) for x in cu[1:].tolist()]


def packed_forward(module, query, key, value, scaling, is_causal, sliding_window, kwargs):
    """Continuous batching (``generate_batch``): the requests' query tokens packed into query [1, N, T, D], their K/V
    (read back from transformers' PagedAttentionCache) packed into key / value [1, KV_N, T_kv, D], with cumulative
    ``cu_seq_lens_q`` / ``cu_seq_lens_k``. One FIA call in TND layout: cumulative lengths, right-down causal per
    request (sparse_mode 3; 4 with a sliding window), the block-diagonal mask never materialized."""
    n, d = query.shape[1], query.shape[3]
    kv_n = key.shape[1]
    cu_q = _cu_lengths(kwargs["cu_seq_lens_q"], module, "cu_seq_lens_q")
    cu_k = _cu_lengths(kwargs["cu_seq_lens_k"], module, "cu_seq_lens_k")
    if len(cu_q) != len(cu_k):
        unsupported("cu_seq_lens_q / cu_seq_lens_k of different batch sizes", f"{len(cu_q)} vs {len(cu_k)}")
    t, t_kv = cu_q[-1], cu_k[-1]
    q = query[0, :, :t].transpose(0, 1)                            # [T, N, D] views, no copy
    k = key[0, :, :t_kv].transpose(0, 1)
    v = value[0, :, :t_kv].transpose(0, 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kw = dict(actual_seq_lengths=cu_q, actual_seq_lengths_kv=cu_k)
    if causal:
        kw["sparse_mode"], kw["atten_mask"] = 3, template(query.device)
        if sliding_window:
            kw["sparse_mode"], kw["pre_tokens"], kw["next_tokens"] = 4, int(sliding_window) - 1, 0
    scale = float(scaling) if scaling is not None else d ** -0.5
    kw.update(models.sink_kw(kwargs.get("s_aux"), n, query.dtype))           # gpt-oss
    kw.update(num_heads=n, num_key_value_heads=kv_n, input_layout="TND", scale=scale)
    out, _ = models.call(q, k, v, kw)
    if t < query.shape[2]:                                         # padded query tokens (static shapes): zeros
        out = torch.cat([out, out.new_zeros(query.shape[2] - t, n, out.shape[-1])])
    return out.unsqueeze(0), None                                  # [1, T, N, Dv]


def paged_decode_forward(module, query, key, value, scaling, kwargs):
    """Continuous batching's decode fast path: one new token per request (query / key / value [1, N|KV_N, B, D]),
    the PagedAttentionCache's page pool of this layer (k_cache / v_cache [num_pages, page_size, KV_N, D]),
    ``block_table`` [B, max_pages] and cumulative ``cu_seq_lens_k``. As flash_attn_with_kvcache, the new K/V are
    written into their page slot; then one FIA call reads the pool in place (SPEC 8): key / value as the BSH block
    pool [num_pages, page_size, KV_N*D], block_table int32, per-request actual_seq_lengths_kv, block_size."""
    k_cache, v_cache, table = kwargs["k_cache"], kwargs["v_cache"], kwargs["block_table"]
    n, b, d = query.shape[1], query.shape[2], query.shape[3]
    kv_n, page = key.shape[1], k_cache.shape[1]
    if v_cache.shape[-1] != k_cache.shape[-1]:
        unsupported(f"a value head dim {v_cache.shape[-1]} with query / key head dim {k_cache.shape[-1]} on the "
                    "block-table decode path", "FIA's paged BSH pool needs one head dim (SPEC 2)")
    lengths, slots, offs, table32, live = _decode_step(module, kwargs["cu_seq_lens_k"], table, b, page)
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)              # [B, KV_N, D]
    if live is not None:
        new_k, new_v = new_k[live], new_v[live]
    k_cache[slots, offs] = new_k.to(k_cache.dtype)                               # into the page slots
    v_cache[slots, offs] = new_v.to(v_cache.dtype)
    q = query[0].transpose(0, 1).reshape(b, 1, n * d)                              # BSH [B, 1, N*D]
    kp = k_cache.reshape(k_cache.shape[0], page, -1)                               # [num_pages, page_size, KV_N*D]
    vp = v_cache.reshape(v_cache.shape[0], page, -1)
    kw = dict(num_heads=n, num_key_value_heads=kv_n, input_layout="BSH", block_table=table32,
              block_size=page, actual_seq_lengths_kv=lengths,
              scale=float(scaling) if scaling is not None else d ** -0.5)
    kw.update(models.sink_kw(kwargs.get("s_aux"), n, query.dtype))           # gpt-oss
    guard = None                                   # (fia.replay.Site: what kw is made of but the lengths' values)
    if "learnable_sink" not in kw:
        guard = ("paged", tuple(kw), n, kv_n, page, kw["scale"], math.copysign(1.0, kw["scale"]), len(lengths),
                 table32.dtype, table32.shape, table32.stride())
    out, _ = models.call(q, kp, vp, kw, guard=guard)
    return out.view(1, b, n, -1), None                                             # [1, T = B, N, Dv]


_last_step: list = [None]      # [(key, step)]: the layers of one decode step share it (_decode_step)


def _decode_step(module, cu, table, b: int, page: int):
    """What a block-table decode step's layers share: per-request KV lengths, the page slot (page, offset) of each
    request's new token, the int32 block table and the live requests (None: all). Computed by the first layer and
    reused while the step's ``cu_seq_lens_k`` and ``block_table`` (held here, so their ids stay theirs) are
    unchanged (their _version counters: an in-place update makes it anew)."""
    cu_t = cu.get(getattr(module, "layer_type", None) or "full_attention", None) if isinstance(cu, dict) else cu
    key = (id(cu_t), cu_t._version, id(table), table._version, b, page) if isinstance(cu_t, torch.Tensor) else None
    last = _last_step[0]
    if key is not None and last is not None and last[0] == key:
        return last[2]
    cu_k = _cu_lengths(cu, module, "cu_seq_lens_k")
    lengths = [hi - lo for lo, hi in zip([0] + cu_k[:-1], cu_k)]
    if len(lengths) != b:
        unsupported("a block-table batch with several query tokens per request", f"{b} tokens, {len(lengths)} requests")
    dev = table.device
    pos = torch.tensor([max(x - 1, 0) for x in lengths], dtype=torch.long, device=dev)
    slots = table[torch.arange(b, device=dev), pos // page].long()
    offs = pos % page
    live = None
    if not all(lengths):
        live = torch.tensor([x > 0 for x in lengths], device=dev)
        slots, offs = slots[live], offs[live]
    step = (lengths, slots, offs, table.to(torch.int32), live)
    _last_step[0] = (key, (cu_t, table), step)
    return step


def _enable_decode_fast_path(initialization) -> None:
    """transformers turns the block-table decode path off unless flash-attention 2/3 runs on CUDA / XPU; keep it
    (the configured max_blocks_per_request) for "fia", whose paged KV path reads the page pool in place."""
    original = initialization.ensure_decode_fast_path_is_available
    if getattr(original, "_fia", False):
        return

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if REGISTERED.get(getattr(config, "_attn_implementation", None)) is not None:
            return None
        return original(config, cb_config, user_requested)

    ensure_decode_fast_path_is_available._fia = True
    ensure_decode_fast_path_is_available.__wrapped__ = original
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def allow_continuous_batching() -> None:
    """transformers' ContinuousBatchingManager accepts only "sdpa", "paged|eager" and flash implementations (a
    registered name containing "flash" is refused earlier, as an unknown flash kernel). Let it keep "fia": with it
    transformers builds no block-diagonal mask and passes cu_seq_lens_q / cu_seq_lens_k, which _packed_forward maps
    onto FIA's TND layout. Idempotent; other implementations go through transformers' own check unchanged."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:                                           # pragma: no cover - depends on the version
        return
    from transformers.generation.continuous_batching import initialization
    _enable_decode_fast_path(initialization)
    original = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(original, "_fia", False):
        return

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl is not None and REGISTERED.get(impl) is not None:
            return
        return original(self, model, auto_switch_to_flash)

    switch_to_cb_friendly_attn._fia = True
    switch_to_cb_friendly_attn.__wrapped__ = original
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


