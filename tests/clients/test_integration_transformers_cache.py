"""fia.integrations.transformers.FiaCache: preallocated buffers appended in place, bf16 / float32 and int8.

Small Llama configs with random weights (from_config, no downloads): greedy generation identical to eager in float32
(left-padded batch, beam search, growth past the first allocation, cache_implementation names), logits against
eager, the int8 variant's documented tolerance, the FIA calls a decode step makes (fixed shapes, a lengths list)
and the errors for what the cache cannot hold.
"""
import copy

import pytest
import torch

from util import prompt_batch


transformers = pytest.importorskip("transformers")
FT = pytest.importorskip("fia.integrations.transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from fia.integrations.transformers import FiaCache, cache as FC  # noqa: E402

pytestmark = pytest.mark.backend_independent      # whole models: automatic backend selection, one run

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              head_dim=16, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3)
_MODELS = {}


def _models(dtype):
    if dtype not in _MODELS:
        cfg = transformers.LlamaConfig(**COMMON)
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype).eval()
        mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fia", dtype=dtype).eval()
        mine.load_state_dict(eager.state_dict())
        _MODELS[dtype] = (eager, mine)
    return _MODELS[dtype]


def _batch(seq=9, pad=3, seed=1):
    return prompt_batch(COMMON["vocab_size"], seq, pad, seed)


@pytest.fixture
def calls(fia_calls):
    """FIA's keyword arguments per call (conftest.fia_calls)."""
    return fia_calls


def _generate(model, ids, mask, n, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("how", ["instance", "fia"])
def test_greedy_identical_to_eager_with_left_padding(how):
    eager, mine = _models(torch.float32)
    ids, mask = _batch()
    want = _generate(eager, ids, mask, 12)
    kw = dict(cache=FiaCache(mine.config)) if how == "instance" else dict(cache_implementation="fia")
    assert torch.equal(_generate(mine, ids, mask, 12, **kw), want)


def test_growth_and_in_place_appends(monkeypatch):
    """Blocks of 16 positions: the generation outgrows the first allocation several times and stays identical to
    eager; between growths a decode step writes into the same buffers (no per-step copy)."""
    monkeypatch.setattr(FC, "BLOCK", 16)
    eager, mine = _models(torch.float32)
    ids, mask = _batch(seq=5, pad=2, seed=4)
    cache = FiaCache(mine.config)
    ptrs = []
    layer = cache.layers[0]
    real = layer.update

    def update(k, v, *a, **kw):
        res = real(k, v, *a, **kw)
        ptrs.append((layer.keys.data_ptr(), layer.capacity, layer.length))
        return res
    monkeypatch.setattr(layer, "update", update)
    got = _generate(mine, ids, mask, 80, cache=cache)
    assert torch.equal(got, _generate(eager, ids, mask, 80))
    caps = sorted({c for _, c, _ in ptrs})
    assert len(caps) >= 3 and caps[-1] >= 84 and all(c % 16 == 0 for c in caps)
    for (p0, c0, _), (p1, c1, _) in zip(ptrs, ptrs[1:]):
        assert (p0 == p1) == (c0 == c1)                    # a new buffer exactly when the capacity grew


def test_beam_search_identical_to_eager():
    eager, mine = _models(torch.float32)
    ids, mask = _batch(seed=2)
    kw = dict(num_beams=3, num_return_sequences=2)
    assert torch.equal(_generate(mine, ids, mask, 8, cache=FiaCache(mine.config), **kw),
                       _generate(eager, ids, mask, 8, **kw))


def _step_logits(model, ids, mask, cache, steps):
    """Prefill logits [B, V] and those of `steps` greedy decode steps (fed the same tokens to every model)."""
    out, toks = [], []
    with torch.no_grad():
        o = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        out.append(o.logits[:, -1].float())
        for _ in range(steps):
            nxt = out[-1].argmax(-1, keepdim=True) if not toks else toks[-1]
            toks.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            o = model(nxt, attention_mask=mask, cache=cache, use_cache=True)
            out.append(o.logits[:, -1].float())
    return torch.stack(out), torch.cat(toks, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_logits_against_eager(dtype, tol):
    eager, mine = _models(dtype)
    ids, mask = _batch(seed=3)
    want, _ = _step_logits(eager, ids, mask, DynamicCache(config=eager.config), 5)
    got, _ = _step_logits(mine, ids, mask, FiaCache(mine.config), 5)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, err


def test_int8_within_the_documented_tolerance(calls):
    """int8 K / V (per token and head): logits within INT8_LOGITS_TOLERANCE of the bf16 FiaCache, the same greedy
    tokens here, and the decode steps hand FIA the int8 buffers with antiquant mode 3 at one fixed shape."""
    _, mine = _models(torch.bfloat16)
    ids, mask = _batch(seed=5)
    want, wtok = _step_logits(mine, ids, mask, FiaCache(mine.config), 6)
    calls.clear()
    got, gtok = _step_logits(mine, ids, mask, FiaCache(mine.config, quantize="int8"), 6)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < FC.INT8_LOGITS_TOLERANCE, err
    assert torch.equal(gtok, wtok)
    decode = [c for c in calls if c["q_shape"][2] == 1]
    assert len(decode) == 6 * COMMON["num_hidden_layers"]
    assert len({c["k_shape"] for c in decode}) == 1 and all(c["k_dtype"] == torch.int8 for c in decode)
    assert all(c["key_antiquant_mode"] == 3 and c["value_antiquant_mode"] == 3 for c in decode)
    assert all(isinstance(c["actual_seq_lengths_kv"], list) or "kv_padding_size" in c for c in decode)


def test_int8_appends_by_the_compiled_pass_as_by_torch_ops(monkeypatch):
    """The int8 cache appends through cpu/kv_append.py (one compiled pass per layer and step) and, where that does
    not run, through quantize_int8's torch ops: the same codes, scales and logits (bf16 model, left padding)."""
    from fia.cpu import kv_append
    _, mine = _models(torch.bfloat16)
    ids, mask = _batch(seed=6)
    used = []
    real = kv_append.append

    def counted(*a):
        used.append(real(*a))
        return used[-1]
    monkeypatch.setattr(kv_append, "append", counted)
    fast_cache = FiaCache(mine.config, quantize="int8")
    fast, ftok = _step_logits(mine, ids, mask, fast_cache, 4)
    assert used and all(used)                              # every append took the compiled pass
    monkeypatch.setattr(kv_append, "append", lambda *a: False)
    torch_cache = FiaCache(mine.config, quantize="int8")
    slow, stok = _step_logits(mine, ids, mask, torch_cache, 4)
    assert torch.equal(fast, slow) and torch.equal(ftok, stok)
    for a, b in zip(fast_cache.layers, torch_cache.layers):
        n = a.length
        assert n == b.length and torch.equal(a.keys[:, :, :n], b.keys[:, :, :n])
        assert torch.equal(a.values[:, :, :n], b.values[:, :, :n])
        assert torch.equal(a.key_scales[:, :, :n], b.key_scales[:, :, :n])
        assert torch.equal(a.value_scales[:, :, :n], b.value_scales[:, :, :n])


def test_decode_steps_are_one_signature_with_lengths(calls):
    _, mine = _models(torch.bfloat16)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(6))
    _generate(mine, ids, torch.ones_like(ids), 6, cache=FiaCache(mine.config))
    decode = [c for c in calls if c["q_shape"][2] == 1]
    assert len(decode) == 5 * COMMON["num_hidden_layers"]
    assert len({c["k_shape"] for c in decode}) == 1                           # the same buffers every step
    lens = [c["actual_seq_lengths_kv"] for c in decode[::COMMON["num_hidden_layers"]]]
    assert lens == [[8 + i] for i in range(5)]                                # one length for all (no padding)
    assert all("atten_mask" not in c and "kv_padding_size" not in c for c in decode)


@pytest.mark.parametrize("kind,dtype", [("fia", torch.bfloat16), ("fia", torch.float32), ("fia_int8", torch.bfloat16),
                                        ("dynamic", torch.bfloat16), ("dynamic", torch.float32)])
def test_decode_steps_replay_at_the_call_site(kind, dtype, monkeypatch):
    """Decode steps go through the integration's replay call site (fia.replay.Site): after admission every step
    of every layer is a replay -- on an FiaCache from the first lines of the attention function (its layer's lane,
    attention.lane_step) -- and the logits equal those of the same generation with the site turned off."""
    from fia import replay
    _, mine = _models(dtype)
    ids, mask = _batch(seq=7, pad=0, seed=8)
    laned = []
    real_step = FT.attention.lane_step

    def lane_step(*a):
        out = real_step(*a)
        laned.append(out is not None)
        return out
    monkeypatch.setattr(FT.attention, "lane_step", lane_step)

    def cache():
        return DynamicCache(config=mine.config) if kind == "dynamic" else \
            FiaCache(mine.config, quantize="int8" if kind == "fia_int8" else None)
    before = replay.stats["replayed"]
    got, gtok = _step_logits(mine, ids, mask, cache(), 8)
    served = replay.stats["replayed"] - before
    assert served >= 5 * COMMON["num_hidden_layers"], served
    if kind != "dynamic":                                       # (steps 1-2 admit the replay, 3 notes the lane)
        assert sum(laned) >= 4 * COMMON["num_hidden_layers"], laned
    monkeypatch.setattr(FT.common, "_PUBLIC", None)              # the site off: every call the entry point's
    want, wtok = _step_logits(mine, ids, mask, cache(), 8)
    assert torch.equal(got, want) and torch.equal(gtok, wtok)


@pytest.mark.parametrize("pattern", ["left-padded", "holes"])
def test_masked_decode_over_the_buffers(pattern):
    """A decode step over an FiaCache layer with a mask over the written positions (narrower than the buffers):
    left padding (key windows: padding sizes counted from the buffers' end) and a mask with holes (the general
    mask: the buffers cut to its keys). The output equals a float64 softmax over the allowed written keys; the
    unwritten tail (NaN here) is never read."""
    cfg = transformers.LlamaConfig(**COMMON)
    g = torch.Generator().manual_seed(11)
    B, N, KVN, D, T = 3, 4, 2, 16, 21
    layer = FiaCache(cfg).layers[0]
    k, v = torch.randn(B, KVN, T, D, generator=g), torch.randn(B, KVN, T, D, generator=g)
    keys, values = layer.update(k, v)
    assert keys.shape[2] > T
    keys[:, :, T:] = float("nan")                                  # unwritten positions: must not be read
    values[:, :, T:] = float("nan")
    allowed = torch.ones(B, 1, 1, T, dtype=torch.bool)
    if pattern == "left-padded":
        for b, pad in enumerate((0, 4, 9)):
            allowed[b, ..., :pad] = False
    else:
        allowed[:, ..., 3:T:4] = False
        allowed[1, ..., :6] = False
    q = torch.randn(B, N, 1, D, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = FT.fia_attention_forward(module, q, keys, values, allowed, scaling=D ** -0.5)
    kk, vv = k.double().repeat_interleave(N // KVN, 1), v.double().repeat_interleave(N // KVN, 1)
    sc = (q.double() @ kk.transpose(-1, -2) * D ** -0.5).masked_fill(~allowed, float("-inf"))
    want = (torch.softmax(sc, -1) @ vv).transpose(1, 2)            # [B, 1, N, D]
    assert out.shape == want.shape and torch.isfinite(out).all()
    assert (out.double() - want).abs().max().item() < 1e-5


def test_errors_for_what_the_cache_cannot_hold():
    cfg = transformers.LlamaConfig(**COMMON)
    with pytest.raises(ValueError, match="quantize: expected one of"):
        FiaCache(cfg, quantize="int4")
    g = torch.Generator().manual_seed(7)
    k = torch.randn(2, 2, 3, 16, generator=g)
    cache = FiaCache(cfg)
    with pytest.raises(ValueError, match="key_states: FiaCache holds"):
        cache.update(k.double(), k.double(), 0)
    cache.update(k, k, 1)
    with pytest.raises(ValueError, match="key_states: this FiaCache holds torch.float32"):
        cache.update(k.bfloat16(), k.bfloat16(), 1)
    with pytest.raises(ValueError, match=r"beam_idx: expected 2 indices"):
        cache.reorder_cache(torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"beam_idx: expected batch indices in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="indices: expected a 1-D integer tensor"):
        cache.batch_select_indices(torch.tensor([0.0, 1.0]))
    layer = cache.layers[1]
    before = layer.keys[:, :, :3].clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.keys[:, :, :3], before.flip(0))
    cache.batch_repeat_interleave(2)                       # rows 1, 1, 0, 0 of the original
    assert layer.batch_size == 4 and torch.equal(layer.keys[:, :, :3], before.flip(0).repeat_interleave(2, 0))
    cache.batch_select_indices(torch.tensor([False, False, True, False]))     # a row mask
    assert layer.batch_size == 1 and torch.equal(layer.keys[:, :, :3], before[:1])
