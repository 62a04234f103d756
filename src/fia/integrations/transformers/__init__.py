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
attention logit soft-capping (``softcap``), dropout > 0, ``output_attentions``, ``position_bias``, per-head masks,
additive float masks that are not 0 / -inf, attention sinks not shaped one per query head, two head dims on the
block-table decode path of continuous batching.

Model families (tested with small random-weight configs against eager; what some need beyond a plain call is in
models.py): Llama, Qwen2, Qwen3 (its q / k norms run in the module), Mistral (sliding window: band mode 4),
Gemma2 / Gemma3 (sliding / full layers; ``scaling`` from query_pre_attn_scalar; Gemma3's attention receives no
``softcap`` -- transformers passes none, its eager included -- and a ``softcap`` that arrives is refused), gpt-oss,
DeepSeek-V3:

- attention sinks (gpt-oss passes ``s_aux``, one logit per query head, concatenated to the logits before the
  softmax and dropped after it) are FIA's ``learnable_sink`` (SPEC 1.1b, the same formula), passed through
  ``npu_fused_infer_attention_score_v2`` (the entry point that has them); _v2 has no padding sizes, so a
  left-padded mask goes in as a general mask there, while unpadded sliding / full layers keep modes 4 / 3; the
  packed and block-table paths of continuous batching pass the sinks too;
- a value head dim Dv different from the query / key one D (DeepSeek-V3's MLA: nope 128 + rope 64 vs value 128),
  DECISIONS 48: a call in portable mode anyway (float32) splits query / key at Dv into FIA's ``query_rope`` /
  ``key_rope`` (no copy); a strict-mode call (bf16 / fp16) zero-pads the value to D (the NPU's BNSD rules accept
  D = 192) and the output is cut back to Dv -- both exact. Dv above D: query / key zero-padded to Dv.

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

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
TESTED_TRANSFORMERS = ("5.24.0",)


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

from . import attention, batching, cache, masks, models  # noqa: E402  (after the version check)
from .attention import fia_attention_forward  # noqa: E402
from .cache import FiaCache  # noqa: E402
from .common import NAME, REGISTERED, FiaTransformersUnsupported  # noqa: E402


def register(name: str = NAME) -> str:
    """Register `name` (default "fia") in transformers' AttentionInterface and AttentionMaskInterface (idempotent).
    The mask function is transformers' sdpa_mask: None for plain causal, else a bool mask (True = attend) that
    fia_attention_forward reduces to lengths / sparse modes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(name, fia_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    REGISTERED[name] = fia_attention_forward
    batching.allow_continuous_batching()
    cache.allow_cache_implementations()
    return name


register()

__all__ = ["FiaCache", "FiaTransformersUnsupported", "NAME", "SUPPORTED_TRANSFORMERS", "attention", "batching", "cache",
           "check_version", "fia_attention_forward", "masks", "models", "register"]
