"""fia.integrations.transformers: attn_implementation="fia" in Hugging Face transformers models.

Small configs with random weights (from_config, no downloads): Llama (GQA), Qwen2, Qwen3 (q / k norms), Mistral
(sliding window), Gemma2 and Gemma3 (hybrid sliding / full layers, query_pre_attn_scalar scaling), gpt-oss
(attention sinks, hybrid layers), DeepSeek-V3 (MLA: query / key head dim 128 + 64 rope, value 128). Logits against
attn_implementation="eager" on a left-padded batch, greedy generation (dynamic and static caches), the FIA
arguments each call receives (native sparse modes / lengths, no materialized mask), the general-mask fallback and
the options FIA refuses.
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
    if family == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=2, **COMMON)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(num_key_value_heads=2, sliding_window=6, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"], **COMMON)
    if family == "gpt_oss":
        return transformers.GptOssConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                                         sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    if family == "deepseek_v3":                      # DeepSeek-V3's head dims; 2 heads, dense MLPs (no experts)
        common = {k: v for k, v in COMMON.items() if k not in ("head_dim", "num_attention_heads")}
        return transformers.DeepseekV3Config(num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=32, q_lora_rank=None,
                                             first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1,
                                             n_group=1, topk_group=1, **common)
    raise AssertionError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss", "deepseek_v3"]
_MODELS = {}


def _models(family, dtype):
    """(eager, fia) models with the same weights; a config copy each (the attn_implementation lives on it)."""
    key = (family, dtype)
    if key not in _MODELS:
        cfg = _config(family)
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype).eval()
        for m in eager.modules():                    # gpt-oss: sinks clearly away from 0 (init: ~0), so that
            if hasattr(m, "sinks"):                  # a mapping that dropped them would fail
                with torch.no_grad():
                    m.sinks.normal_(0.0, 1.0)
        mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fia", dtype=dtype).eval()
        mine.load_state_dict(eager.state_dict())
        assert mine.config._attn_implementation == "fia" and eager.config._attn_implementation == "eager"
        _MODELS[key] = (eager, mine)
    return _MODELS[key]


def _batch(seq=10, pad=3):
    return prompt_batch(COMMON["vocab_size"], seq, pad)


@pytest.fixture
def calls(fia_calls, monkeypatch):
    """FIA's keyword arguments per call (conftest.fia_calls); _v2's calls (attention sinks) in the same list, their
    arguments under npu_fused_infer_attention_score's names, with v2=True."""
    real = fia.npu_fused_infer_attention_score_v2
    v1_name = {v: k for k, v in FT.common.V2_NAMES.items()}

    def spy(q, k, v, **kw):
        fia_calls.append(dict({v1_name.get(a, a): x for a, x in kw.items()}, v2=True, q_shape=tuple(q.shape),
                              k_shape=tuple(k.shape), k_dtype=k.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fia, "npu_fused_infer_attention_score_v2", spy)
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
    cfg = mine.config
    for c in calls:                                        # GQA: K/V not repeated
        assert c["k_shape"][1] == c["num_key_value_heads"] == cfg.num_key_value_heads
        assert c["num_heads"] == cfg.num_attention_heads
        if family == "gpt_oss":                            # _v2 (sinks) has no padding sizes: the mask itself
            assert c.get("v2") and "sparse_mode" not in c and c["atten_mask"].shape == (2, 1, 10, 10)
            i, j = torch.arange(10).view(-1, 1), torch.arange(10)
            want = (j > i) | ((j < i - 5) if c is calls[0] else False)     # layer 0: sliding window 6
            want = want.expand(2, 1, 10, 10).clone()
            want[1, ..., :3] = True                                         # the left padding
            assert torch.equal(c["atten_mask"], want)
        else:                                              # no materialized mask
            assert not c.get("v2") and "learnable_sink" not in c
            assert c["sparse_mode"] in (3, 4) and tuple(c["atten_mask"].shape) == (2048, 2048)
            assert c["actual_seq_lengths_kv"] == [10, 7] and c["kv_padding_size"].tolist() == [0, 0]
    if family == "gpt_oss":                                # each layer's own sinks, as the model holds them
        sinks = [layer.self_attn.sinks for layer in mine.model.layers]
        assert all(torch.equal(c["learnable_sink"], s.detach()) for c, s in zip(calls, sinks))
    if family == "deepseek_v3":                            # D 192 = 128 + 64 rope, Dv 128 (DECISIONS 48)
        if dtype == torch.float32:                         # portable anyway: FIA's rope split, no copy
            assert all(c["q_shape"][-1] == c["k_shape"][-1] == 128 and c["query_rope"].shape[-1] == 64
                       for c in calls)
        else:                                              # strict: the value zero-padded to D = 192
            assert all(c["q_shape"][-1] == c["k_shape"][-1] == 192 and "query_rope" not in c for c in calls)
    if family == "mistral":                                # sliding window 6 over 10 tokens: band mode
        assert all(c["sparse_mode"] == 4 and c["pre_tokens"] == 5 and c["next_tokens"] == 0 for c in calls)
    if family in ("gemma2", "gemma3"):                     # layer 0 sliding, layer 1 full
        assert [c["sparse_mode"] for c in calls] == [4, 3]
        assert calls[0]["scale"] == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("family,cache", [(f, "dynamic") for f in FAMILIES]      # static: full and sliding layers
                         + [(f, "static") for f in ("llama", "qwen3", "mistral", "gemma3", "gpt_oss", "deepseek_v3")])
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
    if family == "gpt_oss":                         # _v2 (sinks): a left-padded key window is a general mask
        assert all(c["v2"] and c["learnable_sink"].shape == (4,) for c in decode)
        assert all(c["atten_mask"].shape[:3] == (2, 1, 1) for c in decode if "atten_mask" in c)
    else:
        assert all("atten_mask" not in c for c in decode)           # Q_S = 1: KV lengths only
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


@pytest.mark.parametrize("option", ["softcap", "dropout", "output_attentions", "per_head_mask", "float_bias", "sinks"])
def test_unsupported_options_raise(option):
    q, k, v = _qkv()
    kw, mask = {}, None
    if option == "sinks":                                  # one per KV head instead of one per query head
        kw["s_aux"] = torch.randn(2)
    elif option == "softcap":
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


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_generate_batch_paged_identical_to_sdpa(family, calls):
    """Continuous batching (PagedAttentionCache): prefill packed in TND with cumulative lengths, decode through FIA's
    paged KV path (the cache's page pool read in place with transformers' block table); greedy tokens as "sdpa"
    (gpt-oss, which has no sdpa: as eager, its sinks passed on both paths)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    eager, mine = _models(family, torch.float32)
    if family == "gpt_oss":
        ref = eager
    else:
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
    assert prefill and prefill[0]["sparse_mode"] == (4 if family == "gpt_oss" else 3)   # layer 0 sliding there
    assert all(("learnable_sink" in c) == (family == "gpt_oss") for c in calls)
    assert prefill[0]["actual_seq_lengths"][-1] == 15 and len(prefill[0]["actual_seq_lengths"]) == 3
    if family == "gpt_oss":                        # hybrid layers: transformers keeps decode steps packed (TND)
        assert not paged and len(prefill) == 6 * COMMON["num_hidden_layers"]
        return
    assert len(paged) == 5 * COMMON["num_hidden_layers"]               # every decode step read the page pool
    for c in paged:
        assert c["block_size"] == 4 and c["block_table"].dtype == torch.int32 and c["input_layout"] == "BSH"
        assert c["k_shape"][1:] == (4, 2 * 16)                          # [num_pages, page_size, KV_N * D]
    assert sorted(paged[-1]["actual_seq_lengths_kv"]) == [8, 10, 12]    # per request, prompt + 5 tokens


def test_generate_batch_paged_decode_replays_at_the_call_site(monkeypatch):
    """The block-table decode steps go through the integration's replay call site (fia.replay.Site): replayed
    after admission, the same greedy tokens as with the site turned off."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from fia import replay
    _, mine = _models("llama", torch.float32)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 8, 9], [10, 11, 12, 13, 14]]
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def run():
        cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=32, max_blocks_per_request=8)
        with torch.no_grad():
            out = mine.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
        return sorted((r.request_id, list(r.generated_tokens)) for r in out.values())

    FT.common._SITE.table.clear()
    before = replay.stats["replayed"]
    got = run()
    assert replay.stats["replayed"] - before >= 4 * COMMON["num_hidden_layers"]
    assert any(m[0][0] == "paged" and hit is not replay._NEVER for m, hit in FT.common._SITE.table.items())
    monkeypatch.setattr(FT.common, "_PUBLIC", None)
    assert got == run()


def test_decode_mask_plans_reproduce_the_mask():
    """Decode-step masks (one query row, CPU bool, possibly wider than the keys given: analysed as bytes): the
    plan's key windows -- or its general mask -- allow exactly the keys the mask allows, and a mask of one contiguous
    window per batch never falls back to the general mask."""
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
        wide = torch.rand(B, 1, 1, KV + rnd.randint(0, 3)) < 0.5      # a static cache's mask: columns past KV
        wide[..., :KV] = allowed
        plan = FT.masks.mask_plan(wide, 1, KV, True, None)
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



def _sink_module(n: int, kv_n: int, g: torch.Generator) -> torch.nn.Module:
    """What gpt-oss's eager_attention_forward reads of its module: sinks clearly away from 0, GQA groups."""
    m = torch.nn.Module()
    m.is_causal, m.num_key_value_groups = True, n // kv_n
    m.sinks = torch.nn.Parameter(torch.randn(n, generator=g) * 2)
    return m


@pytest.mark.parametrize("q_len", [12, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("pad", [0, 4], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_sinks_match_gpt_oss_eager_attention(q_len, pad, window, calls):
    """s_aux -> FIA's learnable_sink against transformers' gpt-oss eager attention (sinks concatenated to the
    logits, softmax, sink column dropped), with its additive float mask: causal / sliding window, left padding,
    prefill and decode. Every row is compared: a fully masked row puts all its weight on the sink (0) in both."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    g = torch.Generator().manual_seed(11)
    kv = 12
    q = torch.randn(2, 4, q_len, 16, generator=g)
    k, v = torch.randn(2, 2, kv, 16, generator=g), torch.randn(2, 2, kv, 16, generator=g)
    module = _sink_module(4, 2, g)
    i, j = torch.arange(kv - q_len, kv).view(-1, 1), torch.arange(kv)
    allowed = (j <= i) & ((j > i - window) if window else True)
    allowed = allowed.expand(2, 1, q_len, kv).clone()
    allowed[1, ..., :pad] = False
    mask = torch.zeros(2, 1, q_len, kv).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    out, _ = FT.fia_attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=window,
                                      s_aux=module.sinks)
    assert _rel(ref, out) <= 1e-5
    no_sinks, _ = FT.fia_attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=window)
    assert _rel(ref, no_sinks) > 1e-2                      # the sinks matter on these inputs
    c = calls[0]
    assert c["v2"] and torch.equal(c["learnable_sink"], module.sinks.detach())
    if q_len > 1 and not pad:                              # native modes: band for the sliding window
        assert c["sparse_mode"] == (4 if window else 3) and c.get("pre_tokens") == (window and window - 1)
    elif pad:                                              # _v2 has no padding sizes: a general mask
        assert torch.equal(c["atten_mask"].view(2, q_len, kv), ~allowed.view(2, q_len, kv))


def test_gpt_oss_unpadded_generation_band_mode(calls):
    """gpt-oss without padding: sliding layers run as band mode 4, full layers as mode 3 (with the sinks), decode
    steps over the sliding layer's window cache without a mask; greedy tokens as eager (float32)."""
    eager, mine = _models("gpt_oss", torch.float32)
    ids, _ = _batch()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert torch.equal(mine.generate(ids, **kw), eager.generate(ids, **kw))
    prefill = [c for c in calls if c["q_shape"][2] > 1]
    assert [c["sparse_mode"] for c in prefill] == [4, 3] and prefill[0]["pre_tokens"] == 5
    decode = [c for c in calls if c["q_shape"][2] == 1]
    assert len(decode) == 7 * 2 and all(c["v2"] and "atten_mask" not in c for c in decode)
    assert {c["k_shape"][2] for c in decode[::2]} == {6}   # the sliding layer's cache: the window's 6 keys


@pytest.mark.parametrize("dtype,mode,d,dv", [(torch.float32, "strict", 192, 128), (torch.bfloat16, "strict", 192, 128),
                                             (torch.bfloat16, "portable", 192, 128), (torch.float32, "strict", 32, 48)],
                         ids=["fp32", "bf16_strict", "bf16_portable", "dv_above_d"])
@pytest.mark.parametrize("q_len", [8, 1], ids=["prefill", "decode"])
def test_value_head_dim_differs_matches_sdpa(dtype, mode, d, dv, q_len, calls):
    """Dv != D (DeepSeek-V3: 192 vs 128), DECISIONS 48: FIA's query / key rope split where the call runs in portable
    mode anyway, the narrower side zero-padded in strict mode (bf16 passes the NPU's checks); left-padded batch."""
    g = torch.Generator().manual_seed(7)
    kv = 10
    q = torch.randn(2, 4, q_len, d, generator=g).to(dtype)
    k = torch.randn(2, 2, kv, d, generator=g).to(dtype)
    v = torch.randn(2, 2, kv, dv, generator=g).to(dtype)
    i, j = torch.arange(kv - q_len, kv).view(-1, 1), torch.arange(kv)
    mask = (j <= i).expand(2, 1, q_len, kv).clone()
    mask[1, ..., :3] = False
    rows = (slice(None), slice(None), slice(3, None)) if q_len > 1 else (slice(None),)   # not the padded rows
    ref, _ = sdpa_attention_forward(_Mod(), q.float(), k.float(), v.float(), mask, scaling=0.1)
    with fia.validation_mode(mode):
        out, _ = FT.fia_attention_forward(_Mod(), q, k, v, mask, scaling=0.1)
    assert out.shape == ref.shape == (2, q_len, 4, dv) and out.dtype == dtype
    assert _rel(ref.transpose(1, 2)[rows], out.transpose(1, 2)[rows]) <= (1e-5 if dtype == torch.float32 else 1e-2)
    split = dv < d and (dtype == torch.float32 or mode == "portable")
    assert ("query_rope" in calls[0]) == split
    assert calls[0]["q_shape"][-1] == (dv if split else max(d, dv))


def test_gemma3_attention_gets_no_softcap():
    """Gemma 3's configs carry no attention soft-capping, and transformers' Gemma3 attention hands the attention
    function none even when the config sets one (its eager ignores the setting too): fia runs and matches eager.
    A softcap that does arrive is refused (test_unsupported_options_raise)."""
    assert _config("gemma3").attn_logit_softcapping is None
    cfg = _config("gemma3")
    cfg.attn_logit_softcapping = 0.5                       # small: would change these logits if applied
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fia").eval()
    mine.load_state_dict(eager.state_dict())
    ids, mask = _batch()
    with torch.no_grad():
        ref, out = eager(ids, attention_mask=mask).logits, mine(ids, attention_mask=mask).logits
    assert _rel(ref[mask.bool()], out[mask.bool()]) <= 1e-4


def test_paged_decode_with_sinks_matches_gpt_oss_eager(calls):
    """The block-table decode path with s_aux (a gpt-oss model whose layers all took it): the new token written
    into its page slot, FIA's paged KV read with the sinks, against gpt-oss's eager attention over each request's
    gathered keys."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    g = torch.Generator().manual_seed(13)
    page, lengths = 4, [7, 10]                                 # each request's KV length, the new token included
    k_cache, v_cache = torch.randn(8, page, 2, 16, generator=g), torch.randn(8, page, 2, 16, generator=g)
    table = torch.tensor([[5, 1, 6], [0, 7, 3]])               # [B, max_pages]
    q = torch.randn(1, 4, 2, 16, generator=g)                  # [1, N, B, D]
    k_new, v_new = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 2, 16, generator=g)
    module = _sink_module(4, 2, g)
    kw = dict(k_cache=k_cache, v_cache=v_cache, block_table=table, cu_seq_lens_k=torch.tensor([0, 7, 17]),
              s_aux=module.sinks)
    out, _ = FT.fia_attention_forward(module, q, k_new, v_new, None, scaling=0.3, **kw)      # [1, B, N, D]
    for b, n_kv in enumerate(lengths):
        kb = k_cache[table[b]].reshape(-1, 2, 16)[:n_kv].transpose(0, 1)[None]             # [1, KV_N, S, D]
        vb = v_cache[table[b]].reshape(-1, 2, 16)[:n_kv].transpose(0, 1)[None]
        assert torch.equal(kb[0, :, -1], k_new[0, :, b])                                    # written in place
        ref, _ = eager_attention_forward(module, q[:, :, b:b + 1], kb, vb, None, scaling=0.3)   # [1, 1, N, D]
        assert _rel(ref[0, 0], out[0, b]) <= 1e-5
    assert calls[0]["v2"] and calls[0]["block_table"] is not None and "learnable_sink" in calls[0]


def test_paged_decode_with_two_head_dims_is_refused():
    g = torch.Generator().manual_seed(2)
    kw = dict(k_cache=torch.randn(4, 4, 2, 24, generator=g), v_cache=torch.randn(4, 4, 2, 16, generator=g),
              block_table=torch.tensor([[0, 1]]), cu_seq_lens_k=torch.tensor([0, 5]))
    q, k, v = torch.randn(1, 4, 1, 24, generator=g), torch.randn(1, 2, 1, 24, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    with pytest.raises(FT.FiaTransformersUnsupported, match="value head dim 16 with query / key head dim 24"):
        FT.fia_attention_forward(_Mod(), q, k, v, None, scaling=0.3, **kw)
