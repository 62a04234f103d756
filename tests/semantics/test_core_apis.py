"""npu_incre_flash_attention and npu_prompt_flash_attention (SPEC 1.1, 5)."""

import pytest
import torch

import fia
import naive
from util import (assert_close, check_dense, gen, mask_as, randmask, randn, seed_of, template_mask, to_layout)

F16, BF16 = torch.float16, torch.bfloat16


def qkv(seed, b, n, kvn, sq, skv, d, dtype=F16):
    g = gen(seed)
    return randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)


# ----------------------------------------------------------------------------------------------- incre
@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("kvn", [4, 1], ids=lambda x: f"kvn{x}")
def test_incre_basic(kvn, layout, dt):
    """Decode; actual_seq_lengths are the KV lengths; scale_value; returns only the output tensor."""
    dtype = {"fp16": F16, "bf16": BF16}[dt]
    b, n, skv, d = 3, 4, 27, 64
    q, k, v = qkv(seed_of("ifa", kvn, layout, dt), b, n, kvn, 1, skv, d, dtype)
    akv = [27, 3, 14]
    out, _, _, _ = check_dense(q, k, v, layout=layout, api="incre", act_kv=akv,
                               len_kw={"actual_seq_lengths": akv}, scale=0.11)
    assert isinstance(out, torch.Tensor)


@pytest.mark.case(q_s=1)
def test_incre_returns_tensor_only():
    q, k, v = qkv(1, 2, 2, 2, 1, 5, 16)
    r = fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", scale_value=0.25)
    assert isinstance(r, torch.Tensor) and tuple(r.shape) == (2, 2, 1, 16)
    ref, _ = naive.attention(q, k, v, scale=0.25)
    assert_close(r, ref, F16)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("kind", ["bool", "int8", "uint8"])
def test_incre_mask_and_pse(kind):
    b, n, skv, d = 2, 4, 19, 32
    seed = seed_of("ifa-mask", kind)
    q, k, v = qkv(seed, b, n, 2, 1, skv, d)
    g = gen(seed + 1)
    mask = randmask((b, skv), g, 0.3)
    mask[0, :] = True               # fully masked batch: inner_precise defaults to 1 -> mean of V
    pse = randn((b, n, 1, skv), g, F16)
    check_dense(q, k, v, layout="BSH", api="incre", atten_mask=mask_as(mask, kind), pse=pse,
                act_kv=[19, 7], len_kw={"actual_seq_lengths": [19, 7]})


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("ip", [0, 1])
def test_incre_inner_precise(ip):
    q, k, v = qkv(seed_of("ifa-ip", ip), 2, 2, 1, 1, 12, 16)
    out = fia.npu_incre_flash_attention(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"),
                                        num_heads=2, num_key_value_heads=1, scale_value=0.3, inner_precise=ip,
                                        actual_seq_lengths=[12, 4])
    ref, _ = naive.attention(q, k, v, scale=0.3, kv_windows=[(0, 12), (0, 4)])
    assert_close(out.reshape(2, 1, 2, 16).permute(0, 2, 1, 3), ref, F16)


@pytest.mark.case(q_s=1)
def test_incre_tensor_list():
    b, n, d = 3, 2, 32
    lens = [4, 11, 6]
    g = gen(808)
    q = randn((b, n, 1, d), g, F16)
    ks = [randn((n, s, d), g, F16) for s in lens]
    vs = [randn((n, s, d), g, F16) for s in lens]
    out = fia.npu_incre_flash_attention(q, [x.unsqueeze(0) for x in ks], [x.unsqueeze(0) for x in vs],
                                        num_heads=n, input_layout="BNSD", scale_value=0.2)
    ref, _ = naive.attention(q, ks, vs, scale=0.2)
    assert_close(out, ref, F16)


# ----------------------------------------------------------------------------------------------- prompt
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
def test_prompt_no_mask(layout, dt):
    """Without a mask nothing is masked even though next_tokens defaults to 0 (sparse 0 ignores pre/next)."""
    dtype = {"fp16": F16, "bf16": BF16}[dt]
    q, k, v = qkv(seed_of("pfa", layout, dt), 2, 4, 2, 13, 21, 32, dtype)
    out, _, _, _ = check_dense(q, k, v, layout=layout, api="prompt", act_q=[13, 6], act_kv=[21, 9],
                               scale=0.17)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("kind", ["bool", "int8", "uint8"])
def test_prompt_default_next_tokens_is_causal_band(kind):
    """npu_prompt_flash_attention defaults next_tokens=0: with a mask and sparse 0, mask OR j > i (SPEC 5)."""
    b, n, sq, skv, d = 2, 2, 12, 12, 16
    seed = seed_of("pfa-causal", kind)
    q, k, v = qkv(seed, b, n, n, sq, skv, d)
    mask = randmask((sq, skv), gen(seed + 1), 0.15)
    out, _, _, _ = check_dense(q, k, v, layout="BSH", api="prompt", atten_mask=mask_as(mask, kind),
                               naive_next=0)
    # the band is really there: a zero mask still gives causal attention
    zero = torch.zeros(sq, skv, dtype=torch.bool)
    check_dense(q, k, v, layout="BSH", api="prompt", atten_mask=mask_as(zero, kind), naive_next=0)


def test_prompt_explicit_next_tokens():
    q, k, v = qkv(31, 2, 2, 2, 10, 16, 16)
    mask = randmask((2, 1, 10, 16), gen(32), 0.2)
    check_dense(q, k, v, layout="BNSD", api="prompt", atten_mask=mask, pre_tokens=3, next_tokens=4,
                act_q=[10, 7], act_kv=[16, 12])


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_prompt_high_precision_sparse_modes(mode):
    """sparse_mode 10..14 == sparse_mode - 10 (SPEC 1.1)."""
    b, n, sq, skv, d = 2, 4, 11, 17, 32
    seed = seed_of("pfa-hp", mode)
    q, k, v = qkv(seed, b, n, 2, sq, skv, d)
    if mode in (0, 1):
        mask = randmask((b, sq, skv), gen(seed + 1), 0.25)
    else:
        mask = template_mask()
    kw = dict(layout="BSND", api="prompt", atten_mask=mask, act_q=[11, 8], act_kv=[17, 5], pre_tokens=6,
              next_tokens=2)
    lo, _, _, _ = check_dense(q, k, v, sparse_mode=mode, **kw)
    hi, _, _, _ = check_dense(q, k, v, sparse_mode=mode + 10, naive_sparse=mode, **kw)
    # same semantics; only rounding may differ
    assert (lo.double() - hi.double()).abs().max().item() <= 1e-2 * max(lo.double().abs().max().item(), 1e-6)


def test_prompt_pse_gqa():
    b, n, sq, skv, d = 2, 8, 9, 14, 16
    g = gen(4040)
    q, k, v = randn((b, n, sq, d), g, BF16), randn((b, 2, skv, d), g, BF16), randn((b, 2, skv, d), g, BF16)
    pse = randn((1, n, sq, skv), g, BF16)
    check_dense(q, k, v, layout="BSH", api="prompt", pse=pse, act_kv=[14, 10])
