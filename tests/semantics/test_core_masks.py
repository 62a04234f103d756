"""atten_mask dtypes/shapes, sparse modes 0-4, pre/next, rows without keys and inner_precise (SPEC 5, 6)."""

import pytest
import torch

from util import (INT_MAX, check_dense, gen, mask_as, randmask, randn, seed_of, template_mask)

F16, BF16 = torch.float16, torch.bfloat16
KINDS = ["bool", "int8", "uint8"]


def qkv(seed, b, n, kvn, sq, skv, d, dtype=F16):
    g = gen(seed)
    return randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)


# ----------------------------------------------------------------------------------------------- mask shapes
PREFILL_SHAPES = ["QK", "1QK", "BQK", "11QK", "B1QK"]


def prefill_mask(shape, b, sq, skv, g, pad=(0, 0)):
    """A random mask of the named shape, possibly oversized by pad; the pad region is random noise
    (top-left is used, SPEC 5)."""
    qq, kk = sq + pad[0], skv + pad[1]
    lead = {"QK": (), "1QK": (1,), "BQK": (b,), "11QK": (1, 1), "B1QK": (b, 1)}[shape]
    return randmask(lead + (qq, kk), g, 0.3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("oversized", [False, True], ids=["exact", "oversized"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_prefill_mask_shapes(shape, oversized, kind):
    b, n, sq, skv, d = 2, 4, 10, 23, 32
    seed = seed_of("pmask", shape, oversized, kind)
    q, k, v = qkv(seed, b, n, 2, sq, skv, d)
    g = gen(seed + 1)
    mask = prefill_mask(shape, b, sq, skv, g, pad=(6, 9) if oversized else (0, 0))
    check_dense(q, k, v, layout="BSH", atten_mask=mask_as(mask, kind), sparse_mode=1, act_q=[10, 6],
                act_kv=[23, 14])


def test_oversized_mask_padding_does_not_matter():
    """Same call with the unused region of an oversized mask all 0 and all 1: identical outputs."""
    b, n, sq, skv, d = 2, 2, 8, 13, 16
    q, k, v = qkv(71, b, n, n, sq, skv, d)
    m = randmask((b, 1, sq + 8, skv + 19), gen(72))
    m0, m1 = m.clone(), m.clone()
    m0[..., sq:, :] = False
    m0[..., :, skv:] = False
    m1[..., sq:, :] = True
    m1[..., :, skv:] = True
    o0, _, _, _ = check_dense(q, k, v, layout="BNSD", atten_mask=m0, sparse_mode=1)
    o1, _, _, _ = check_dense(q, k, v, layout="BNSD", atten_mask=m1, sparse_mode=1)
    assert torch.equal(o0, o1)


DECODE_SHAPES = ["BK", "B1K", "B11K"]


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("oversized", [False, True], ids=["exact", "oversized"])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_mask_shapes(shape, oversized, kind):
    b, n, skv, d = 3, 8, 29, 32
    seed = seed_of("dmask", shape, oversized, kind)
    q, k, v = qkv(seed, b, n, 1, 1, skv, d, BF16)
    kk = skv + (11 if oversized else 0)
    lead = {"BK": (b,), "B1K": (b, 1), "B11K": (b, 1, 1)}[shape]
    mask = randmask(lead + (kk,), gen(seed + 1), 0.4)
    check_dense(q, k, v, layout="BSND", atten_mask=mask_as(mask, kind), act_kv=[29, 12, 20])


# ----------------------------------------------------------------------------------------------- sparse modes
# per-batch lengths with S1 < S2, S1 == S2 and S1 > S2
ACT_Q, ACT_KV = [16, 9, 14], [24, 9, 5]
SQ, SKV = 16, 24


def _sparse_case(seed, dtype=F16, layout="BSH"):
    return qkv(seed, 3, 4, 2, SQ, SKV, 32, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pre,nxt", [(INT_MAX, INT_MAX), (3, 2), (0, 0), (20, 0), (2, -1), (-2, 6)],
                         ids=lambda x: str(x))
def test_sparse0_mask_or_band(pre, nxt, kind):
    """sparse 0 with a mask: mask OR outside(pre, next), window-local, top-left band (SPEC 5, 15.3);
    the band may leave rows without keys -> 0 / +inf."""
    seed = seed_of("sm0", pre, nxt, kind)
    q, k, v = _sparse_case(seed)
    mask = randmask((SQ, SKV), gen(seed + 1), 0.2)
    check_dense(q, k, v, atten_mask=mask_as(mask, kind), sparse_mode=0, pre_tokens=pre, next_tokens=nxt,
                act_q=ACT_Q, act_kv=ACT_KV)


@pytest.mark.parametrize("pre,nxt", [(3, 2), (0, 0), (-1, 4)], ids=lambda x: str(x))
def test_sparse0_no_mask_ignores_band(pre, nxt):
    """sparse 0 without a mask: nothing masked, pre/next ignored (SPEC 5)."""
    q, k, v = _sparse_case(seed_of("sm0nm", pre, nxt), BF16)
    check_dense(q, k, v, sparse_mode=0, pre_tokens=pre, next_tokens=nxt, act_q=ACT_Q, act_kv=ACT_KV)


@pytest.mark.parametrize("pre,nxt", [(INT_MAX, INT_MAX), (1, 1), (0, -3)], ids=lambda x: str(x))
def test_sparse1_mask_only(pre, nxt):
    """sparse 1: the full user mask only; pre/next ignored (SPEC 5)."""
    seed = seed_of("sm1", pre, nxt)
    q, k, v = _sparse_case(seed)
    mask = randmask((3, 1, SQ, SKV), gen(seed + 1), 0.35)
    check_dense(q, k, v, layout="BSH", atten_mask=mask, sparse_mode=1, pre_tokens=pre, next_tokens=nxt,
                act_q=ACT_Q, act_kv=ACT_KV)


TEMPLATES = [(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)]
TIDS = ["T2", "T3", "T4"]


@pytest.mark.parametrize("tshape", TEMPLATES, ids=TIDS)
@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_sparse_causal(layout, mode, tshape):
    """sparse 2: j > i; sparse 3: j > i + S2 - S1 (S1 > S2 leaves rows without keys) (SPEC 5)."""
    q, k, v = _sparse_case(seed_of("causal", layout, mode, tshape), BF16)
    check_dense(q, k, v, layout=layout, atten_mask=template_mask(tshape), sparse_mode=mode,
                act_q=ACT_Q, act_kv=ACT_KV, pre_tokens=5, next_tokens=1)   # pre/next ignored in 2/3


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_sparse_causal_full_lengths(mode):
    """Template modes without actual lengths (S1 = Q_S, S2 = KV_S)."""
    q, k, v = qkv(seed_of("full", mode), 2, 2, 2, 12, 20, 16)
    check_dense(q, k, v, layout="BNSD", atten_mask=template_mask(), sparse_mode=mode, pre_tokens=4,
                next_tokens=0)


PN4 = [(INT_MAX, INT_MAX), (4, 0), (0, 3), (6, -2), (-1, 5), (2, 2), (300000000, 300000000), (2 ** 40, 1)]


@pytest.mark.parametrize("tshape", TEMPLATES, ids=TIDS)
@pytest.mark.parametrize("pre,nxt", PN4, ids=lambda x: str(x))
def test_sparse4_band(pre, nxt, tshape):
    """sparse 4: outside(pre - S2 + S1, next + S2 - S1) (bottom-right band); negative pre/next; values above
    214748647 are clamped (SPEC 5)."""
    q, k, v = _sparse_case(seed_of("sm4", pre, nxt, tshape))
    check_dense(q, k, v, atten_mask=template_mask(tshape), sparse_mode=4, pre_tokens=pre, next_tokens=nxt,
                act_q=ACT_Q, act_kv=ACT_KV)


def test_template_uint8():
    """The template of mode 3 passed as uint8 (SPEC 5: bool, int8 or uint8 masks)."""
    q, k, v = _sparse_case(5)
    check_dense(q, k, v, atten_mask=template_mask().to(torch.uint8), sparse_mode=3, act_q=ACT_Q, act_kv=ACT_KV)


# ----------------------------------------------------------------------------------------------- decode ignores
@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("mode,pre,nxt,with_mask", [
    (0, 0, 0, True), (0, 1, -0, False), (1, 0, 0, True), (2, 0, 0, "template"), (3, 1, 0, "template"),
    (4, 0, 0, "template"), (4, -3, 5, "template")],
    ids=["sm0-mask-pre0next0", "sm0-nomask", "sm1", "sm2", "sm3", "sm4", "sm4-neg"])
def test_decode_ignores_sparse(mode, pre, nxt, with_mask):
    """Q_S = 1 without rope: sparse_mode, pre_tokens and next_tokens are ignored; only a plain mask applies
    (SPEC 5, 15.11)."""
    b, n, skv, d = 3, 4, 18, 32
    seed = seed_of("decign", mode, pre, nxt, with_mask)
    q, k, v = qkv(seed, b, n, 2, 1, skv, d)
    mask = None
    if with_mask is True:
        mask = randmask((b, 1, 1, skv), gen(seed + 1), 0.3)
    elif with_mask == "template":
        mask = template_mask()
    check_dense(q, k, v, layout="BSH", atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt,
                act_kv=[18, 5, 11])


# ----------------------------------------------------------------------------------------------- empty rows
def _rows_masked(seed, b, sq, skv, full_rows):
    """Random mask with the given (batch, row) pairs fully masked."""
    m = randmask((b, 1, sq, skv), gen(seed), 0.3)
    for bi, r in full_rows:
        m[bi, 0, r, :] = True
    return m


@pytest.mark.parametrize("ip", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_fully_user_masked_rows(dt, mode, ip):
    """Rows whose band keys are all user-masked: bit 1 set -> 0 / +inf; otherwise mean of V over the valid
    keys and lse ~ -1e12 (SPEC 6, 15.1)."""
    b, n, sq, skv, d = 2, 4, 9, 14, 32
    dtype = {"fp16": F16, "bf16": BF16}[dt]
    seed = seed_of("fullmask", dt, mode, ip)
    q, k, v = qkv(seed, b, n, 2, sq, skv, d, dtype)
    m = _rows_masked(seed + 1, b, sq, skv, [(0, 0), (0, 5), (1, 3), (1, 8)])
    out, lse, ref_o, ref_l = check_dense(q, k, v, layout="BNSD", atten_mask=m, sparse_mode=mode, inner_precise=ip,
                                         act_q=[9, 7], act_kv=[14, 10])
    if ip & 2:
        assert torch.isposinf(lse[0, :, 0]).all() and (out[0, :, 0] == 0).all()
    else:
        assert (lse[0, :, 0] < -1e11).all()
        # mean of V over all valid keys of batch 1 (act_kv = 10)
        g = 2
        for h in range(n):
            mv = v[1, h // g, :10].double().mean(0)
            assert (out[1, h, 3].double() - mv).abs().max() <= 1e-2 * max(mv.abs().max().item(), 1e-6) + 1e-3


@pytest.mark.parametrize("ip", [0, 1, 2, 3])
def test_fully_user_masked_rows_with_band(ip):
    """Mode 0 with a mask and a band: a row whose band keys are all user-masked (but other keys are not) is a
    user-masked row -> mean of V over all valid keys without bit 1 (SPEC 6)."""
    b, n, sq, skv, d = 1, 2, 8, 8, 16
    q, k, v = qkv(seed_of("bandmask", ip), b, n, n, sq, skv, d)
    m = torch.zeros(sq, skv, dtype=torch.bool)
    m[4, 2:5] = True          # row 4: band keys j in [2, 4] (pre=2, next=0) all user-masked
    m[6, 0:3] = True          # row 6: band keys j in [4, 6] open -> normal row
    check_dense(q, k, v, layout="BSH", atten_mask=m, sparse_mode=0, pre_tokens=2, next_tokens=0,
                inner_precise=ip)


@pytest.mark.parametrize("ip", [0, 1, 2, 3])
@pytest.mark.parametrize("case", ["sm3-s1>s2", "sm4-neg-next", "sm0-band"])
def test_geometry_empty_rows(case, ip):
    """Rows the band geometry leaves without any key: 0 / +inf whatever inner_precise says (SPEC 6)."""
    b, n, sq, skv, d = 2, 4, 12, 12, 16
    q, k, v = qkv(seed_of("geo", case, ip), b, n, 4, sq, skv, d, BF16)
    if case == "sm3-s1>s2":
        kw = dict(atten_mask=template_mask(), sparse_mode=3, act_kv=[5, 12])
    elif case == "sm4-neg-next":
        kw = dict(atten_mask=template_mask((1, 2048, 2048)), sparse_mode=4, pre_tokens=5, next_tokens=-2)
    else:
        kw = dict(atten_mask=randmask((sq, skv), gen(3), 0.2), sparse_mode=0, pre_tokens=1, next_tokens=0,
                  act_kv=[4, 12])
    out, lse, ref_o, ref_l = check_dense(q, k, v, layout="BSND", inner_precise=ip, **kw)
    assert torch.isposinf(ref_l).any()        # the case really has geometry-empty rows


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("ip", [0, 1])
def test_decode_fully_masked(ip):
    """Decode (inner_precise 0/1 only): a batch whose mask hides every key -> mean of V, lse ~ -1e12."""
    b, n, skv, d = 2, 4, 10, 32
    q, k, v = qkv(seed_of("decfull", ip), b, n, 4, 1, skv, d)
    m = torch.zeros(b, skv, dtype=torch.bool)
    m[0, :] = True
    m[1, 3:7] = True
    out, lse, _, _ = check_dense(q, k, v, layout="BNSD", atten_mask=m, inner_precise=ip, act_kv=[10, 8])
    assert (lse[0] < -1e11).all()
