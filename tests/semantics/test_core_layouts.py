"""Layouts (SPEC 2), output shapes/dtypes (SPEC 13), softmax_lse (SPEC 1.1, 2), GQA/MHA, scale, pse (SPEC 3)."""
import math

import pytest
import torch

import fia
import naive
from util import (assert_close, assert_lse, assert_zero_rows, check_dense, cumsum, gen,
                  ntd_split, randn, seed_of, template_mask, tnd_split, to_ntd, to_tnd)

F16, BF16 = torch.float16, torch.bfloat16
DT = {"fp16": F16, "bf16": BF16}


def qkv(seed, b, n, kvn, sq, skv, d, dtype, dv=None):
    g = gen(seed)
    return (randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype),
            randn((b, kvn, skv, dv or d), g, dtype))


# ------------------------------------------------------------------------------------------- dense layouts
DENSE = [
    ("BSH", 1), ("BSH", 7), ("BSND", 1), ("BSND", 13), ("BNSD", 1), ("BNSD", 9), ("BNSD_BSND", 11),
    ("BSH_NBSD", 4), ("BSND_NBSD", 16), ("BNSD_NBSD", 2),
]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,sq", DENSE, ids=[f"{l}-qs{s}" for l, s in DENSE])
def test_dense_layout(layout, sq, dt):
    seed = seed_of(layout, sq, dt)
    b, n, kvn, skv, d = 2, 4, 2, 37, 64
    q, k, v = qkv(seed, b, n, kvn, sq, skv, d, DT[dt])
    check_dense(q, k, v, layout=layout)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("layout", ["BSH_NBSD", "BSND_NBSD", "BNSD_NBSD"])
def test_nbsd_decode(layout):
    """SPEC 2: the *_NBSD layouts accept 1 <= Q_S <= 16."""
    q, k, v = qkv(11, 3, 8, 1, 1, 20, 32, F16)
    check_dense(q, k, v, layout=layout)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSND_NBSD"])
def test_layout_with_lengths_and_mask(layout):
    """Layouts combined with right-padded lengths (NaN padding) and a plain mask."""
    b, n, kvn, sq, skv, d = 3, 4, 4, 12, 30, 32
    q, k, v = qkv(5, b, n, kvn, sq, skv, d, BF16)
    mask = torch.rand(sq, skv, generator=gen(6)) < 0.25
    check_dense(q, k, v, layout=layout, act_q=[12, 5, 9], act_kv=[30, 17, 3], atten_mask=mask, sparse_mode=1)


# ------------------------------------------------------------------------------------------- GQA / scale
@pytest.mark.parametrize("kvn", [8, 4, 2, 1], ids=lambda x: f"kvn{x}")
@pytest.mark.parametrize("sq", [1, 6], ids=lambda x: f"qs{x}")
def test_gqa(kvn, sq):
    """GQA: kv head = n // G, contiguous groups (SPEC 3); G up to 8."""
    q, k, v = qkv(100 + kvn * 10 + sq, 2, 8, kvn, sq, 25, 32, F16)
    check_dense(q, k, v, layout="BSND")


def test_gqa_default_kv_heads_zero():
    """num_key_value_heads=0 means 'same as num_heads' (SPEC 2)."""
    q, k, v = qkv(7, 2, 4, 4, 5, 9, 16, F16)
    ref, _ = naive.attention(q, k, v, scale=0.25)
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD", scale=0.25)
    assert_close(out, ref, F16)


@pytest.mark.parametrize("scale", [1.0, 0.05, 0.125, 2.0])
@pytest.mark.parametrize("sq", [1, 8], ids=lambda x: f"qs{x}")
def test_scale(scale, sq):
    q, k, v = qkv(int(scale * 1000) + sq, 2, 2, 1, sq, 19, 64, F16)
    check_dense(q, k, v, layout="BNSD", scale=scale)


# ------------------------------------------------------------------------------------------- pse_shift
PSE = [("B", False), ("1", False), ("B", True), ("1", True)]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("sq", [1, 10], ids=lambda x: f"qs{x}")
@pytest.mark.parametrize("pb,big", PSE, ids=[f"pse{p}{'-oversized' if o else ''}" for p, o in PSE])
def test_pse_shift(pb, big, sq, dt):
    """pse_shift (B or 1, Q_N, Q_S, KV_S) in the query dtype, added after scaling; an oversized pse uses its
    top-left region (the unused region is NaN and must not leak). Decode pse needs D % 16 == 0 (D=32)."""
    b, n, kvn, skv, d = 2, 4, 2, 21, 32
    dtype = DT[dt]
    g = gen(300 + sq + 7 * big + (pb == "B"))
    q, k, v = randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)
    pb_n = b if pb == "B" else 1
    ps, pk = (sq + 3, skv + 11) if big else (sq, skv)
    pse = randn((pb_n, n, ps, pk), g, dtype, std=2.0)
    if big:
        pse[:, :, sq:, :] = float("nan")
        pse[:, :, :, skv:] = float("nan")
    check_dense(q, k, v, layout="BSH", pse=pse, act_kv=[21, 13])


def test_pse_with_mask_and_lengths():
    b, n, sq, skv, d = 2, 2, 9, 15, 16
    g = gen(77)
    q, k, v = randn((b, n, sq, d), g, F16), randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    pse = randn((b, n, sq, skv), g, F16)
    mask = torch.rand(b, 1, sq, skv, generator=g) < 0.3
    check_dense(q, k, v, layout="BNSD", pse=pse, atten_mask=mask, sparse_mode=1, act_q=[9, 4], act_kv=[7, 15])


# ------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("sq", [1, 7], ids=lambda x: f"qs{x}")
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_output_dtype_strict(dt, sq):
    q, k, v = qkv(900 + sq, 2, 4, 2, sq, 33, 32, DT[dt])
    out, lse, _, _ = check_dense(q, k, v, layout="BSND")
    assert out.dtype == DT[dt] and lse.dtype == torch.float32


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sq", [1, 7], ids=lambda x: f"qs{x}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_output_dtype_portable(dtype, sq, layout):
    """float32 / float64 inputs only in portable mode (SPEC 1.4); output dtype = query dtype (SPEC 13).
    Unaligned D=20 is also portable-only."""
    q, k, v = qkv(950 + sq, 2, 4, 2, sq, 29, 20, dtype)
    mask = torch.rand(2, 1, sq, 29, generator=gen(951)) < 0.2
    if sq == 1:
        mask = mask.reshape(2, 29)
    with fia.validation_mode("portable"):
        out, lse, _, _ = check_dense(q, k, v, layout=layout, atten_mask=mask, sparse_mode=1 if sq > 1 else 0,
                                     act_kv=[29, 11], act_q=None if sq == 1 else [7, 3])
    assert out.dtype == dtype


@pytest.mark.case(q_s=1)
def test_softmax_lse_flag_false():
    """softmax_lse_flag=False: the second output is an empty float32 tensor of shape [0] (SPEC 1.1)."""
    for sq in (1, 6):
        q, k, v = qkv(12 + sq, 2, 2, 2, sq, 8, 16, F16)
        out, lse = fia.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=0.25)
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (0,)
        ref, _ = naive.attention(q, k, v, scale=0.25)
        assert_close(out, ref, F16)


# ------------------------------------------------------------------------------------------- TND family
def _tnd_case(seed, layout, qlens, kvlens, n, kvn, d, dv, dtype, sparse_mode=0, scale=None, lens_form=list):
    g = gen(seed)
    qs = [randn((n, l, d), g, dtype) for l in qlens]
    ks = [randn((kvn, l, d), g, dtype) for l in kvlens]
    vs = [randn((kvn, l, dv), g, dtype) for l in kvlens]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if layout.startswith("NTD"):
        q, k, v = to_ntd(qs), to_ntd(ks), to_ntd(vs)
    else:
        q, k, v = to_tnd(qs), to_tnd(ks), to_tnd(vs)
    kw = {}
    if sparse_mode == 3:
        kw["atten_mask"] = template_mask()
    cq, ckv = cumsum(qlens), cumsum(kvlens)
    out, lse = fia.npu_fused_infer_attention_score(
        q, k, v, num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale,
        actual_seq_lengths=lens_form(cq), actual_seq_lengths_kv=lens_form(ckv), sparse_mode=sparse_mode,
        softmax_lse_flag=True, **kw)
    ref_o, ref_l = naive.attention(qs, ks, vs, scale=scale, sparse_mode=sparse_mode, stack=False)
    t = sum(qlens)
    assert out.dtype == dtype
    if layout == "TND_NTD":
        assert tuple(out.shape) == (n, t, dv)
        outs = ntd_split(out, qlens)
    else:
        assert tuple(out.shape) == (t, n, dv)
        outs = tnd_split(out, qlens)
    assert tuple(lse.shape) == (t, n, 1) and lse.dtype == torch.float32
    lses = [x[..., 0] for x in tnd_split(lse, qlens)]
    if t:
        assert_close(torch.cat(outs, 1), torch.cat(ref_o, 1), dtype)
        assert_lse(torch.cat(lses, 1), torch.cat(ref_l, 1))
        dead = torch.isposinf(torch.cat(ref_l, 1))
        assert_zero_rows(torch.cat(outs, 1), torch.cat(lses, 1), dead)
    return outs, lses


TND = [
    # layout, qlens, kvlens, sparse, d, dv
    ("TND", [5, 0, 9, 3], [7, 0, 12, 3], 0, 128, 128),
    ("TND", [4, 6, 1], [10, 6, 3], 3, 128, 128),
    ("TND", [3, 8, 2], [3, 11, 2], 3, 192, 128),
    ("TND", [6, 2], [9, 4], 0, 192, 192),
    ("NTD_TND", [5, 0, 9], [5, 4, 12], 0, 128, 128),
    ("NTD_TND", [2, 7, 4], [6, 9, 4], 3, 192, 128),
]


@pytest.mark.parametrize("layout,qlens,kvlens,sm,d,dv", TND,
                         ids=[f"{c[0]}-sm{c[3]}-d{c[4]}v{c[5]}-{i}" for i, c in enumerate(TND)])
def test_tnd_strict_bf16(layout, qlens, kvlens, sm, d, dv):
    """TND family (SPEC 2): cumulative lengths, zero-length requests, Dv != D, lse [T, N, 1]; sparse 3 with
    act_q <= act_kv (SPEC 15.11)."""
    kvn = 4 if dv == 192 else 2          # the documents: no GQA with V_D = 192
    _tnd_case(sum(qlens) * 31 + sm, layout, qlens, kvlens, 4, kvn, d, dv, BF16, sparse_mode=sm)


TNDP = [
    ("TND", [5, 0, 9, 3], [7, 2, 12, 3], 0),
    ("TND", [4, 6, 1], [10, 6, 3], 3),
    ("TND_NTD", [5, 3, 9], [7, 4, 12], 0),
    ("TND_NTD", [4, 6, 2], [10, 6, 3], 3),
    ("NTD_TND", [5, 0, 9], [5, 4, 12], 0),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("layout,qlens,kvlens,sm", TNDP, ids=[f"{c[0]}-sm{c[3]}-{i}" for i, c in enumerate(TNDP)])
def test_tnd_portable(layout, qlens, kvlens, sm, dtype):
    """TND family in portable mode with other dtypes and head dims (D=64, Dv=32)."""
    with fia.validation_mode("portable"):
        _tnd_case(sum(kvlens) + sm, layout, qlens, kvlens, 4, 4, 64, 32, dtype, sparse_mode=sm)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("layout", ["TND", "NTD_TND"])
def test_tnd_decode(layout):
    """SPEC 15.10: a TND call where every query length is 1 is a decode call."""
    _tnd_case(4242, layout, [1, 1, 1], [9, 1, 17], 8, 2, 128, 128, BF16)


@pytest.mark.parametrize("form", ["tuple", "numpy", "torch32", "torch64"])
def test_tnd_length_forms(form):
    import numpy as np
    conv = {"tuple": tuple, "numpy": lambda x: np.array(x, dtype=np.int64),
            "torch32": lambda x: torch.tensor(x, dtype=torch.int32),
            "torch64": lambda x: torch.tensor(x, dtype=torch.int64)}[form]
    _tnd_case(17, "TND", [3, 5], [4, 9], 2, 2, 128, 128, BF16, lens_form=conv)


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("sq", [1, 64], ids=lambda x: f"qs{x}")
def test_largest_shape_d128_g8(sq, dt):
    """The upper end of the test shapes: D=128, G=8 (MQA), S=64, lengths, causal template for prefill."""
    b, n, kvn, skv, d = 3, 8, 1, 64, 128
    q, k, v = qkv(seed_of("big", sq, dt), b, n, kvn, sq, skv, d, DT[dt])
    kw = dict(act_kv=[64, 40, 7])
    if sq > 1:
        kw.update(act_q=[64, 33, 20], atten_mask=template_mask(), sparse_mode=3)
    check_dense(q, k, v, layout="BSH", **kw)
