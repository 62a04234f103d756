"""The prefill backend against a float64 golden, on the cases where tiling can go wrong.

Every comparison runs the same call twice: through the prefill backend in the input dtype, and through the
reference backend with every fp16/bf16 tensor upcast to float64 (portable mode) — the golden. Errors are
measured against the golden with the acceptance tolerances of tests/util.py (rel 1e-2 for fp16/bf16
outputs, lse abs 1e-3, +inf rows exactly). Each case runs with the default tiling, with tiny tiles
(many blocks, ragged edges, chunked masks, the pse tile-skipping path forced on, 64-key tiles and items of
one or two positions in the own kernel) and with ATen's kernel for bf16 / fp16 / float32 too (the path of CPUs without
AVX512-BF16 / AVX-512).
Padding past the actual lengths is NaN-poisoned: it must never be read.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import fia
from fia.backends.prefill import flash as prefill_flash
from fia.backends import registry
from fia.backends.prefill.plan import CAUSAL, FULL, MASKED, RCAUSAL, band_dead_rows, dead_row_ranges, plan_batch
from fia.backends.prefill.pse import THRESH, needed_ranges
from util import EXTREMES, assert_close, assert_lse, gen, plant_extreme, randmask, randn, seed_of, template_mask

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
FIA = fia.npu_fused_infer_attention_score
TILES = ("default", "small", "aten")


pytestmark = pytest.mark.backends("prefill")       # prefill-backend tests: under be=prefill only (conftest)


@pytest.fixture(params=TILES)
def tiles(request, monkeypatch):
    be = registry.by_name("prefill")
    if request.param == "small":
        for k, v in dict(block_q=32, band_block_q=32, pse_rows=48, pse_tile=16, pse_skip_min=0,
                         mask_chunk_elems=4096).items():
            monkeypatch.setattr(be, k, v)
        monkeypatch.setattr(prefill_flash, "KT", 64)               # own kernel: many tiles, ragged items
        monkeypatch.setattr(prefill_flash, "ROWS_PER_ITEM", 5)
    monkeypatch.setattr(prefill_flash, "PARALLEL_MIN_FLOPS", 0)     # the suite's small calls on every thread
    monkeypatch.setattr(prefill_flash, "SMALL_ATEN_POSITIONS", 0)   # ... on the own kernel ("aten": ATen's)
    if prefill_flash.HAS_DP and os.environ.get("FIA_PREFILL_OWN", "") != "0":
        # the own bf16 kernel also where it is not the default (CPUs with AMX: ATen's kernel, the "aten" tiles)
        monkeypatch.setattr(prefill_flash, "ENABLED", True)
    if prefill_flash.F16_NATIVE and os.environ.get("FIA_PREFILL_OWN", "") != "0":
        monkeypatch.setattr(prefill_flash, "ENABLED_F16", True)     # (Intel's AVX-512 CPUs: ATen's by default)
    if request.param == "aten":                                    # ATen's kernel for bf16 / fp16 / float32 too
        monkeypatch.setattr(prefill_flash, "ENABLED", False)
        monkeypatch.setattr(prefill_flash, "ENABLED_F16", False)
        monkeypatch.setattr(prefill_flash, "ENABLED_F32", False)
    return request.param


# ---------------------------------------------------------------------------------------------- harness
def _to64(x):
    if torch.is_tensor(x) and x.dtype in (BF16, F16):
        return x.to(F64)
    if isinstance(x, (list, tuple)) and x and all(torch.is_tensor(t) for t in x):
        return type(x)(_to64(t) for t in x)
    return x


def golden_check(fn, kw, lse_key="softmax_lse_flag", dtype=None):
    """Run fn(**kw) on the prefill backend and fn(**float64 kw) on the reference; compare."""
    kw = dict(kw)
    kw[lse_key] = True
    dtype = dtype or kw["query"].dtype
    with fia.use_backend("prefill"):
        out, lse = fn(**kw)
    with fia.validation_mode("portable"), fia.use_backend("reference"):
        gout, glse = fn(**{k: _to64(v) for k, v in kw.items()})
    assert out.dtype == dtype and out.shape == gout.shape
    assert_close(out, gout, dtype if dtype in (BF16, F16, F32) else F64)
    assert_lse(lse.to(F32), glse.to(F64), tol=1e-3 if dtype in (BF16, F16) else 1e-5)
    dead = torch.isposinf(glse)
    if dead.any():
        o = out.reshape(*lse.shape[:-1], -1) if out.dim() == lse.dim() else None
        if o is not None and o.shape[:-1] == dead.shape[:-1]:
            assert (o[dead[..., 0]] == 0).all(), "rows without keys must be exactly 0"
    return out, lse, gout, glse


def poison(x, lens, axis=2):
    """NaN in positions >= lens[b] along `axis` (BNSD: 2)."""
    x = x.clone()
    for b, l in enumerate(lens):
        idx = [b] + [slice(None)] * (x.dim() - 1)
        idx[axis] = slice(l, None)
        x[tuple(idx)] = float("nan")
    return x


def dense(seed, dtype, B=2, N=8, KVN=2, SQ=333, SKV=333, D=64, act_q=None, act_kv=None):
    g = gen(seed)
    q, k, v = randn((B, N, SQ, D), g, dtype), randn((B, KVN, SKV, D), g, dtype), randn((B, KVN, SKV, D), g, dtype)
    if act_q is not None:
        q = poison(q, act_q)
    if act_kv is not None:
        k, v = poison(k, act_kv), poison(v, act_kv)
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
              scale=1 / math.sqrt(D))
    if act_q is not None:
        kw["actual_seq_lengths"] = list(act_q)
    if act_kv is not None:
        kw["actual_seq_lengths_kv"] = list(act_kv)
    return kw, g


# ---------------------------------------------------------------------------------------------- plan
def _kept_by_plan(s1, s2, band, bq, split, batched):
    """[S1, S2] int count of how often each (row, key) is computed, from the plan's segment semantics."""
    cnt = np.zeros((s1, s2), dtype=np.int64)
    pre, nxt = band
    i = np.arange(s1)[:, None]
    j = np.arange(s2)[None]
    inside = (j <= i + nxt) & (j >= i - pre)
    for blk in plan_batch(s1, s2, band, False, bq, 24, band_split=split, band_batched=batched, band_block_q=bq):
        subs = [(blk.i0 + t * blk.bq, blk.i0 + (t + 1) * blk.bq, t * blk.bq) for t in range(blk.nb)] \
            if blk.nb > 1 else [(blk.i0, blk.i1, 0)]
        for r0, r1, sh in subs:
            for seg in blk.segments:
                c0, c1 = seg.c0 + sh, seg.c1 + sh
                assert 0 <= c0 < c1 <= s2, (seg, sh)
                r = np.arange(r0, r1)[:, None] - r0
                c = np.arange(c0, c1)[None] - c0
                if seg.kind == FULL:
                    keep = np.ones((r1 - r0, c1 - c0), bool)
                elif seg.kind == CAUSAL:
                    keep = c <= r
                elif seg.kind == RCAUSAL:
                    keep = (c1 - c0 - 1 - c) <= (r1 - r0 - 1 - r)
                else:
                    assert seg.kind == MASKED
                    keep = inside[r0:r1, c0:c1] if seg.band else np.ones((r1 - r0, c1 - c0), bool)
                cnt[r0:r1, c0:c1] += keep
    return cnt, inside


@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_the_band_exactly(seed):
    """Every (row, key) the band keeps is computed exactly once; nothing else is (tile skipping)."""
    rng = np.random.default_rng(seed)
    s1, s2 = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    pre, nxt = int(rng.integers(-20, 100)), int(rng.integers(-20, 100))
    if pre + nxt < 0:
        pre = -nxt
    bq = int(rng.integers(1, 40))
    for split in (False, True):
        for batched in (False, True):
            cnt, inside = _kept_by_plan(s1, s2, (pre, nxt), bq, split, batched)
            assert (cnt <= 1).all(), "a key computed twice"
            assert np.array_equal(cnt == 1, inside), (s1, s2, pre, nxt, bq, split, batched)
    dead = np.zeros(s1, bool)
    for a, b in dead_row_ranges(0, s1, s2, (pre, nxt)):
        dead[a:b] = True
    assert np.array_equal(dead, ~inside.any(axis=1))
    assert np.array_equal(band_dead_rows(0, s1, s2, (pre, nxt), "cpu").numpy(), dead)


def test_plan_causal_is_one_call():
    blocks = plan_batch(8192, 8192, (2 ** 31, 0), False, 256, 4096)
    assert len(blocks) == 1 and [s.kind for s in blocks[0].segments] == [CAUSAL]


def test_plan_band_visits_only_the_band():
    """Band 256/256 at S = 8192: computed keys per row stay below 2x the band width."""
    cnt, inside = _kept_by_plan(2048, 2048, (256, 256), 192, False, True)
    blocks = plan_batch(2048, 2048, (256, 256), False, 256, 4096, band_batched=True, band_block_q=192)
    work = sum((b.i1 - b.i0) * (b.segments[0].c1 - b.segments[0].c0) if b.nb > 1 else
               sum((b.i1 - b.i0) * (s.c1 - s.c0) for s in b.segments) for b in blocks)
    assert work < 2 * inside.sum()


# ---------------------------------------------------------------------------------------------- pse bounds
@pytest.mark.parametrize("seed", range(6))
def test_pse_ranges_drop_only_negligible_tiles(seed):
    g = gen(seed)
    n, kvn, r, s2, d = 8, 2, 37, 203, 32
    q, k = randn((n, r, d), g, F32), randn((kvn, s2, d), g, F32)
    dist = (torch.arange(r)[:, None] + 60 - torch.arange(s2)[None]).abs().to(F32)
    slopes = torch.tensor([3.0 / (h + 1) * (2 if seed % 2 else 1) for h in range(n)])
    pse = -slopes[:, None, None] * dist + randn((n, r, s2), g, F32, std=0.5)
    if seed == 5:
        pse[:, 3, 7] = float("nan")                         # NaN never lets a tile be dropped wrongly
    scale = 1 / math.sqrt(d)
    ranges = needed_ranges(q, k, pse, scale, n // kvn, 16)
    s = scale * torch.einsum("nrd,nsd->nrs", q.double(), k.double().repeat_interleave(n // kvn, 0)) + pse.double()
    m = torch.nan_to_num(s, nan=-1e300).amax(-1, keepdim=True)
    for h, (c0, c1) in enumerate(ranges):
        hs = slice(h * (n // kvn), (h + 1) * (n // kvn))
        outside = torch.ones(s2, dtype=torch.bool)
        outside[c0:c1] = False
        assert (s[hs][..., outside] < m[hs] - THRESH + 1).all()
    assert any(c1 - c0 < s2 for c0, c1 in ranges) or seed == 5


# ---------------------------------------------------------------------------------------------- dense cases
CASES = {
    "nomask": dict(),
    "causal2": dict(sparse_mode=2, tmpl=True),
    "causal3": dict(sparse_mode=3, tmpl=True),
    "band4": dict(sparse_mode=4, tmpl=True, pre_tokens=45, next_tokens=13),
    "band4-neg-next": dict(sparse_mode=4, tmpl=True, pre_tokens=70, next_tokens=-9),
    "band4-neg-pre": dict(sparse_mode=4, tmpl=True, pre_tokens=-6, next_tokens=80),
    "band4-wide": dict(sparse_mode=4, tmpl=True, pre_tokens=300, next_tokens=2),
    "band0-user": dict(sparse_mode=0, user=0.3, pre_tokens=40, next_tokens=5),
    "band0-user-dense": dict(sparse_mode=0, user=0.97, pre_tokens=60, next_tokens=0),
    "all-mask": dict(sparse_mode=1, user=0.4),
    "all-mask-dense": dict(sparse_mode=1, user=0.99),
    "pse": dict(pse=True),
    "pse-band4": dict(pse=True, sparse_mode=4, tmpl=True, pre_tokens=50, next_tokens=50),
    "pse-user": dict(pse=True, sparse_mode=1, user=0.5),
}
LENGTHS = {
    "full": (None, None),
    "s1<s2": ([150, 277], [301, 333]),
    "s1>s2": ([333, 290], [97, 210]),
    "ragged": ([1, 333], [333, 2]),
}


def _case_kw(name, lens, dtype, seed, B=2, N=8, KVN=2, SQ=333, SKV=333, D=64):
    c = CASES[name]
    act_q, act_kv = LENGTHS[lens]
    kw, g = dense(seed, dtype, B, N, KVN, SQ, SKV, D, act_q, act_kv)
    if c.get("tmpl"):
        kw["atten_mask"] = template_mask()
    if "user" in c:
        kw["atten_mask"] = randmask((1, SQ + 3, SKV + 5), g, c["user"]).to(torch.int8)   # padded mask
        kw["atten_mask"][0, 5] = 1                                                       # one fully masked row
    if c.get("pse"):
        kw["pse_shift"] = randn((1, N, SQ + 2, SKV + 7), g, dtype, std=2.0)                 # broadcast over B
    for key in ("sparse_mode", "pre_tokens", "next_tokens"):
        if key in c:
            kw[key] = c[key]
    return kw


@pytest.mark.parametrize("lens", list(LENGTHS))
@pytest.mark.parametrize("name", list(CASES))
def test_dense_vs_golden(name, lens, tiles):
    kw = _case_kw(name, lens, BF16, seed_of(name, lens))
    golden_check(FIA, kw)


@pytest.mark.parametrize("name", ["causal3", "band4-neg-next", "band0-user", "all-mask-dense", "pse-user"])
@pytest.mark.parametrize("ip", [0, 1, 2, 3])
def test_inner_precise_and_fully_masked_rows(name, ip, tiles):
    """Rows whose keys are all user-masked: mean of V / lse ~ -1e12 (bit 1 clear) or 0 / +inf (bit 1 set)."""
    kw = _case_kw(name, "s1<s2", F16, seed_of(name, ip))
    kw["inner_precise"] = ip
    golden_check(FIA, kw)


@pytest.mark.parametrize("n,kvn", [(4, 4), (8, 1), (16, 2)])
def test_gqa_groups(n, kvn, tiles):
    kw = _case_kw("band4", "s1<s2", BF16, seed_of(n, kvn), N=n, KVN=kvn)
    golden_check(FIA, kw)


def test_pse_per_batch_and_skipping(tiles):
    """pse (B, N, ...) with an ALiBi-like bias: the tile-skipping path must match the golden."""
    kw, g = dense(7, BF16, B=2, N=8, KVN=2, SQ=300, SKV=280, act_q=[300, 211], act_kv=[280, 199])
    dist = (torch.arange(300)[:, None] - torch.arange(280)[None]).abs().float()
    slopes = torch.tensor([2.0 ** (-(h + 1) / 2) for h in range(8)])
    pse = (-slopes[None, :, None, None] * dist + torch.randn(2, 8, 300, 280, generator=g)).to(BF16)
    kw["pse_shift"] = pse
    golden_check(FIA, kw)


@pytest.mark.parametrize("layout", ["BSH", "BSND"])
def test_strided_layouts(layout, tiles):
    kw, g = dense(3, F16, B=2, N=4, KVN=2, SQ=130, SKV=170, D=32)
    to = {"BSH": lambda x: x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1),
          "BSND": lambda x: x.permute(0, 2, 1, 3)}[layout]
    kw.update(query=to(kw["query"]).contiguous(), key=to(kw["key"]).contiguous(),
              value=to(kw["value"]).contiguous(), input_layout=layout, atten_mask=template_mask(), sparse_mode=3)
    golden_check(FIA, kw)


@pytest.mark.parametrize("sparse", [0, 3])
def test_left_padding(sparse, tiles):
    B, N, KVN, SQ, SKV, D = 2, 4, 2, 200, 240, 32
    g = gen(11 + sparse)
    q, k, v = randn((B, N, SQ, D), g, F16), randn((B, KVN, SKV, D), g, F16), randn((B, KVN, SKV, D), g, F16)
    qpad, kvpad, aq, akv = 13, 21, [150, 187], [200, 90]
    for b in range(B):                                      # poison outside [S - pad - act, S - pad)
        q[b, :, :SQ - qpad - aq[b]] = float("nan")
        q[b, :, SQ - qpad:] = float("nan")
        k[b, :, :SKV - kvpad - akv[b]] = float("nan")
        k[b, :, SKV - kvpad:] = float("nan")
        v[b] = torch.where(torch.isnan(k[b]), torch.full_like(v[b], float("nan")), v[b])
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.2,
              actual_seq_lengths=aq, actual_seq_lengths_kv=akv, query_padding_size=torch.tensor([qpad]),
              kv_padding_size=torch.tensor([kvpad]), sparse_mode=sparse,
              pse_shift=randn((1, N, SQ, SKV), g, F16))
    kw["atten_mask"] = randmask((SQ, SKV), g, 0.3) if sparse == 0 else template_mask()
    golden_check(FIA, kw)


@pytest.mark.parametrize("sparse", [3, 4])
def test_tnd_packed(sparse, tiles):
    N, KVN, D = 4, 2, 32
    lq, lkv = [37, 0, 129, 64], [80, 10, 129, 200]
    g = gen(20 + sparse)
    q, k, v = randn((sum(lq), N, D), g, BF16), randn((sum(lkv), KVN, D), g, BF16), randn((sum(lkv), KVN, D), g, BF16)
    cum = lambda xs: [int(x) for x in np.cumsum(xs)]  # noqa: E731
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="TND", scale=0.17,
              actual_seq_lengths=cum(lq), actual_seq_lengths_kv=cum(lkv), sparse_mode=sparse,
              atten_mask=template_mask())
    if sparse == 4:
        kw.update(pre_tokens=30, next_tokens=-3)
    with fia.validation_mode("portable"):       # D 32 and dense sparse 4: outside SPEC 14b.4 (T16, T2) in strict mode
        golden_check(FIA, kw)


@pytest.mark.parametrize("case", ["causal3", "band0-user", "pse"])
def test_shared_prefix(case, tiles):
    kw = _case_kw(case, "s1>s2", BF16, seed_of("prefix", case), SKV=300)
    g = gen(5)
    P = 45
    kp, vp = randn((1, 2, 60, 64), g, BF16), randn((1, 2, 60, 64), g, BF16)
    kp[:, :, P:] = float("nan")
    vp[:, :, P:] = float("nan")
    kw.update(key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[P])
    if "atten_mask" in kw and kw.get("sparse_mode", 0) in (0, 1):
        kw["atten_mask"] = randmask((1, 333, 300 + P), g, 0.3)
    if "pse_shift" in kw:
        kw["pse_shift"] = randn((1, 8, 333, 300 + P), g, BF16)
    golden_check(FIA, kw)


@pytest.mark.parametrize("masked", ["none", "band", "user"])
def test_learnable_sink(masked, tiles):
    F2 = fia.npu_fused_infer_attention_score_v2
    g = gen(31)
    N, KVN, S, D = 8, 2, 150, 64
    q, k, v = randn((1, N, S, D), g, BF16), randn((1, KVN, S, D), g, BF16), randn((1, KVN, S, D), g, BF16)
    kw = dict(query=q, key=k, value=v, num_query_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
              softmax_scale=0.125, learnable_sink=randn((N,), g, F32, std=2.0))
    if masked == "band":
        kw.update(atten_mask=template_mask(), sparse_mode=4, pre_tokens=20, next_tokens=-2)
    elif masked == "user":
        m = randmask((S, S), g, 0.6)
        m[3] = True
        kw.update(atten_mask=m, sparse_mode=1)
    golden_check(F2, kw, lse_key="return_softmax_lse")


@pytest.mark.parametrize("dtype", [F32, F64])
def test_float32_float64_portable(dtype, tiles):
    kw = _case_kw("band0-user", "s1>s2", F16, 41)
    for key in ("query", "key", "value"):
        kw[key] = kw[key].to(dtype)
    with fia.validation_mode("portable"):
        golden_check(FIA, kw, dtype=dtype)


def test_int8_kv_antiquant(tiles):
    """int8 K/V with a bf16 query (Q_S <= 16): dequantized in float32, float32 kernel."""
    g = gen(9)
    B, N, KVN, SQ, SKV, D = 2, 8, 2, 16, 300, 64
    q = randn((B, N, SQ, D), g, BF16)
    k = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    ks = ((torch.rand(KVN, D, generator=g) + 0.5) / 64).to(BF16)
    vs = ((torch.rand(KVN, D, generator=g) + 0.5) / 64).to(BF16)
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.125,
              key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=0, value_antiquant_mode=0,
              atten_mask=template_mask(), sparse_mode=3, actual_seq_lengths_kv=[300, 123])
    golden_check(FIA, kw)


# ---------------------------------------------------------------------------------------------- scope
def test_declared_unsupported():
    from fia.errors import FiaBackendUnavailable
    g = gen(1)
    q, k = randn((1, 4, 1, 64), g, F16), randn((1, 4, 50, 64), g, F16)
    with fia.use_backend("prefill"), pytest.raises(FiaBackendUnavailable, match="decode"):
        FIA(q, k, k, num_heads=4, input_layout="BNSD")
    qi = torch.randint(-5, 5, (1, 4, 20, 64), generator=g, dtype=torch.int8)
    ki = torch.randint(-5, 5, (1, 4, 30, 64), generator=g, dtype=torch.int8)
    with fia.use_backend("prefill"), pytest.raises(FiaBackendUnavailable, match="int8"):
        FIA(qi, ki, ki, num_heads=4, input_layout="BNSD", dequant_scale1=torch.tensor([0.1]),
            quant_scale1=torch.tensor([10.0]), dequant_scale2=torch.tensor([0.1]))


def test_automatic_choice_prefers_prefill():
    g = gen(2)
    q, k = randn((1, 4, 64, 64), g, F16), randn((1, 4, 64, 64), g, F16)
    p = fia.explain(q, k, k, num_heads=4, input_layout="BNSD")
    assert p.selected == "prefill"


@pytest.mark.skipif(not os.environ.get("FIA_PREFILL_MEMTEST"), reason="set FIA_PREFILL_MEMTEST=1 (slow: ~1 min)")
def test_memory_32k_causal_below_1gb():
    """B=1, N=8, S=32768, D=128 causal bf16: extra peak RSS < 1 GB (fresh subprocess)."""
    r = subprocess.run([sys.executable, "-m", "fia.bench.prefill_tiles", "mem"], capture_output=True,
                       text=True, check=True)
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["peak_extra_mb"] is not None and rec["peak_extra_mb"] < 1024, rec


@pytest.mark.parametrize("tiles", ["small"], indirect=True)
def test_int8_kv_with_pse_skipping(tiles):
    """float32 kernel (antiquant) with a bf16 pse on the tile-skipping path: the bias follows the kernel dtype."""
    g = gen(19)
    B, N, KVN, SQ, SKV, D = 1, 4, 2, 16, 200, 64
    q = randn((B, N, SQ, D), g, BF16)
    k = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    ks = ((torch.rand(KVN, D, generator=g) + 0.5) / 64).to(BF16)
    dist = (torch.arange(SQ)[:, None] + 100 - torch.arange(SKV)[None]).abs().float()
    pse = (-dist * torch.tensor([1.0, 0.5, 0.25, 0.1])[None, :, None, None]).to(BF16)
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.125,
              key_antiquant_scale=ks, value_antiquant_scale=ks.clone(), key_antiquant_mode=0,
              value_antiquant_mode=0, pse_shift=pse)
    golden_check(FIA, kw)


# the own bf16 kernel where it runs natively (else it is emulated: slow, and covered by its own tests)
KERNELS = ("aten", "own") if prefill_flash.ENABLED_DEFAULT or prefill_flash.HAS_DP else ("aten",)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("B,mask", [(1, "causal"), (1, "none"), (1, "band"), (2, "causal")])
def test_extreme_values_give_the_references_answer(kernel, B, mask, monkeypatch):
    """NaN / Inf inputs, V beyond the kernels' safe range and scores beyond float32's (q at bf16's maximum, an
    infinite key): the NaN / Inf pattern of output and lse is the reference's and the finite values the reference's
    numbers, with one kernel call for the whole window (B = 1, causal / unmasked: its findings decide the checks) and
    in the blocked path, on ATen's kernel (which zeroes the output of a row whose score overflows) and on the own."""
    monkeypatch.setattr(prefill_flash, "ENABLED", kernel == "own")
    monkeypatch.setattr(prefill_flash, "SMALL_ATEN_POSITIONS", 0 if kernel == "own" else 64 * 64)
    N, KVN, S, D = 4, 2, 24, 64
    tmpl = template_mask()
    for what in EXTREMES:
        g = gen(len(what) + B)
        q, k, v = randn((B, N, S, D), g, BF16), randn((B, KVN, S, D), g, BF16), randn((B, KVN, S, D), g, BF16)
        plant_extreme(what, q, k, v)
        kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=D ** -0.5, softmax_lse_flag=True)
        if mask == "causal":
            kw.update(sparse_mode=3, atten_mask=tmpl)
        elif mask == "band":
            kw.update(sparse_mode=4, atten_mask=tmpl, pre_tokens=6, next_tokens=0)
        with fia.use_backend("prefill"):
            out, lse = FIA(q, k, v, **kw)
        with fia.use_backend("reference"):
            ref_o, ref_l = FIA(q, k, v, **kw)

        def pattern(t):
            t = t.float()
            return torch.stack([torch.isnan(t), torch.isposinf(t), torch.isneginf(t)])
        assert torch.equal(pattern(out), pattern(ref_o)) and torch.equal(pattern(lse), pattern(ref_l)), what
        fin = torch.isfinite(ref_o.float())
        a, b = out.float()[fin], ref_o.float()[fin]
        assert float((a - b).abs().max()) <= 2e-2 * max(1.0, float(b.abs().max())), what
