"""MLA rope (SPEC 9): query_rope / key_rope add Q_rope·K_ropeᵀ to the scores before scaling; values come
from `value` alone (Dv may differ from D; output D = value D).

Reference: the naive float64 model with the concatenated dims [q | q_rope], [k | k_rope] (the dense API
itself requires Dv == D outside TND / MLA). Includes the DeepSeek call pattern: the latent cache passed as
both key and value (D = 512), rope 64, KV_N = 1, paged, Q_S 1..16, 16 / 32 heads, BSND / BNSD / TND.
"""
import math

import pytest
import torch

import fia
import naive
from util import (INT_MAX, assert_close, assert_lse, assert_zero_rows, batched_mask, block_table, cumsum,
                  expected_out_shape, gather_paged, gen, out_to_canon, paged_pool, poison_rows,
                  pool_as_cache, randmask, randn, seed_of, template_mask, tnd_split, to_layout, to_tnd)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT = {"fp16": F16, "bf16": BF16}


def cat(a, b):
    return torch.cat([a.double(), b.double()], dim=-1)


def rope_dense_case(*, seed, layout="BSND", b=2, n=4, kvn=2, sq=1, skv=20, d=64, dr=64, dv=None, dtype=F16,
                    act_q=None, act_kv=None, mask=None, sparse_mode=0, pre=None, nxt=None, lse=True, scale=None):
    """Dense K/V with rope; reference = naive on [q | q_rope], [k | k_rope]."""
    dv = dv or d
    g = gen(seed)
    scale = 1.0 / math.sqrt(d + dr) if scale is None else scale
    q, qr = randn((b, n, sq, d), g, dtype), randn((b, n, sq, dr), g, dtype)
    k, kr, v = randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, dr), g, dtype), randn((b, kvn, skv, dv), g, dtype)
    decode = sq == 1
    aq = [1] * b if decode else ([sq] * b if act_q is None else list(act_q))
    akv = [skv] * b if act_kv is None else list(act_kv)
    base = layout.split("_")[0]
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale, softmax_lse_flag=lse,
              sparse_mode=sparse_mode)
    if act_q is not None and not decode:
        kw["actual_seq_lengths"] = list(act_q)
    if act_kv is not None:
        kw["actual_seq_lengths_kv"] = list(act_kv)
    if mask is not None:
        kw["atten_mask"] = mask
    if pre is not None:
        kw["pre_tokens"] = pre
    if nxt is not None:
        kw["next_tokens"] = nxt
    out, l = fia.npu_fused_infer_attention_score(
        to_layout(poison_rows(q, aq), base), to_layout(poison_rows(k, akv), base),
        to_layout(poison_rows(v, akv), base), query_rope=to_layout(poison_rows(qr, aq), base),
        key_rope=to_layout(poison_rows(kr, akv), base), **kw)
    # with rope inputs the sparse mode applies even for Q_S = 1 (SPEC 5)
    mask_b = batched_mask(mask, b, decode) if mask is not None and sparse_mode in (0, 1) else None
    ref_o, ref_l = naive.attention(cat(q, qr), cat(k, kr), v.double(), scale=scale, q_windows=[(0, x) for x in aq],
                                   kv_windows=[(0, x) for x in akv], mask=mask_b, sparse_mode=sparse_mode,
                                   pre_tokens=INT_MAX if pre is None else pre,
                                   next_tokens=INT_MAX if nxt is None else nxt)
    assert out.dtype == dtype
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, dv), tuple(out.shape)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_o, dtype)
    lc = None
    if lse:
        lc = l[..., 0]
        assert_lse(lc, ref_l)
    assert_zero_rows(oc, lc, torch.isposinf(ref_l))
    return oc, lc, ref_o, ref_l


# --------------------------------------------------------------------------------------------- dense
DENSE = [("BSH", 1), ("BSND", 1), ("BNSD", 1), ("BSND", 5), ("BNSD", 16), ("BSH", 3), ("BSND_NBSD", 4),
         ("BNSD_NBSD", 1), ("BSH_NBSD", 2)]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,sq", DENSE, ids=[f"{l}-qs{s}" for l, s in DENSE])
def test_rope_dense_matches_concatenation(layout, sq, dt):
    """rope == concatenating [q | q_rope] and [k | k_rope]; GQA; per-batch lengths (NaN past them)."""
    kw = {}
    if sq > 1:
        kw.update(act_q=[sq, max(sq - 2, 1)], mask=template_mask(), sparse_mode=3)
    rope_dense_case(seed=seed_of("rope", layout, sq, dt), layout=layout, sq=sq, dtype=DT[dt], act_kv=[20, 9], **kw)


@pytest.mark.parametrize("dv", [32, 128], ids=lambda x: f"dv{x}")
@pytest.mark.parametrize("sq", [1, 4], ids=lambda x: f"qs{x}")
def test_rope_value_dim_differs(sq, dv):
    """Values come from `value` alone: Dv != D is allowed with rope; the output has D = Dv."""
    kw = dict(act_q=[4, 2], mask=template_mask(), sparse_mode=3) if sq > 1 else {}
    rope_dense_case(seed=seed_of("ropedv", sq, dv), layout="BNSD", sq=sq, d=64, dv=dv, **kw)


@pytest.mark.case(q_s=1)
def test_rope_scale_applies_to_both_products():
    """S = scale · (Q·Kᵀ + Q_rope·K_ropeᵀ): with Q = 0 only the rope product (scaled) remains."""
    g = gen(3)
    b, n, sq, skv, d = 1, 2, 1, 9, 64
    q = torch.zeros(b, n, sq, d, dtype=F16)
    qr, kr = randn((b, n, sq, 64), g, F16), randn((b, n, skv, 64), g, F16)
    k, v = randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    for scale in (1.0, 0.05):
        out, lse = fia.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, num_heads=n,
                                                       input_layout="BNSD", scale=scale, softmax_lse_flag=True)
        ref, ref_l = naive.attention(qr, kr, v, scale=scale)
        assert_close(out, ref, F16)
        assert_lse(lse[..., 0], ref_l)


def test_rope_zero_equals_no_rope():
    """Zero rope tensors leave plain attention."""
    g = gen(4)
    q, k, v = randn((2, 4, 3, 64), g, BF16), randn((2, 1, 10, 64), g, BF16), randn((2, 1, 10, 64), g, BF16)
    kw = dict(num_heads=4, num_key_value_heads=1, input_layout="BNSD", scale=0.1, sparse_mode=3,
              atten_mask=template_mask())
    o1, _ = fia.npu_fused_infer_attention_score(q, k, v, query_rope=torch.zeros(2, 4, 3, 64, dtype=BF16),
                                                key_rope=torch.zeros(2, 1, 10, 64, dtype=BF16), **kw)
    o0, _ = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert_close(o1, o0.double(), BF16)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("pre", [0, 3, 30])
def test_rope_decode_sparse4_sliding_window(pre):
    """With rope inputs Q_S = 1 keeps its sparse mode (SPEC 5): sparse 4 with the template = a sliding
    window over the last pre + 1 keys (next 0) of every batch."""
    rope_dense_case(seed=seed_of("swa", pre), layout="BSND", b=3, sq=1, skv=24, act_kv=[24, 10, 2],
                    mask=template_mask(), sparse_mode=4, pre=pre, nxt=0)


@pytest.mark.case(q_s=1)
def test_rope_decode_plain_mask_sparse0():
    """Decode with rope and a plain per-batch mask (B, 1, 1, KV_S) under sparse 0."""
    b, skv = 3, 17
    mask = randmask((b, 1, 1, skv), gen(5), 0.3)
    rope_dense_case(seed=6, layout="BNSD", b=b, sq=1, skv=skv, act_kv=[17, 4, 9], mask=mask)


def test_rope_prefill_per_request_mask_sparse0():
    """SPEC 15.11: MLA with Q_S > 1 and a per-request mask under sparse 0."""
    b, sq, skv = 2, 5, 14
    mask = randmask((b, 1, sq, skv), gen(6), 0.3)
    rope_dense_case(seed=7, layout="BSND", b=b, sq=sq, skv=skv, act_q=[5, 3], act_kv=[14, 8], mask=mask)


def test_rope_portable_other_rope_dim_float32():
    """Portable mode: any rope head dim (here 24), float32 (tolerance 1e-5)."""
    with fia.validation_mode("portable"):
        rope_dense_case(seed=8, layout="BNSD", sq=3, d=20, dr=24, dv=12, dtype=F32, act_q=[3, 2], act_kv=[20, 5],
                        mask=randmask((3, 20), gen(9), 0.2), sparse_mode=1)


# --------------------------------------------------------------------------------------------- TND MLA (D = 128)
@pytest.mark.parametrize("layout", ["TND", "NTD_TND", "TND_NTD"])
@pytest.mark.parametrize("sparse", [0, 3])
def test_rope_tnd_d128(layout, sparse):
    """TND-family MLA: D = 128 + rope 64, bf16; cumulative lengths; sparse 0 without mask or 3 with template."""
    qlens, kvlens = [3, 1, 6], [5, 1, 9]
    n, kvn, d = 4, 4, 128
    g = gen(seed_of("tndrope", layout, sparse))
    qs = [randn((n, l, d), g, BF16) for l in qlens]
    qrs = [randn((n, l, 64), g, BF16) for l in qlens]
    ks = [randn((kvn, l, d), g, BF16) for l in kvlens]
    krs = [randn((kvn, l, 64), g, BF16) for l in kvlens]
    vs = [randn((kvn, l, d), g, BF16) for l in kvlens]
    pack = to_tnd if layout.startswith("TND") else (lambda xs: torch.cat(list(xs), dim=1))
    kw = dict(atten_mask=template_mask(), sparse_mode=3) if sparse == 3 else {}
    scale = 1 / math.sqrt(d + 64)
    # TND_NTD only with query D = 512 in strict mode (SPEC 14b.3, 14b.4 T11): portable mode for that layout
    with fia.validation_mode("portable" if layout == "TND_NTD" else "strict"):
        out, lse = fia.npu_fused_infer_attention_score(
            pack(qs), pack(ks), pack(vs), query_rope=pack(qrs), key_rope=pack(krs), num_heads=n,
            num_key_value_heads=kvn, input_layout=layout, scale=scale, actual_seq_lengths=cumsum(qlens),
            actual_seq_lengths_kv=cumsum(kvlens), softmax_lse_flag=True, **kw)
    ref_o, ref_l = naive.attention([cat(a, b) for a, b in zip(qs, qrs)], [cat(a, b) for a, b in zip(ks, krs)], vs,
                                   scale=scale, sparse_mode=sparse, stack=False)
    if layout == "TND_NTD":
        out = out.permute(1, 0, 2)
    o = torch.cat(tnd_split(out, qlens), 1)
    assert_close(o, torch.cat(ref_o, 1), BF16)
    assert_lse(torch.cat([x[..., 0] for x in tnd_split(lse, qlens)], 1), torch.cat(ref_l, 1))


# --------------------------------------------------------------------------------------------- DeepSeek MLA
def deepseek_case(*, seed, layout, n, qlens, kvlens, fmt="3d", bs=128, dtype=BF16, lse=True, api="fused"):
    """Absorbed MLA: latent cache (D = 512) passed as key AND value, key_rope cache (rope 64), KV_N = 1,
    paged; Q_S = max(qlens) (padded layouts: the same Q_S for every batch), sparse 3 with the template for
    Q_S > 1, sparse 0 without mask for decode."""
    d, dr, b = 512, 64, len(kvlens)
    g = gen(seed)
    table, nb = block_table(kvlens, bs, g)
    latent = paged_pool(table, kvlens, bs, nb, 1, d, g, dtype)
    rope = paged_pool(table, kvlens, bs, nb, 1, dr, g, dtype)
    kd, krd = gather_paged(latent, table, kvlens, bs), gather_paged(rope, table, kvlens, bs)
    scale = 1 / math.sqrt(128 + dr)
    packed = layout.startswith("TND")
    sq = max(qlens)
    kw = {}
    if sq > 1:
        kw.update(atten_mask=template_mask(), sparse_mode=3)
    cache = pool_as_cache(latent, fmt)
    if packed:
        qs = [randn((n, l, d), g, dtype) for l in qlens]
        qrs = [randn((n, l, dr), g, dtype) for l in qlens]
        query, query_rope = to_tnd(qs), to_tnd(qrs)
        kw["actual_seq_lengths"] = cumsum(qlens)
    else:
        assert len(set(qlens)) == 1
        qc, qrc = randn((b, n, sq, d), g, dtype), randn((b, n, sq, dr), g, dtype)
        base = layout.split("_")[0]
        query, query_rope = to_layout(qc, base), to_layout(qrc, base)
        qs, qrs = list(qc), list(qrc)
    if api == "fused":
        out, l = fia.npu_fused_infer_attention_score(
            query, cache, cache, query_rope=query_rope, key_rope=pool_as_cache(rope, fmt), num_heads=n,
            num_key_value_heads=1, input_layout=layout, scale=scale, block_table=table, block_size=bs,
            actual_seq_lengths_kv=kvlens, softmax_lse_flag=lse, **kw)
    else:   # the v2 entry point (vllm-ascend / sglang at their current versions)
        if "actual_seq_lengths" in kw:
            kw["actual_seq_qlen"] = kw.pop("actual_seq_lengths")
        out, l = fia.npu_fused_infer_attention_score_v2(
            query, cache, cache, query_rope=query_rope, key_rope=pool_as_cache(rope, fmt), num_query_heads=n,
            num_key_value_heads=1, input_layout=layout, softmax_scale=scale, block_table=table, block_size=bs,
            actual_seq_kvlen=kvlens, return_softmax_lse=lse, **kw)
    ref_o, ref_l = naive.attention([cat(a, r) for a, r in zip(qs, qrs)],
                                   [cat(kd[i], krd[i]) for i in range(b)], [kd[i] for i in range(b)], scale=scale,
                                   kv_windows=[(0, x) for x in kvlens], sparse_mode=3 if sq > 1 else 0, stack=False)
    assert out.dtype == dtype
    if packed:
        t = sum(qlens)
        assert tuple(out.shape) == ((t, n, d) if layout == "TND" else (n, t, d))
        if layout == "TND_NTD":
            out = out.permute(1, 0, 2)
        o = torch.cat(tnd_split(out, qlens), 1)
        lc = torch.cat([x[..., 0] for x in tnd_split(l, qlens)], 1) if lse else None
    else:
        assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, d)
        oc = out_to_canon(out, layout, n)
        o = torch.cat(list(oc), 1)
        lc = torch.cat(list(l[..., 0]), 1) if lse else None
    r, rl = torch.cat(ref_o, 1), torch.cat(ref_l, 1)
    assert_close(o, r, dtype)
    if lse:
        assert_lse(lc, rl)
    assert_zero_rows(o, lc, torch.isposinf(rl))


DEEPSEEK = [
    # layout, fmt, n, qlens, kvlens
    ("BSND", "3d", 16, [1, 1, 1], [300, 1, 129]),
    ("BSND", "3d", 32, [4, 4], [260, 7]),
    ("BSND", "3d", 16, [16, 16], [140, 16]),
    ("BNSD", "4d", 32, [1, 1], [129, 256]),
    ("BNSD", "3d", 16, [2, 2, 2], [2, 200, 77]),
    ("BSND_NBSD", "3d", 16, [1, 1], [50, 130]),
    ("TND", "3d", 32, [1, 1, 1, 1], [40, 300, 1, 128]),     # TND D = 512: 32 / 64 / 128 heads (T6)
    ("TND", "3d", 32, [3, 1, 9], [200, 20, 150]),
    ("TND", "4d", 64, [2, 5], [5, 260]),
    ("TND_NTD", "3d", 32, [4, 2], [9, 140]),
]


@pytest.mark.parametrize("layout,fmt,n,qlens,kvlens", DEEPSEEK,
                         ids=[f"{c[0]}-{c[1]}-n{c[2]}-qs{max(c[3])}-{i}" for i, c in enumerate(DEEPSEEK)])
def test_deepseek_mla_paged(layout, fmt, n, qlens, kvlens):
    deepseek_case(seed=seed_of("ds", layout, fmt, n, tuple(qlens)), layout=layout, fmt=fmt, n=n, qlens=qlens,
                  kvlens=kvlens)


@pytest.mark.parametrize("layout,qlens", [("BSND", [1, 1]), ("TND", [2, 3])])
def test_deepseek_mla_paged_fp16_and_v2(layout, qlens):
    """The same pattern in float16, through npu_fused_infer_attention_score_v2."""
    deepseek_case(seed=seed_of("dsv2", layout), layout=layout, n=32 if layout == "TND" else 16, qlens=qlens,
                  kvlens=[130, 9], dtype=F16,
                  api="v2")


@pytest.mark.case(q_s=1)
def test_deepseek_mla_paged_decode_block_size_16():
    """Decode allows block_size 16 (multiple of 16) also with rope."""
    deepseek_case(seed=77, layout="BNSD", n=16, qlens=[1, 1], kvlens=[40, 3], bs=16, fmt="4d", lse=False)


@pytest.mark.case(q_s=1)
def test_rope_paged_gqa():
    """Rope on a paged cache with KV_N = 2 (both cache formats), D = 64, Dv = 64 (D = 128 with rope is the TND
    MLA of SPEC 14b.3: TND / NTD_TND only, no paged KV)."""
    b, n, kvn, d, dr, bs = 2, 8, 2, 64, 64, 16
    lens = [33, 70]
    g = gen(81)
    table, nb = block_table(lens, bs, g)
    kp, krp, vp = (paged_pool(table, lens, bs, nb, kvn, x, g) for x in (d, dr, d))
    q, qr = randn((b, n, 1, d), g, F16), randn((b, n, 1, dr), g, F16)
    ref, ref_l = naive.attention(cat(q, qr), cat(gather_paged(kp, table, lens, bs), gather_paged(krp, table, lens, bs)),
                                 gather_paged(vp, table, lens, bs).double(), scale=0.07,
                                 kv_windows=[(0, x) for x in lens])
    for fmt in ("3d", "4d"):
        out, lse = fia.npu_fused_infer_attention_score(
            q, pool_as_cache(kp, fmt), pool_as_cache(vp, fmt), query_rope=qr, key_rope=pool_as_cache(krp, fmt),
            num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.07, block_table=table, block_size=bs,
            actual_seq_lengths_kv=lens, softmax_lse_flag=True)
        assert_close(out, ref, F16)
        assert_lse(lse[..., 0], ref_l)


@pytest.mark.case(q_s=1)
def test_deepseek_mla_128_heads_one_kv_head():
    """DeepSeek at TP = 1: 128 query heads on the single latent KV head (G = 128). The general rule caps G at
    64 (FusedInferAttentionScoreV4, numKeyValueHeads), but the same document's MLA tables (query D = 512)
    list numHeads 32 / 64 / 128 with numKeyValueHeads 1 -- the specific scenario allows it, and SPEC 15.11
    says strict mode never rejects what real clients run."""
    deepseek_case(seed=99, layout="BSND", n=128, qlens=[1, 1], kvlens=[33, 140])
