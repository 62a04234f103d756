"""fia.integrations.transformers: attn_implementation="fia" in Hugging Face transformers models.

Small configs with random weights (from_config, no downloads): Llama (GQA), Qwen2, Mistral (sliding window),
Gemma2 (hybrid sliding / full layers, query_pre_attn_scalar scaling). Logits against attn_implementation="eager"
on a left-padded batch, greedy generation (dynamic and static caches), the FIA arguments each call receives
(native sparse modes / lengths, no materialized mask), the general-mask fallback and the options FIA refuses.
"""
import copy

import pytest
import torch

from util import prompt_batch

import fia

transformers = pytest.importorskip("transformers")
FT = pytest.importorskip("fia.integrations.transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

pytestmark = pytest.mark.backend_independent      # whole models: automatic backend selection, one run

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              head_dim=16, max_position_embeddings=128, initializer_range=0.3)


def _config(family):
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **COMMON)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=1, **COMMON)
    if family == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=6, **COMMON)
    if family == "gemma2":
        return transformers.Gemma2Config(num_key_value_heads=2, sliding_window=6, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=None, final_logit_softcapping=None, **COMMON)
    raise AssertionError(family)


FAMILIES = ["llama", "qwen2", "mistral", "gemma2"]
_MODELS = {}


def _models(family, dtype):
    """(eager, fia) models with the same weights; a config copy each (the attn_implementation lives on it)."""
    key = (family, dtype)
    if key not in _MODELS:
        cfg = _config(family)
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype).eval()
        mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fia", dtype=dtype).eval()
        mine.load_state_dict(eager.state_dict())
        assert mine.config._attn_implementation == "fia" and eager.config._attn_implementation == "eager"
        _MODELS[key] = (eager, mine)
    return _MODELS[key]


def _batch(seq=10, pad=3):
    return prompt_batch(COMMON["vocab_size"], seq, pad)


@pytest.fixture
def calls(fia_calls):
    """FIA's keyword arguments per call (conftest.fia_calls)."""
    return fia_calls


def _rel(a, b):
    return ((a.float() - b.float()).norm() / a.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_eager(family, dtype, tol, calls):
    eager, mine = _models(family, dtype)
    ids, mask = _batch()
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).logits
        out = mine(ids, attention_mask=mask).logits
    valid = mask.bool()                                    # padded rows are garbage in eager, zeros in FIA
    assert _rel(ref[valid], out[valid]) <= tol
    assert len(calls) == COMMON["num_hidden_layers"]
    for c in calls:                                        # GQA: K/V not repeated; no materialized mask
        assert c["k_shape"][1] == c["num_key_value_heads"] < c["num_heads"] == COMMON["num_attention_heads"]
        assert c["sparse_mode"] in (3, 4) and tuple(c["atten_mask"].shape) == (2048, 2048)
        assert c["actual_seq_lengths_kv"] == [10, 7] and c["kv_padding_size"].tolist() == [0, 0]
    if family == "mistral":                                # sliding window 6 over 10 tokens: band mode
        assert all(c["sparse_mode"] == 4 and c["pre_tokens"] == 5 and c["next_tokens"] == 0 for c in calls)
    if family == "gemma2":                                 # layer 0 sliding, layer 1 full
        assert [c["sparse_mode"] for c in calls] == [4, 3]
        assert calls[0]["scale"] == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("family,cache", [(f, "dynamic") for f in FAMILIES]
                         + [("llama", "static"), ("mistral", "static")])     # static: full and sliding layers
def test_greedy_generate_identical_fp32(family, cache, calls):
    eager, mine = _models(family, torch.float32)
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ref = eager.generate(ids, **kw)
        out = mine.generate(ids, **kw)
    assert out.shape == (2, 26)
    assert torch.equal(ref, out)
    decode = [c for c in calls if c["q_shape"][2] == 1]
    assert len(decode) == 15 * COMMON["num_hidden_layers"]          # every decode step ran through FIA
    assert all("atten_mask" not in c for c in decode)               # Q_S = 1: KV lengths only
    if family == "llama":
        assert all(c["actual_seq_lengths_kv"][1] == c["actual_seq_lengths_kv"][0] - 3 for c in decode)


def test_bf16_generate_runs_strict(calls):
    _, mine = _models("llama", torch.bfloat16)
    ids, mask = _batch()
    assert fia.get_validation_mode() == "strict"
    with torch.no_grad():
        out = mine.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, 14) and fia.get_validation_mode() == "strict"
    assert calls and all(c["q_shape"][2] in (1, 10) for c in calls)


class _Mod(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _qkv(dtype=torch.float32, b=2, s=12, kv=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, s, 16, generator=g).to(dtype)
    k = torch.randn(b, 2, kv, 16, generator=g).to(dtype)
    v = torch.randn(b, 2, kv, 16, generator=g).to(dtype)
    return q, k, v


def test_general_mask_fallback_matches_sdpa(calls):
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, 12, 12, generator=g) > 0.4
    mask[..., 0] = True                                    # every row sees a key
    ref, _ = sdpa_attention_forward(_Mod(), q, k, v, mask, scaling=0.3)
    out, _ = FT.fia_attention_forward(_Mod(), q, k, v, mask, scaling=0.3)
    assert _rel(ref, out) <= 1e-5
    assert calls[0]["atten_mask"].dtype == torch.bool and torch.equal(calls[0]["atten_mask"][:, 0], ~mask[:, 0])
    assert "sparse_mode" not in calls[0]


def test_mask_plans():
    plan = FT.masks.mask_plan(None, 8, 8, True, None)
    assert plan == {"sparse_mode": 3}
    plan = FT.masks.mask_plan(None, 8, 20, True, None)          # empty static cache: upper-left causal
    assert plan == {"sparse_mode": 3, "actual_seq_lengths_kv": [8]}
    assert FT.masks.mask_plan(None, 1, 20, True, None) == {}
    # a static cache's unused tail (right) -> lengths only
    j = torch.arange(20)
    i = torch.arange(8).view(-1, 1)
    m = ((j <= i + 4) & (j < 12)).view(1, 1, 8, 20).expand(2, 1, 8, 20).clone()
    plan = FT.masks.mask_plan(m, 8, 20, True, None)
    assert plan == {"actual_seq_lengths_kv": [12, 12], "sparse_mode": 3}
    # a float (eager-style) mask, left padding in batch 1
    f = torch.zeros(2, 1, 8, 20)
    f[~m] = torch.finfo(torch.float32).min
    f[1, ..., :2] = torch.finfo(torch.float32).min
    plan = FT.masks.mask_plan(f, 8, 20, True, None)
    assert plan["actual_seq_lengths_kv"] == [12, 10] and plan["kv_padding_size"].tolist() == [8, 8]


def test_upper_left_causal_with_static_tail_matches_sdpa():
    q, k, v = _qkv(kv=20)
    ref, _ = sdpa_attention_forward(_Mod(), q, k, v, None, scaling=0.25)
    out, _ = FT.fia_attention_forward(_Mod(), q, k, v, None, scaling=0.25)
    assert _rel(ref, out) <= 1e-5


@pytest.mark.parametrize("option", ["softcap", "dropout", "output_attentions", "per_head_mask", "float_bias"])
def test_unsupported_options_raise(option):
    q, k, v = _qkv()
    kw, mask = {}, None
    if option == "softcap":
        kw["softcap"] = 50.0
    elif option == "dropout":
        kw["dropout"] = 0.1
    elif option == "output_attentions":
        kw["output_attentions"] = True
    elif option == "per_head_mask":
        mask = torch.ones(2, 4, 12, 12, dtype=torch.bool)
        mask[:, 1, :, 0] = False
    else:
        mask = torch.randn(2, 1, 12, 12)
    with pytest.raises(FT.FiaTransformersUnsupported, match=option.split("_")[0]):
        FT.fia_attention_forward(_Mod(), q, k, v, mask, **kw)


def test_gemma2_softcapping_raises():
    cfg = _config("gemma2")
    cfg.attn_logit_softcapping = 50.0
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fia").eval()
    ids, mask = _batch()
    with pytest.raises(FT.FiaTransformersUnsupported, match="soft-capping"):
        with torch.no_grad():
            model(ids, attention_mask=mask)


def test_training_dropout_raises():
    cfg = _config("llama")
    cfg.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fia").train()
    ids, _ = _batch()
    with pytest.raises(FT.FiaTransformersUnsupported, match="dropout"):
        model(ids)


def test_unsupported_transformers_version():
    FT.check_version(transformers.__version__)            # the installed one is supported
    for bad in ("4.40.0", "6.0.0"):
        with pytest.raises(ImportError, match=rf"supports transformers >=5.0,<6.*installed: {bad}"):
            FT.check_version(bad)


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert FT.register() == "fia" and FT.register("fia") == "fia"
    assert AttentionInterface()["fia"] is FT.fia_attention_forward
    assert "fia" in AttentionMaskInterface._global_mapping


def test_generate_batch_paged_identical_to_sdpa(calls):
    """Continuous batching (PagedAttentionCache): prefill packed in TND with cumulative lengths, decode through FIA's
    paged KV path (the cache's page pool read in place with transformers' block table); greedy tokens as "sdpa"."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    eager, mine = _models("llama", torch.float32)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(eager.config), attn_implementation="sdpa",
                                           dtype=torch.float32).eval()
    ref.load_state_dict(eager.state_dict())
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 8, 9], [10, 11, 12, 13, 14]]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def run(model):
        cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=32, max_blocks_per_request=8)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
        return sorted((r.request_id, list(r.generated_tokens)) for r in out.values())

    with torch.no_grad():
        expected = run(ref)
        got = run(mine)
    assert got == expected and all(len(toks) == 6 for _, toks in got)
    assert mine.config._attn_implementation == "fia"
    prefill = [c for c in calls if c["input_layout"] == "TND"]
    paged = [c for c in calls if c.get("block_table") is not None]
    assert prefill and prefill[0]["sparse_mode"] == 3                  # cumulative lengths, scheduler's order
    assert prefill[0]["actual_seq_lengths"][-1] == 15 and len(prefill[0]["actual_seq_lengths"]) == 3
    assert len(paged) == 5 * COMMON["num_hidden_layers"]               # every decode step read the page pool
    for c in paged:
        assert c["block_size"] == 4 and c["block_table"].dtype == torch.int32 and c["input_layout"] == "BSH"
        assert c["k_shape"][1:] == (4, 2 * 16)                          # [num_pages, page_size, KV_N * D]
    assert sorted(paged[-1]["actual_seq_lengths_kv"]) == [8, 10, 12]    # per request, prompt + 5 tokens


def test_decode_mask_plans_reproduce_the_mask():
    """Decode-step masks (one query row, CPU bool: analysed with NumPy): the plan's key windows -- or its general
    mask -- allow exactly the keys the mask allows, and a mask of one contiguous window per batch never falls back
    to the general mask."""
    import random
    rnd = random.Random(5)
    for _ in range(400):
        B, KV = rnd.randint(1, 4), rnd.randint(1, 24)
        allowed = torch.zeros(B, 1, 1, KV, dtype=torch.bool)
        windows = True
        for b in range(B):
            if rnd.random() < 0.75:
                lo = rnd.randint(0, KV)
                allowed[b, 0, 0, lo:rnd.randint(lo, KV)] = True
            else:
                allowed[b, 0, 0] = torch.rand(KV) < 0.5
                idx = allowed[b, 0, 0].nonzero().flatten().tolist()
                windows &= idx == list(range(idx[0], idx[-1] + 1)) if idx else True
        plan = FT.masks.mask_plan(allowed, 1, KV, True, None)
        if "atten_mask" in plan:
            assert not windows and set(plan) == {"atten_mask"}
            got = ~plan["atten_mask"].view(B, 1, 1, KV)
        else:
            lens = plan.get("actual_seq_lengths_kv", [KV] * B)
            got = torch.zeros(B, 1, 1, KV, dtype=torch.bool)
            for b in range(B):                 # left padding: [KV - pad - len, KV - pad) (SPEC 6), else [0, len)
                end = KV - int(plan["kv_padding_size"][b]) if "kv_padding_size" in plan else lens[b]
                got[b, 0, 0, end - lens[b]:end] = True
        assert torch.equal(got, allowed), (allowed, plan)


def _family_config(family):
    """More families: gpt-oss (learnable sinks, alternating sliding / full layers), Gemma3, Qwen3 (q / k norms),
    a DeepSeek-V3-shaped MLA (query / key head dim nope 16 + rope 8, value 16)."""
    if family == "gpt_oss":
        return transformers.GptOssConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                                         sliding_window=6, layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(num_key_value_heads=2, sliding_window=6, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=2, **COMMON)
    if family == "deepseek_v3":
        common = {k: v for k, v in COMMON.items() if k != "head_dim"}
        return transformers.DeepseekV3Config(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, kv_lora_rank=32, q_lora_rank=None, n_routed_experts=2,
                                             num_experts_per_tok=1, first_k_dense_replace=2, n_group=1, topk_group=1,
                                             **common)
    raise AssertionError(family)


MORE = ["gpt_oss", "gemma3", "qwen3", "deepseek_v3"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", MORE)
def test_more_families_match_eager(family, dtype, tol):
    """Prefill logits on a left-padded batch against eager; float32 greedy generation (dynamic cache) identical.
    gpt-oss's sinks are drawn with std 1 (clearly away from 0), so a mapping that ignored them would fail."""
    cfg = _family_config(family)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype).eval()
    if family == "gpt_oss":
        for m in eager.modules():
            if hasattr(m, "sinks"):
                torch.nn.init.normal_(m.sinks, std=1.0)
    mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fia", dtype=dtype).eval()
    mine.load_state_dict(eager.state_dict())
    ids, mask = _batch()
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).logits
        out = mine(ids, attention_mask=mask).logits
        valid = mask.bool()
        assert _rel(ref[valid], out[valid]) <= tol
        if dtype == torch.float32:
            kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert torch.equal(mine.generate(ids, **kw), eager.generate(ids, **kw))


def test_value_head_dim_larger_than_key_is_refused():
    class M(torch.nn.Module):
        is_causal = True
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    with pytest.raises(FT.FiaTransformersUnsupported, match="value head dim 16 with query / key head dim 8"):
        FT.fia_attention_forward(M(), q, k, torch.randn(1, 2, 5, 16, generator=g), None, scaling=0.3)
