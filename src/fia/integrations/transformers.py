"""FIA as the attention of Hugging Face transformers models: ``attn_implementation="fia"``.

    import fia.integrations.transformers          # registers "fia" (idempotent; also: register())
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fia")   # or from_pretrained(...)
    model.generate(...)                           # prefill and every decode step run fia.npu_fused_infer_attention_score

Supported transformers versions: ``SUPPORTED_TRANSFORMERS`` (tested with 5.24); importing this module with another
version raises ImportError naming the installed and the supported versions. Install with ``pip install fia[transformers]``.

What the attention function receives (as ``transformers.integrations.sdpa_attention``: query [B, N, S, D], key /
value [B, KV_N, S_kv, D] with GQA not repeated, a 4-D mask or None, ``scaling``, ``sliding_window`` ...) is mapped
onto FIA's arguments (SPEC 2, 4, 5) without materializing what FIA expresses natively:

- no mask, causal prefill -> ``sparse_mode=3`` (right-down causal; the 2048x2048 template mask);
- a mask that is causal (or full) attention over one contiguous key window per batch -- left padding, right padding
  of the keys, a static cache's unused tail, a sliding window -- is detected (once per mask tensor, shared by the
  layers) and becomes per-batch ``actual_seq_lengths_kv`` (+ ``kv_padding_size`` for left padding), with
  ``sparse_mode=3``, or ``sparse_mode=4`` (band, ``pre_tokens = sliding_window - 1``, ``next_tokens = 0``) for
  sliding-window layers (Mistral); decode steps (Q_S = 1) need only the KV window;
- any other mask is passed as a general ``atten_mask`` (bool, True = masked), the same for all heads;
- GQA: ``num_key_value_heads`` = KV_N, K/V never repeated; ``scale`` = the module's ``scaling``.

Options FIA cannot express raise ``FiaTransformersUnsupported`` naming the option (never a silently wrong result):
attention logit soft-capping (``softcap``), dropout > 0, ``output_attentions``, ``position_bias``, attention sinks
(``s_aux``), per-head masks, additive float masks that are not 0 / -inf.

float32 models: float32 is not an NPU dtype, so FIA's strict validation (SPEC 1.4) would refuse it; the integration
runs float32 calls under ``fia.validation_mode("portable")``. float16 / bfloat16 calls run in the caller's mode
(strict by default: what runs here also passes the NPU's checks).

Continuous batching (``model.generate_batch``, transformers' ``PagedAttentionCache``): a batch of packed requests
(query [1, N, T, D], K/V read back from the cache, ``cu_seq_lens_q`` / ``cu_seq_lens_k``) is one TND call with
cumulative lengths and sparse mode 3 / 4; the block-table decode path (one token per request, ``block_table``,
``k_cache`` / ``v_cache`` page pools) writes the new K/V into their page slots and runs FIA's paged KV path on the
pool in place (BSH [num_pages, page_size, KV_N*D], ``block_size`` = page_size). transformers 5.24 lets only "sdpa",
"paged|eager" and flash kernels into continuous batching and its block-table path only flash-attention on CUDA /
XPU: register() wraps ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` and
``continuous_batching.initialization.ensure_decode_fast_path_is_available`` so that a name registered here passes
both (every other implementation goes through transformers' code unchanged).
"""
from __future__ import annotations

import weakref

import torch

import fia
from fia.caches import BoundedCache

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
TESTED_TRANSFORMERS = ("5.24.0",)
NAME = "fia"


class FiaTransformersUnsupported(NotImplementedError):
    """transformers asked for an attention option that FIA cannot express."""


def check_version(version: str) -> None:
    """Raise ImportError unless transformers `version` is in SUPPORTED_TRANSFORMERS."""
    from packaging.version import Version
    if not (Version("5.0") <= Version(version) < Version("6")):
        raise ImportError(f"fia.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} "
                          f"(tested: {', '.join(TESTED_TRANSFORMERS)}); installed: {version}. "
                          "Install a supported version: pip install 'fia[transformers]'")


try:
    import transformers as _transformers
except ImportError as e:                                          # pragma: no cover - depends on the environment
    raise ImportError("fia.integrations.transformers needs transformers "
                      f"{SUPPORTED_TRANSFORMERS}: pip install 'fia[transformers]'") from e
check_version(_transformers.__version__)

_templates: dict = {}                 # device -> the 2048x2048 triu template mask of sparse modes 2-4 (SPEC 5)
# id(mask) -> (weakref(mask), key, plan): one analysis per mask tensor, shared by the layers of a forward
_plans = BoundedCache("transformers.mask_plans", 17)


def _template(device) -> torch.Tensor:
    t = _templates.get(device)
    if t is None:
        t = _templates[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return t


def _unsupported(option: str, why: str):
    raise FiaTransformersUnsupported(f"attn_implementation='fia' does not support {option}: {why}. "
                                     "Use attn_implementation='eager' for this model / setting.")


def _allowed(mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The 4-D mask as bool, True = may attend (transformers' convention), cut to the keys given."""
    if mask.dim() != 4:
        _unsupported(f"a {mask.dim()}-D attention mask", "transformers hands attention functions 4-D masks")
    mask = mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0
    finite_min = torch.finfo(mask.dtype).min
    allowed = mask > finite_min / 2
    if not bool(torch.all(mask[allowed] == 0)):
        _unsupported("an additive float attention bias", "the float mask holds values other than 0 and -inf/min")
    return allowed


def _plan_from_mask(allowed: torch.Tensor, q_len: int, kv_len: int, causal: bool, window):
    """FIA arguments that reproduce `allowed` [B, H, Q, KV] exactly: lengths + sparse mode when the mask is causal /
    full / banded attention over one contiguous key window per batch, else the general mask."""
    if allowed.shape[1] != 1:
        if not bool(torch.all(allowed == allowed[:, :1])):
            _unsupported("per-head attention masks", "FIA's atten_mask is shared by all heads (SPEC 5)")
        allowed = allowed[:, :1]
    a = allowed[:, 0]                     # batch 1 (broadcast) stays 1: FIA applies one-entry lengths to every batch
    dev = a.device
    cols = a.any(1)                                                # [B, KV]: keys some row attends
    j = torch.arange(kv_len, device=dev)
    lo = torch.where(cols, j, kv_len).amin(-1)
    hi = torch.where(cols, j + 1, 0).amax(-1)
    empty = hi == 0
    lo = torch.where(empty, kv_len, lo)
    hi = torch.where(empty, kv_len, hi)
    jj, lo3, hi3 = j.view(1, 1, -1), lo.view(-1, 1, 1), hi.view(-1, 1, 1)
    window_keys = (jj >= lo3) & (jj < hi3)

    found = None
    if q_len == 1:                                                 # decode: a key window is all there is (SPEC 5)
        if torch.equal(window_keys, a):
            found = (False, None)
    else:
        ii = torch.arange(q_len, device=dev).view(1, -1, 1)
        diag = ii + (hi3 - q_len)                                  # right-down diagonal of each batch's window
        pre = None if not window else int(window) - 1
        cands = [(True, pre), (True, None), (False, None)] if causal else [(False, None), (True, None)]
        for is_causal, p in dict.fromkeys(cands):
            exp = window_keys
            if is_causal:
                exp = exp & (jj <= diag)
                if p is not None:
                    exp = exp & (jj >= diag - p)
            if torch.equal(exp, a):
                found = (is_causal, p)
                break
    if found is None:                                              # a general mask: FIA's convention, True = masked
        m = ~a
        return {"atten_mask": (m.unsqueeze(1) if q_len > 1 else m.view(m.shape[0], 1, 1, -1)).contiguous()}
    is_causal, p = found
    plan = {}
    lo_l, hi_l = lo.tolist(), hi.tolist()
    if any(lo_l):                                                  # left padding: window [KV - pad - act, KV - pad)
        plan["actual_seq_lengths_kv"] = [h - lo_ for lo_, h in zip(lo_l, hi_l)]
        plan["kv_padding_size"] = torch.tensor([kv_len - h for h in hi_l], dtype=torch.int64, device=dev)
    elif any(h != kv_len for h in hi_l):                           # right padding / a static cache's unused tail
        plan["actual_seq_lengths_kv"] = hi_l
    if q_len > 1 and is_causal:
        plan["sparse_mode"] = 3 if p is None else 4
        if p is not None:
            plan["pre_tokens"], plan["next_tokens"] = p, 0
    return plan


def _mask_plan(mask, q_len: int, kv_len: int, causal: bool, window) -> dict:
    if mask is None:
        if q_len == 1 or not causal:
            return {}
        if kv_len > q_len:            # transformers skips the mask only for an empty static cache: upper-left causal
            return {"sparse_mode": 3, "actual_seq_lengths_kv": [q_len]}
        return {"sparse_mode": 3}
    key = (mask._version, tuple(mask.shape), mask.data_ptr(), q_len, kv_len, causal, window)
    hit = _plans.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    plan = _plan_from_mask(_allowed(mask, kv_len), q_len, kv_len, causal, window)
    _plans.put(id(mask), (weakref.ref(mask), key, plan))
    return plan


def fia_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                          sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature (as sdpa_attention_forward): returns ([B, S, N, Dv], None)."""
    if softcap is not None:
        _unsupported(f"attention logit soft-capping (softcap={softcap})", "FIA has no logit soft-capping")
    if dropout and dropout > 0:
        _unsupported(f"attention dropout (dropout={dropout})", "FIA is an inference operator; call model.eval()")
    if kwargs.get("output_attentions"):
        _unsupported("output_attentions=True", "FIA never materializes attention probabilities")
    if kwargs.get("position_bias") is not None:
        _unsupported("position_bias", "pass it as an explicit pse_shift through FIA's API instead")
    if kwargs.get("s_aux") is not None:
        _unsupported("attention sinks (s_aux)", "not mapped by this integration")
    if key.dim() != 4 or query.dim() != 4:
        _unsupported("non 4-D query/key/value", "expected [B, N, S, D]")
    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        return _paged_decode_forward(module, query, key, value, scaling, kwargs)
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None and query.shape[0] == 1:
        return _packed_forward(module, query, key, value, scaling, is_causal, sliding_window, kwargs)
    b, n, q_len, d = query.shape
    kv_n, kv_len = key.shape[1], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = float(scaling) if scaling is not None else d ** -0.5
    plan = _mask_plan(attention_mask, q_len, kv_len, bool(causal), sliding_window)
    kw = dict(plan)
    if kw.get("sparse_mode") in (3, 4):
        kw["atten_mask"] = _template(query.device)
    layout = "BNSD_BSND" if q_len > 1 else "BNSD"
    attn = fia.npu_fused_infer_attention_score                    # the public API, looked up at call time
    if query.dtype == torch.float32:
        with fia.validation_mode("portable"):                     # float32 is not an NPU dtype (SPEC 1.4)
            out, _ = attn(query, key, value, num_heads=n, num_key_value_heads=kv_n, input_layout=layout,
                          scale=scale, **kw)
    else:
        out, _ = attn(query, key, value, num_heads=n, num_key_value_heads=kv_n, input_layout=layout,
                      scale=scale, **kw)
    if q_len == 1:
        out = out.transpose(1, 2)                                  # [B, N, 1, D] -> [B, 1, N, D] (no copy)
    return out, None


def _cu_lengths(cu, module, what: str) -> list:
    if isinstance(cu, dict):                                      # per layer type (hybrid models), not yet selected
        cu = cu.get(getattr(module, "layer_type", None) or "full_attention", None) if len(cu) > 1 else \
            next(iter(cu.values()))
        if cu is None:
            _unsupported(f"{what} per layer type without the module's layer_type", "cannot pick the layer's lengths")
    return [int(x) for x in cu[1:].tolist()]


def _packed_forward(module, query, key, value, scaling, is_causal, sliding_window, kwargs):
    """Continuous batching (``generate_batch``): the requests' query tokens packed into query [1, N, T, D], their K/V
    (read back from transformers' PagedAttentionCache) packed into key / value [1, KV_N, T_kv, D], with cumulative
    ``cu_seq_lens_q`` / ``cu_seq_lens_k``. One FIA call in TND layout: cumulative lengths, right-down causal per
    request (sparse_mode 3; 4 with a sliding window), the block-diagonal mask never materialized."""
    n, d = query.shape[1], query.shape[3]
    kv_n = key.shape[1]
    cu_q = _cu_lengths(kwargs["cu_seq_lens_q"], module, "cu_seq_lens_q")
    cu_k = _cu_lengths(kwargs["cu_seq_lens_k"], module, "cu_seq_lens_k")
    if len(cu_q) != len(cu_k):
        _unsupported("cu_seq_lens_q / cu_seq_lens_k of different batch sizes", f"{len(cu_q)} vs {len(cu_k)}")
    t, t_kv = cu_q[-1], cu_k[-1]
    q = query[0, :, :t].transpose(0, 1)                            # [T, N, D] views, no copy
    k = key[0, :, :t_kv].transpose(0, 1)
    v = value[0, :, :t_kv].transpose(0, 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kw = dict(actual_seq_lengths=cu_q, actual_seq_lengths_kv=cu_k)
    if causal:
        kw["sparse_mode"], kw["atten_mask"] = 3, _template(query.device)
        if sliding_window:
            kw["sparse_mode"], kw["pre_tokens"], kw["next_tokens"] = 4, int(sliding_window) - 1, 0
    scale = float(scaling) if scaling is not None else d ** -0.5
    attn = fia.npu_fused_infer_attention_score
    if query.dtype == torch.float32:
        with fia.validation_mode("portable"):
            out, _ = attn(q, k, v, num_heads=n, num_key_value_heads=kv_n, input_layout="TND", scale=scale, **kw)
    else:
        out, _ = attn(q, k, v, num_heads=n, num_key_value_heads=kv_n, input_layout="TND", scale=scale, **kw)
    if t < query.shape[2]:                                         # padded query tokens (static shapes): zeros
        out = torch.cat([out, out.new_zeros(query.shape[2] - t, n, out.shape[-1])])
    return out.unsqueeze(0), None                                  # [1, T, N, Dv]


def _paged_decode_forward(module, query, key, value, scaling, kwargs):
    """Continuous batching's decode fast path: one new token per request (query / key / value [1, N|KV_N, B, D]),
    the PagedAttentionCache's page pool of this layer (k_cache / v_cache [num_pages, page_size, KV_N, D]),
    ``block_table`` [B, max_pages] and cumulative ``cu_seq_lens_k``. As flash_attn_with_kvcache, the new K/V are
    written into their page slot; then one FIA call reads the pool in place (SPEC 8): key / value as the BSH block
    pool [num_pages, page_size, KV_N*D], block_table int32, per-request actual_seq_lengths_kv, block_size."""
    k_cache, v_cache, table = kwargs["k_cache"], kwargs["v_cache"], kwargs["block_table"]
    n, b, d = query.shape[1], query.shape[2], query.shape[3]
    kv_n, page = key.shape[1], k_cache.shape[1]
    cu_k = _cu_lengths(kwargs["cu_seq_lens_k"], module, "cu_seq_lens_k")
    lengths = [hi - lo for lo, hi in zip([0] + cu_k[:-1], cu_k)]
    if len(lengths) != b:
        _unsupported("a block-table batch with several query tokens per request", f"{b} tokens, {len(lengths)} requests")
    pos = torch.tensor([max(x - 1, 0) for x in lengths], dtype=torch.long, device=query.device)
    rows = torch.arange(b, device=query.device)
    slots = table[rows, pos // page].long()
    live = torch.tensor([x > 0 for x in lengths], device=query.device)
    slots, offs = slots[live], (pos % page)[live]
    k_cache[slots, offs] = key[0].transpose(0, 1)[live].to(k_cache.dtype)       # [B, KV_N, D] into the page slots
    v_cache[slots, offs] = value[0].transpose(0, 1)[live].to(v_cache.dtype)
    q = query[0].transpose(0, 1).reshape(b, 1, n * d)                              # BSH [B, 1, N*D]
    kp = k_cache.reshape(k_cache.shape[0], page, -1)                               # [num_pages, page_size, KV_N*D]
    vp = v_cache.reshape(v_cache.shape[0], page, -1)
    kw = dict(num_heads=n, num_key_value_heads=kv_n, input_layout="BSH", block_table=table.to(torch.int32),
              block_size=page, actual_seq_lengths_kv=lengths,
              scale=float(scaling) if scaling is not None else d ** -0.5)
    attn = fia.npu_fused_infer_attention_score
    if query.dtype == torch.float32:
        with fia.validation_mode("portable"):
            out, _ = attn(q, kp, vp, **kw)
    else:
        out, _ = attn(q, kp, vp, **kw)
    return out.view(1, b, n, -1), None                                             # [1, T = B, N, Dv]


def _enable_decode_fast_path(initialization) -> None:
    """transformers turns the block-table decode path off unless flash-attention 2/3 runs on CUDA / XPU; keep it
    (the configured max_blocks_per_request) for "fia", whose paged KV path reads the page pool in place."""
    original = initialization.ensure_decode_fast_path_is_available
    if getattr(original, "_fia", False):
        return

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if _REGISTERED.get(getattr(config, "_attn_implementation", None)) is fia_attention_forward:
            return None
        return original(config, cb_config, user_requested)

    ensure_decode_fast_path_is_available._fia = True
    ensure_decode_fast_path_is_available.__wrapped__ = original
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def _allow_continuous_batching() -> None:
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
        if impl is not None and _REGISTERED.get(impl) is fia_attention_forward:
            return
        return original(self, model, auto_switch_to_flash)

    switch_to_cb_friendly_attn._fia = True
    switch_to_cb_friendly_attn.__wrapped__ = original
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


_REGISTERED: dict = {}


def register(name: str = NAME) -> str:
    """Register `name` (default "fia") in transformers' AttentionInterface and AttentionMaskInterface (idempotent).
    The mask function is transformers' sdpa_mask: None for plain causal, else a bool mask (True = attend) that
    fia_attention_forward reduces to lengths / sparse modes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(name, fia_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED[name] = fia_attention_forward
    _allow_continuous_batching()
    return name


register()

__all__ = ["FiaTransformersUnsupported", "NAME", "SUPPORTED_TRANSFORMERS", "fia_attention_forward", "register"]
