"""The prefill backend for every softmax scale: 0, negative, tiny and huge finite, with every causal geometry.

ATen's CPU flash kernel applies its is_causal -inf before the scale (-inf * 0 = NaN, -inf * -s = +inf), and a
kernel's -inf mask is not SPEC 3's finite fill -1e12, which wins in rows whose visible scores all lie below it
(huge |scale|). Each case runs the same call on the prefill backend and on the reference backend (same inputs,
lse on) and compares out and lse; both fused kernels are covered (the machine's default and ATen's, with
default and tiny tiles). Padding past the actual lengths is NaN-poisoned. Scale 0 is also checked against a
float64 formula: uniform weights over the keys each row sees.
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
from fia.backends.prefill import flash as prefill_flash
from fia.backends import registry
from util import assert_close, gen, randn, seed_of, template_mask

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
FIA = fia.npu_fused_infer_attention_score
SCALES = (0.0, -0.3, -1.0, 1e-30, 0.088, 1e30, -1e30)
MODES = ("s0-causal-mask", "s2", "s3", "s4")
KERNELS = ("default", "aten", "aten-small")
LSE_TOL = {BF16: 1e-3, F16: 1e-3, F32: 1e-5, F64: 1e-10}


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param.startswith("aten"):                     # ATen's kernel for every dtype
        for flag in ("ENABLED", "ENABLED_F16", "ENABLED_F32"):
            monkeypatch.setattr(prefill_flash, flag, False)
    if request.param == "aten-small":                        # many row blocks, band tiles, merged segments
        be = registry.by_name("prefill")
        for k, v in dict(block_q=32, band_block_q=32, mask_chunk_elems=4096).items():
            monkeypatch.setattr(be, k, v)
    return request.param


# ---------------------------------------------------------------------------------------------- harness
def _call(dtype, scale, mode, seed, B=2, N=4, KVN=2, SQ=100, SKV=120, D=64, act_q=(70, 100), act_kv=(120, 60)):
    """kwargs of one call; batch 1 has more rows than keys (sparse 3 / 4 leave its first rows without a key)."""
    g = gen(seed)
    q, k, v = randn((B, N, SQ, D), g, dtype), randn((B, KVN, SKV, D), g, dtype), randn((B, KVN, SKV, D), g, dtype)
    if act_q is not None:
        for b in range(B):
            q[b, :, act_q[b]:] = float("nan")
            k[b, :, act_kv[b]:] = float("nan")
            v[b, :, act_kv[b]:] = float("nan")
    kw = dict(query=q, key=k, value=v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=scale,
              softmax_lse_flag=True)
    if act_q is not None:
        kw.update(actual_seq_lengths=list(act_q), actual_seq_lengths_kv=list(act_kv))
    if mode == "s0-causal-mask":
        kw.update(atten_mask=torch.triu(torch.ones(SQ, SKV, dtype=torch.bool), 1), sparse_mode=0)
    else:
        kw.update(atten_mask=template_mask(), sparse_mode=int(mode[1]))
    if mode == "s4":
        kw.update(pre_tokens=30, next_tokens=5)
    return kw


def _run(backend, kw):
    with fia.validation_mode("portable"), fia.use_backend(backend):
        return FIA(**kw)


def _check(kw, dtype):
    out, lse = _run("prefill", kw)
    rout, rlse = _run("reference", kw)
    assert out.dtype == rout.dtype == dtype and out.shape == rout.shape
    assert_close(out, rout, dtype)
    lse, rlse = lse.double(), rlse.double()
    assert torch.equal(torch.isposinf(lse), torch.isposinf(rlse)), "rows without keys differ (+inf lse)"
    fin = torch.isfinite(rlse)
    assert torch.isfinite(lse[fin]).all(), "lse not finite where the reference is"
    err = ((lse[fin] - rlse[fin]).abs() / (1 + rlse[fin].abs())).max().item()
    assert err <= LSE_TOL[dtype], f"lse rel err {err:.3g} > {LSE_TOL[dtype]:g}"
    dead = torch.isposinf(rlse)[..., 0]                                  # [B, N, S]
    assert (out[dead] == 0).all(), "rows without keys must be exactly 0"
    return out, lse, rout, rlse


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", [BF16, F16, F32, F64], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", SCALES)
def test_scales_vs_reference(scale, mode, dtype, kernel):
    kw = _call(dtype, scale, mode, seed_of(scale, mode, str(dtype)))
    _, _, _, rlse = _check(kw, dtype)
    if abs(scale) >= 1e30 and mode in ("s0-causal-mask", "s2"):
        # rows seeing one key with a score of -1e30: the masked keys' finite fill takes the weight
        assert (rlse < -1e11).any(), "the case should contain rows where the mask fill dominates"


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("mode", ["s2", "s3"])
@pytest.mark.parametrize("scale", SCALES)
def test_scales_one_call(scale, mode, dtype, kernel):
    """B = 1, the whole window valid: the kernel's own output is returned (one causal call)."""
    kw = _call(dtype, scale, mode, seed_of("one", scale, mode, str(dtype)), B=1, SQ=150, SKV=150, act_q=None)
    _check(kw, dtype)


def _visible(mode, s1, s2):
    """[S1, S2] bool: the keys each row sees (SPEC 5), from the sparse mode's definition."""
    i = torch.arange(s1)[:, None]
    j = torch.arange(s2)[None]
    if mode in ("s0-causal-mask", "s2"):
        return j <= i
    if mode == "s3":
        return j <= i + (s2 - s1)
    return (j >= i + s2 - s1 - 30) & (j <= i + s2 - s1 + 5)            # s4: pre 30, next 5, bottom-right


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_scale_zero_is_uniform_over_visible_keys(mode, dtype, kernel):
    """Scale 0 in float64: out = mean of V over the row's visible keys, lse = log(count); no key: 0 / +inf."""
    kw = _call(dtype, 0.0, mode, seed_of("zero", mode, str(dtype)))
    out, lse = _run("prefill", kw)
    v = kw["value"].to(F64)
    G = kw["num_heads"] // kw["num_key_value_heads"]
    for b, (s1, s2) in enumerate(zip(kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"])):
        vis = _visible(mode, s1, s2).to(F64)                            # [S1, S2]
        cnt = vis.sum(-1)                                                # [S1]
        want = (vis @ v[b, :, :s2]) / cnt.clamp(min=1)[:, None]          # [KV_N, S1, Dv]
        want = want.repeat_interleave(G, dim=0)                          # [N, S1, Dv]
        want_lse = torch.where(cnt > 0, cnt.log(), torch.tensor(math.inf, dtype=F64)).expand(want.shape[0], -1)
        got = out[b, :, :s1].to(F64)
        assert_close(got, want, dtype)
        assert ((got[:, cnt == 0]) == 0).all()
        assert torch.equal(lse[b, :, :s1, 0].isposinf(), want_lse.isposinf())
        fin = cnt > 0
        err = (lse[b, :, :s1, 0].double()[:, fin] - want_lse[:, fin]).abs().max().item()
        assert err <= LSE_TOL[dtype], f"lse abs err {err:.3g}"


@pytest.mark.parametrize("scale", [0.0, -0.3, 1e30, -1e30])
def test_bottom_right_first_rows(scale, kernel):
    """Sparse mode 3 with more rows than keys: the first S1 - S2 rows see no key (0 / +inf, as the reference);
    row S1 - S2 sees key 0 only, its 39 other keys score the fill -1e12 (float64 formula below)."""
    kw = _call(F32, scale, "s3", seed_of("br", scale), B=1, SQ=90, SKV=40, act_q=None)
    out, lse, _, rlse = _check(kw, F32)
    assert (out[0, :, :50] == 0).all() and torch.isposinf(lse[0, :, :50]).all()
    assert torch.isposinf(rlse[0, :, :50]).all()
    q = kw["query"][0, :, 50].to(F64)                                    # [N, D]
    k = kw["key"][0].to(F64).repeat_interleave(2, dim=0)                 # [N, S2, D]
    v = kw["value"][0].to(F64).repeat_interleave(2, dim=0)               # [N, S2, Dv]
    s = scale * (q * k[:, 0]).sum(-1)                                    # [N] the one visible score
    lf = torch.tensor(-1e12 + math.log(39), dtype=F64)
    L = torch.logaddexp(s, lf)
    want = torch.exp(s - L)[:, None] * v[:, 0] + torch.exp(lf - L)[:, None] * v[:, 1:].mean(dim=1)   # [N, Dv]
    assert_close(out[0, :, 50], want, F32)
    err = ((lse[0, :, 50, 0].double() - L).abs() / (1 + L.abs())).max().item()
    assert err <= 1e-5, f"lse rel err {err:.3g}"


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("scale", [0.0, -0.3, 1e30, -1e30])
def test_random_user_mask_and_pse(scale, dtype, kernel):
    """A random user mask (rows keep few keys, one row keeps none) with pse: the fill of the masked keys
    merges with an arbitrary visible set."""
    kw = _call(dtype, scale, "s0-causal-mask", seed_of("user", scale, str(dtype)))
    g = gen(seed_of("user-mask", scale))
    mask = torch.rand(100, 120, generator=g) < 0.9                       # [SQ, SKV] True = masked
    mask[7] = True
    kw["atten_mask"] = mask.to(torch.int8)
    kw["pse_shift"] = randn((1, 4, 100, 120), g, dtype)
    _, _, _, rlse = _check(kw, dtype)
    if abs(scale) >= 1e30:
        assert (rlse < -1e11).any()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_values_near_the_float32_maximum(mode, dtype, kernel):
    """V of 2e38 - 3.3e38 (both signs): the fused kernels' sums of weights x values would overflow; V is scaled by
    a power of two around them, so the output is the reference's (which normalizes first), not inf."""
    kw = _call(dtype, 0.088, mode, seed_of("huge-v", mode, str(dtype)))
    g = gen(seed_of("huge-v-values", mode))
    v = kw["value"]
    big = (torch.rand(v.shape, generator=g, dtype=torch.float64) * 1.3e38 + 2e38)
    big = big * torch.where(torch.rand(v.shape, generator=g) < 0.3, -1.0, 1.0)
    kw["value"] = torch.where(torch.isnan(v), v.double(), big).to(dtype)          # the NaN padding kept
    out, _, rout, _ = _check(kw, dtype)
    assert torch.isfinite(rout).all() and torch.isfinite(out).all()
