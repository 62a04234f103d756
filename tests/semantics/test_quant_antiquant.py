"""KV dequantization ("antiquant", SPEC 10): int8 / int4 K and V with a float16 / bfloat16 query.

Every case is compared with the naive float64 formulation (tests/naive.py) run on K/V that the test
dequantized itself in float64 (x = (x_q + offset) · scale, tests/semantics/test_quant_helpers.py): rel err <= 1e-2 on the
output, abs err <= 1e-3 on softmax_lse. Parameters outside the valid region (per-token scales past
act_kv, unused paged-block slots, the combined set when the separate set wins) hold NaN: they must never be read.
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
import naive
from test_quant_helpers import (block_scales, dequant, factor, make_paged, pack_int4, rand_int, rand_uniform)
from util import (assert_close, assert_lse, assert_zero_rows, expected_out_shape, gen, out_to_canon, randn,
                  seed_of, to_layout)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT = {"fp16": F16, "bf16": BF16}
NAN = float("nan")

B, N, KVN, D = 2, 4, 2, 64


# ---------------------------------------------------------------------------------------------- helpers
def ints(seed, b=B, kvn=KVN, s=40, d=D, int4=False):
    g = gen(seed)
    lo, hi = (-8, 7) if int4 else (-128, 127)
    return rand_int((b, kvn, s, d), g, lo, hi), rand_int((b, kvn, s, d), g, lo, hi)


def kv_in(x, layout, int4=False):
    """canonical int values -> the stored tensor in the input layout (int4: packed int32, last dim / 8)."""
    x = pack_int4(x) if int4 else x
    return to_layout(x, layout.split("_")[0])


def channel_scale(g, shape, dtype, lo=0.004, hi=0.02):
    return rand_uniform(shape, g, lo, hi, dtype)


def offset_like(g, shape, dtype, mag=6.0):
    return rand_uniform(shape, g, -mag, mag, dtype)


def run_and_check(q, key_in, value_in, k64, v64, *, layout, kw, act_kv=None, act_q=None, lse=True, api="fused",
                  naive_kw=None, out_dtype=None):
    """Call the API with canonical q (converted to `layout`) and ready-made key/value inputs; compare with
    naive float64 attention on the float64 K/V k64/v64 [B, KV_N, S, D] (logical positions)."""
    b, n, sq, d = q.shape
    kvn = k64.shape[1]
    scale = 1.0 / math.sqrt(d)
    qq = to_layout(q, layout.split("_")[0])
    kw = dict(kw)
    if api == "fused":
        out, l = fia.npu_fused_infer_attention_score(qq, key_in, value_in, num_heads=n, num_key_value_heads=kvn,
                                                     input_layout=layout, scale=scale, softmax_lse_flag=lse, **kw)
    elif api == "incre":
        out = fia.npu_incre_flash_attention(qq, key_in, value_in, num_heads=n, num_key_value_heads=kvn,
                                            input_layout=layout, scale_value=scale, **kw)
        l, lse = None, False
    elif api == "v2":
        out, l = fia.npu_fused_infer_attention_score_v2(qq, key_in, value_in, num_query_heads=n,
                                                        num_key_value_heads=kvn, input_layout=layout,
                                                        softmax_scale=scale, return_softmax_lse=lse, **kw)
    else:
        raise ValueError(api)
    skv = k64.shape[2]
    akv = list(act_kv) if act_kv is not None else [skv] * b
    aq = list(act_q) if act_q is not None else [sq] * b
    nk = dict(naive_kw or {})
    nk.setdefault("q_windows", [(0, x) for x in aq])
    nk.setdefault("kv_windows", [(0, x) for x in akv])
    ref_out, ref_lse = naive.attention(q.double(), k64, v64, scale=scale, **nk)
    want = out_dtype or q.dtype
    assert out.dtype == want, (out.dtype, want)
    dv = v64.shape[3]
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, dv), (tuple(out.shape), layout)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_out, q.dtype)
    lc = None
    if lse:
        lc = l[..., 0]
        assert_lse(lc, ref_lse)
    assert_zero_rows(oc, lc, torch.isposinf(ref_lse))
    return oc


def query(seed, dtype, sq=1, b=B, n=N, d=D):
    return randn((b, n, sq, d), gen(seed), dtype)


# ------------------------------------------------------------------------------- combined parameters
COMBINED_SHAPES = {
    "tensor-(2,)": lambda kvn, d: (2,),
    "channel-(2,KVN,1,D)": lambda kvn, d: (2, kvn, 1, d),
    "channel-(2,KVN,D)": lambda kvn, d: (2, kvn, d),
    "channel-(2,H)": lambda kvn, d: (2, kvn * d),
}


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("shape_id", list(COMBINED_SHAPES))
def test_combined_mode0_decode(shape_id, layout, asym, dt):
    """SPEC 10.1 mode 0: per-tensor (2,) / per-channel (2, KV_N, 1, D), (2, KV_N, D), (2, H) in the query dtype;
    index 0 = key, 1 = value."""
    dtype = DT[dt]
    seed = seed_of("comb0", shape_id, layout, asym, dt)
    g = gen(seed + 1)
    kq, vq = ints(seed)
    q = query(seed, dtype)
    shape = COMBINED_SHAPES[shape_id](KVN, D)
    sc = channel_scale(g, shape, dtype)
    off = offset_like(g, shape, dtype) if asym else None
    gran = "tensor" if len(shape) == 1 and shape[0] == 2 else "channel"
    fk = dict(b=B, kvn=KVN, s=kq.shape[2], d=D)
    k64 = dequant(kq, factor(gran, sc[0], **fk), factor(gran, None if off is None else off[0], **fk))
    v64 = dequant(vq, factor(gran, sc[1], **fk), factor(gran, None if off is None else off[1], **fk))
    kw = dict(antiquant_scale=sc, antiquant_mode=0)
    if asym:
        kw["antiquant_offset"] = off
    act = [40, 23]
    run_and_check(q, kv_in(kq, layout), kv_in(vq, layout), k64, v64, layout=layout, act_kv=act,
                  kw=dict(kw, actual_seq_lengths_kv=act))


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_combined_mode1_per_token_decode(layout, asym, dt):
    """SPEC 10.1 mode 1: per-token (2, B, KV_S) float32, decode. Scales past act_kv are NaN (never read)."""
    dtype = DT[dt]
    seed = seed_of("comb1", layout, asym, dt)
    g = gen(seed + 1)
    s = 40
    kq, vq = ints(seed, s=s)
    q = query(seed, dtype)
    act = [31, 17]
    sc = rand_uniform((2, B, s), g, 0.002, 0.03, F32)
    off = rand_uniform((2, B, s), g, -8, 8, F32) if asym else None
    for b, a in enumerate(act):
        sc[:, b, a:] = NAN
        if off is not None:
            off[:, b, a:] = NAN
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor("token", sc[0], **fk), factor("token", None if off is None else off[0], **fk))
    v64 = dequant(vq, factor("token", sc[1], **fk), factor("token", None if off is None else off[1], **fk))
    kw = dict(antiquant_scale=sc, antiquant_mode=1, actual_seq_lengths_kv=act)
    if asym:
        kw["antiquant_offset"] = off
    run_and_check(q, kv_in(kq, layout), kv_in(vq, layout), k64, v64, layout=layout, act_kv=act, kw=kw)


@pytest.mark.case(q_s=1)
def test_combined_incre_api():
    """npu_incre_flash_attention takes the combined per-channel parameters ((2, H) for BSH), SPEC 10.1."""
    seed = 77
    g = gen(seed + 1)
    kq, vq = ints(seed)
    q = query(seed, F16)
    sc = channel_scale(g, (2, KVN * D), F16)
    off = offset_like(g, (2, KVN * D), F16)
    fk = dict(b=B, kvn=KVN, s=kq.shape[2], d=D)
    k64 = dequant(kq, factor("channel", sc[0], **fk), factor("channel", off[0], **fk))
    v64 = dequant(vq, factor("channel", sc[1], **fk), factor("channel", off[1], **fk))
    act = [12, 40]
    run_and_check(q, kv_in(kq, "BSH"), kv_in(vq, "BSH"), k64, v64, layout="BSH", api="incre", act_kv=act,
                  kw=dict(antiquant_scale=sc, antiquant_offset=off, actual_seq_lengths=act))


# ------------------------------------------------------------------------------- separate parameters, decode
def _sep_shapes(b, kvn, s, d):
    return {
        # id: (key mode, value mode, key shape, value shape, key granularity, value granularity)
        "m0-(1,KVN,1,D)": (0, 0, (1, kvn, 1, d), (1, kvn, 1, d), "channel", "channel"),
        "m0-(1,KVN,D)": (0, 0, (1, kvn, d), (1, kvn, d), "channel", "channel"),
        "m0-(1,H)": (0, 0, (1, kvn * d), (1, kvn * d), "channel", "channel"),
        "m0-(1,)": (0, 0, (1,), (1,), "tensor", "tensor"),
        "m1-(1,B,S)": (1, 1, (1, b, s), (1, b, s), "token", "token"),
        "m2-(KVN,)": (2, 2, (kvn,), (kvn,), "head", "head"),
        "m3-(B,KVN,S)": (3, 3, (b, kvn, s), (b, kvn, s), "token_head", "token_head"),
        "m3-(1,KVN,S)": (3, 3, (1, kvn, s), (1, kvn, s), "token_head", "token_head"),
        "k0v1": (0, 1, (1, kvn, 1, d), (1, b, s), "channel", "token"),
    }


SEP_IDS = list(_sep_shapes(B, KVN, 40, D))


def sep_params(g, gran, shape, dtype, asym):
    """(scale, offset) of one side: per-token granularities float32, others in `dtype`."""
    per_token = gran in ("token", "token_head")
    pdt = F32 if per_token else dtype
    lo, hi = (0.002, 0.03) if per_token else (0.004, 0.02)
    sc = rand_uniform(shape, g, lo, hi, pdt)
    off = rand_uniform(shape, g, -6, 6, pdt) if asym else None
    return sc, off


def _nan_past(t, gran, act):
    if t is None or gran not in ("token", "token_head") or act is None:
        return t
    t = t.clone()
    bdim = 0 if gran == "token_head" else t.dim() - 2
    if t.shape[bdim] == 1:
        return t
    for b, a in enumerate(act):
        idx = [slice(None)] * t.dim()
        idx[bdim] = b
        idx[-1] = slice(a, None)
        t[tuple(idx)] = NAN
    return t


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("sid", SEP_IDS)
def test_separate_decode(sid, asym, dt):
    """SPEC 10.2 decode table, modes 0-3 and key 0 + value 1 (BNSD; BSH covered by layout-specific tests).
    key 0 + value 1 with int8 K/V: the documents allow only float16 query/output (bf16 checked in portable)."""
    dtype = DT[dt]
    s = 40
    km, vm, ksh, vsh, kg, vg = _sep_shapes(B, KVN, s, D)[sid]
    seed = seed_of("sep", sid, asym, dt)
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, dtype)
    act = [s, 26]
    ks, ko = sep_params(g, kg, ksh, dtype, asym)
    vs, vo = sep_params(g, vg, vsh, dtype, asym)
    ks, ko, vs, vo = (_nan_past(ks, kg, act), _nan_past(ko, kg, act), _nan_past(vs, vg, act),
                      _nan_past(vo, vg, act))
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor(kg, ks, **fk), factor(kg, ko, **fk))
    v64 = dequant(vq, factor(vg, vs, **fk), factor(vg, vo, **fk))
    kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=km, value_antiquant_mode=vm,
              actual_seq_lengths_kv=act)
    if asym:
        kw.update(key_antiquant_offset=ko, value_antiquant_offset=vo)
    mode = "portable" if (km, vm) == (0, 1) and dtype == BF16 else "strict"
    with fia.validation_mode(mode):
        run_and_check(q, kv_in(kq, "BNSD"), kv_in(vq, "BNSD"), k64, v64, layout="BNSD", act_kv=act, kw=kw)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("layout", ["BSH", "BSND"])
@pytest.mark.parametrize("sid", ["m0-(1,H)", "m0-(1,KVN,D)", "m1-(1,B,S)", "m3-(B,KVN,S)", "k0v1"])
def test_separate_decode_layouts(sid, layout):
    """Separate parameters with the 3-D / BSND layouts (asymmetric, fp16, GQA 4:2)."""
    s = 33
    km, vm, ksh, vsh, kg, vg = _sep_shapes(B, KVN, s, D)[sid]
    seed = seed_of("sepl", sid, layout)
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, F16)
    act = [20, s]
    ks, ko = sep_params(g, kg, ksh, F16, True)
    vs, vo = sep_params(g, vg, vsh, F16, True)
    ks, ko, vs, vo = (_nan_past(ks, kg, act), _nan_past(ko, kg, act), _nan_past(vs, vg, act),
                      _nan_past(vo, vg, act))
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor(kg, ks, **fk), factor(kg, ko, **fk))
    v64 = dequant(vq, factor(vg, vs, **fk), factor(vg, vo, **fk))
    kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko, value_antiquant_offset=vo,
              key_antiquant_mode=km, value_antiquant_mode=vm, actual_seq_lengths_kv=act)
    run_and_check(q, kv_in(kq, layout), kv_in(vq, layout), k64, v64, layout=layout, act_kv=act, kw=kw)


@pytest.mark.case(q_s=1)
def test_separate_v2_entry_point():
    """npu_fused_infer_attention_score_v2: dequant_scale_key/value, dequant_offset_key/value,
    key_quant_mode/value_quant_mode are the separate parameters (SPEC 1.1b); mode 3 per-token per-head."""
    s = 30
    seed = 4242
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, BF16)
    ks, ko = sep_params(g, "token_head", (B, KVN, s), BF16, True)
    vs, vo = sep_params(g, "token_head", (B, KVN, s), BF16, True)
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor("token_head", ks, **fk), factor("token_head", ko, **fk))
    v64 = dequant(vq, factor("token_head", vs, **fk), factor("token_head", vo, **fk))
    run_and_check(q, kv_in(kq, "BSND"), kv_in(vq, "BSND"), k64, v64, layout="BSND", api="v2",
                  kw=dict(dequant_scale_key=ks, dequant_offset_key=ko, dequant_scale_value=vs,
                          dequant_offset_value=vo, key_quant_mode=3, value_quant_mode=3))


@pytest.mark.case(q_s=1)
def test_separate_takes_precedence():
    """SPEC 10.2: the separate parameters win when both sets are given; the combined ones (NaN) are unused."""
    s = 24
    seed = 99
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, F16)
    ks, ko = sep_params(g, "channel", (1, KVN, 1, D), F16, True)
    vs, vo = sep_params(g, "channel", (1, KVN, 1, D), F16, True)
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor("channel", ks, **fk), factor("channel", ko, **fk))
    v64 = dequant(vq, factor("channel", vs, **fk), factor("channel", vo, **fk))
    bad = torch.full((2, KVN, 1, D), NAN, dtype=F16)
    kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko, value_antiquant_offset=vo,
              antiquant_scale=bad, antiquant_offset=bad.clone())
    run_and_check(q, kv_in(kq, "BNSD"), kv_in(vq, "BNSD"), k64, v64, layout="BNSD", kw=kw)


# ------------------------------------------------------------------------------- paged KV (SPEC 8, 10.2 modes 4/5)
PAGED = [
    # id, key mode, value mode, four_d cache, layout
    ("m0-3d-BSH", 0, 0, False, "BSH"),
    ("m0-4d-BNSD", 0, 0, True, "BNSD"),
    ("m1-3d-BSND", 1, 1, False, "BSND"),
    ("m1-4d-BNSD", 1, 1, True, "BNSD"),
    ("m3-3d-BNSD", 3, 3, False, "BNSD"),
    ("m4-3d-BSH", 4, 4, False, "BSH"),
    ("m4-4d-BNSD", 4, 4, True, "BNSD"),
    ("m5-3d-BSND", 5, 5, False, "BSND"),
    ("m5-4d-BNSD", 5, 5, True, "BNSD"),
    ("k0v1-4d-BNSD", 0, 1, True, "BNSD"),
    ("comb0-3d-BSH", "c0", "c0", False, "BSH"),
    ("comb1-4d-BNSD", "c1", "c1", True, "BNSD"),
]


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("pid,km,vm,four_d,layout", PAGED, ids=[p[0] for p in PAGED])
def test_paged_decode(pid, km, vm, four_d, layout, asym):
    """Paged int8 cache with every decode dequant mode. Per-token scales (modes 1/3, combined 1) are indexed by
    logical position and cover max_blocks × block_size; modes 4/5 are stored by block ((blocknum, block_size),
    (blocknum, KV_N, block_size)), unused slots NaN. block_size 32 (int8 decode alignment)."""
    bs, act = 32, [70, 33]
    mb = 3
    s = mb * bs
    seed = seed_of("paged", pid, asym)
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, F16)
    (kc, vc), table = make_paged([kq, vq], act, bs, g, four_d=four_d, max_blocks=mb)
    nb = kc.shape[0]
    fk = dict(b=B, kvn=KVN, s=s, d=D, table=table, bs=bs)
    kw = dict(block_table=table, block_size=bs, actual_seq_lengths_kv=act)

    def side(mode):
        if mode in ("c0", 0):
            shape = (2, KVN, 1, D) if mode == "c0" else (1, KVN, 1, D)
            sc, off = channel_scale(g, shape, F16), (offset_like(g, shape, F16) if asym else None)
            return "channel", sc, off
        if mode in ("c1", 1):
            shape = (2, B, s) if mode == "c1" else (1, B, s)
            sc = _nan_past(rand_uniform(shape, g, 0.002, 0.03, F32), "token", act)
            off = _nan_past(rand_uniform(shape, g, -6, 6, F32), "token", act) if asym else None
            return "token", sc, off
        if mode == 3:
            sc = _nan_past(rand_uniform((B, KVN, s), g, 0.002, 0.03, F32), "token_head", act)
            off = _nan_past(rand_uniform((B, KVN, s), g, -6, 6, F32), "token_head", act) if asym else None
            return "token_head", sc, off
        per_head = mode == 5
        lshape = (B, KVN, s) if per_head else (B, s)
        sc = block_scales(rand_uniform(lshape, g, 0.002, 0.03, F32), table, act, bs, nb, per_head)
        off = block_scales(rand_uniform(lshape, g, -6, 6, F32), table, act, bs, nb, per_head) if asym else None
        return ("block_token_head" if per_head else "block_token"), sc, off

    if km in ("c0", "c1"):
        gran, sc, off = side(km)
        k64 = dequant(kq, factor(gran, sc[0], **fk), factor(gran, None if off is None else off[0], **fk))
        v64 = dequant(vq, factor(gran, sc[1], **fk), factor(gran, None if off is None else off[1], **fk))
        kw.update(antiquant_scale=sc, antiquant_mode=0 if km == "c0" else 1)
        if asym:
            kw["antiquant_offset"] = off
    else:
        kg, ks, ko = side(km)
        vg, vs, vo = side(vm)
        k64 = dequant(kq, factor(kg, ks, **fk), factor(kg, ko, **fk))
        v64 = dequant(vq, factor(vg, vs, **fk), factor(vg, vo, **fk))
        kw.update(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=km, value_antiquant_mode=vm)
        if asym:
            kw.update(key_antiquant_offset=ko, value_antiquant_offset=vo)
    run_and_check(q, kc, vc, k64, v64, layout=layout, act_kv=act, kw=kw)


def test_paged_prefill_combined():
    """SPEC 15.9: V4 allows dequantization with paged prefill (combined mode 0, fp16, block_size 128)."""
    bs, act, mb = 128, [150, 61], 2
    s = bs * mb
    seed = 515
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s, d=32)
    q = query(seed, F16, sq=5, d=32)
    (kc, vc), table = make_paged([kq, vq], act, bs, g, four_d=False, max_blocks=mb)
    sc, off = channel_scale(g, (2, KVN * 32), F16), offset_like(g, (2, KVN * 32), F16)
    fk = dict(b=B, kvn=KVN, s=s, d=32)
    k64 = dequant(kq, factor("channel", sc[0], **fk), factor("channel", off[0], **fk))
    v64 = dequant(vq, factor("channel", sc[1], **fk), factor("channel", off[1], **fk))
    run_and_check(q, kc, vc, k64, v64, layout="BSH", act_kv=act,
                  kw=dict(block_table=table, block_size=bs, actual_seq_lengths_kv=act, antiquant_scale=sc,
                          antiquant_offset=off))


# ------------------------------------------------------------------------------- Q_S > 1
@pytest.mark.parametrize("shape_id", ["tensor-(2,)", "channel-(2,KVN,1,D)", "channel-(2,KVN,D)", "channel-(2,H)"])
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BNSD_BSND"])
def test_combined_prefill_fp16(shape_id, layout):
    """SPEC 10.1: for Q_S > 1 only combined mode 0 with fp16; with right padding, a causal template (sparse 3)."""
    seed = seed_of("combpre", shape_id, layout)
    g = gen(seed + 1)
    d, sq, s = 32, 7, 29
    kq, vq = ints(seed, s=s, d=d)
    q = query(seed, F16, sq=sq, d=d)
    shape = COMBINED_SHAPES[shape_id](KVN, d)
    sc, off = channel_scale(g, shape, F16), offset_like(g, shape, F16)
    gran = "tensor" if shape == (2,) else "channel"
    fk = dict(b=B, kvn=KVN, s=s, d=d)
    k64 = dequant(kq, factor(gran, sc[0], **fk), factor(gran, off[0], **fk))
    v64 = dequant(vq, factor(gran, sc[1], **fk), factor(gran, off[1], **fk))
    aq, akv = [7, 4], [29, 11]
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    run_and_check(q, kv_in(kq, layout), kv_in(vq, layout), k64, v64, layout=layout, act_kv=akv, act_q=aq,
                  kw=dict(antiquant_scale=sc, antiquant_offset=off, actual_seq_lengths=aq,
                          actual_seq_lengths_kv=akv, atten_mask=tmpl, sparse_mode=3),
                  naive_kw=dict(sparse_mode=3))


QS_SHAPES = {
    "m0-(KVN,D)": (0, lambda b, kvn, s, d: (kvn, d), "channel"),
    "m0-(KVN,1,D)": (0, lambda b, kvn, s, d: (kvn, 1, d), "channel"),
    "m0-(H)": (0, lambda b, kvn, s, d: (kvn * d,), "channel"),
    "m1-(B,S)": (1, lambda b, kvn, s, d: (b, s), "token"),
}


@pytest.mark.parametrize("sq", [2, 16])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sid", list(QS_SHAPES))
def test_separate_prefill_bf16(sid, layout, asym, sq):
    """SPEC 10.2, Q_S > 1 (<= 16): modes 0 (per-channel (KV_N, D), (KV_N, 1, D), (H), bfloat16) and 1 (per-token
    (B, KV_S), float32) with a bf16 query, int8 K/V, bf16 output; right-padded lengths with a mask."""
    mode, shp, gran = QS_SHAPES[sid]
    seed = seed_of("seppre", sid, layout, asym, sq)
    g = gen(seed + 1)
    d, s = 64, 36
    kq, vq = ints(seed, s=s, d=d)
    q = query(seed, BF16, sq=sq, d=d)
    aq, akv = [sq, max(1, sq // 2)], [36, 21]
    ks, ko = sep_params(g, gran, shp(B, KVN, s, d), BF16, asym)
    vs, vo = sep_params(g, gran, shp(B, KVN, s, d), BF16, asym)
    ks, ko, vs, vo = (_nan_past(t, gran, akv) for t in (ks, ko, vs, vo))
    fk = dict(b=B, kvn=KVN, s=s, d=d)
    k64 = dequant(kq, factor(gran, ks, **fk), factor(gran, ko, **fk))
    v64 = dequant(vq, factor(gran, vs, **fk), factor(gran, vo, **fk))
    mask = torch.rand(sq, s, generator=g) < 0.2
    kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=mode, value_antiquant_mode=mode,
              actual_seq_lengths=aq, actual_seq_lengths_kv=akv, atten_mask=mask, sparse_mode=1)
    if asym:
        kw.update(key_antiquant_offset=ko, value_antiquant_offset=vo)
    run_and_check(q, kv_in(kq, layout), kv_in(vq, layout), k64, v64, layout=layout, act_kv=akv, act_q=aq, kw=kw,
                  naive_kw=dict(mask=mask.unsqueeze(0).expand(B, -1, -1), sparse_mode=1))


# ------------------------------------------------------------------------------- int4 (SPEC 10.4)
INT4 = ["m0-(1,KVN,1,D)", "m0-(1,H)", "m1-(1,B,S)", "m3-(B,KVN,S)", "k0v1"]


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sid", INT4)
def test_int4_decode(sid, layout, dt):
    """int4 K/V packed eight to an int32 (low nibble first), stored last dim D/8; separate modes 0, 1, 3 and
    key 0 + value 1; asymmetric; D = 64 and 128."""
    dtype = DT[dt]
    d = 128 if layout == "BSH" else 64
    s = 27
    km, vm, ksh, vsh, kg, vg = _sep_shapes(B, KVN, s, d)[sid]
    seed = seed_of("int4", sid, layout, dt)
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s, d=d, int4=True)
    q = query(seed, dtype, d=d)
    act = [s, 15]
    ks, ko = sep_params(g, kg, ksh, dtype, True)
    vs, vo = sep_params(g, vg, vsh, dtype, True)
    ks, vs = ks * 16, vs * 16                       # int4 values are small: larger scales
    ks, ko, vs, vo = (_nan_past(ks, kg, act), _nan_past(ko, kg, act), _nan_past(vs, vg, act),
                      _nan_past(vo, vg, act))
    fk = dict(b=B, kvn=KVN, s=s, d=d)
    k64 = dequant(kq, factor(kg, ks, **fk), factor(kg, ko, **fk))
    v64 = dequant(vq, factor(vg, vs, **fk), factor(vg, vo, **fk))
    kin, vin = kv_in(kq, layout, int4=True), kv_in(vq, layout, int4=True)
    assert kin.dtype == torch.int32 and kin.shape[-1] == (KVN * d // 8 if layout == "BSH" else d // 8)
    run_and_check(q, kin, vin, k64, v64, layout=layout, act_kv=act,
                  kw=dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
                          value_antiquant_offset=vo, key_antiquant_mode=km, value_antiquant_mode=vm,
                          actual_seq_lengths_kv=act))


@pytest.mark.case(q_s=1)
def test_int4_nibble_order():
    """Hand-built int4 words: one key only (softmax weight 1), so the output equals the dequantized value row;
    checks the nibble order (low nibble first) and the sign extension of every nibble value -8..7."""
    d = 64
    vals = torch.tensor([(i % 16) - 8 for i in range(d)], dtype=torch.int64)   # -8..7 repeated
    vals = vals[torch.randperm(d, generator=gen(3))]
    words = []
    for k in range(d // 8):
        w = 0
        for i in range(8):
            w |= (int(vals[8 * k + i]) & 0xF) << (4 * i)
        words.append(w - (1 << 32) if w >= (1 << 31) else w)
    v = torch.tensor(words, dtype=torch.int32).reshape(1, 1, 1, d // 8)      # BNSD, B = N = S = 1
    k = torch.zeros(1, 1, 1, d // 8, dtype=torch.int32)
    q = torch.randn(1, 1, 1, d).half()
    one = torch.ones(1, 1, 1, d, dtype=F16)
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=1, input_layout="BNSD", scale=0.125,
                                                 key_antiquant_scale=one, value_antiquant_scale=one)
    assert out.shape == (1, 1, 1, d)
    assert torch.equal(out.reshape(-1).double(), vals.double()), (out.reshape(-1).tolist(), vals.tolist())


# ------------------------------------------------------------------------------- other storage / features
@pytest.mark.case(q_s=1)
def test_left_padding_per_token():
    """kv left padding (SPEC 4) with per-token scales: scales belong to physical positions; the valid window is
    [S - pad - act, S - pad); scales outside it are NaN."""
    s, pad = 40, 5
    act = [20, 35]
    seed = 616
    g = gen(seed + 1)
    kq, vq = ints(seed, s=s)
    q = query(seed, F16)
    sc = rand_uniform((2, B, s), g, 0.002, 0.03, F32)
    off = rand_uniform((2, B, s), g, -6, 6, F32)
    win = [(s - pad - a, s - pad) for a in act]
    for b, (lo, hi) in enumerate(win):
        for t in (sc, off):
            t[:, b, :lo] = NAN
            t[:, b, hi:] = NAN
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    k64 = dequant(kq, factor("token", sc[0], **fk), factor("token", off[0], **fk))
    v64 = dequant(vq, factor("token", sc[1], **fk), factor("token", off[1], **fk))
    run_and_check(q, kv_in(kq, "BSH"), kv_in(vq, "BSH"), k64, v64, layout="BSH",
                  kw=dict(antiquant_scale=sc, antiquant_offset=off, antiquant_mode=1, actual_seq_lengths_kv=act,
                          kv_padding_size=torch.tensor([pad], dtype=torch.int64)),
                  naive_kw=dict(kv_windows=win))


@pytest.mark.case(q_s=1)
def test_tensor_list_decode():
    """Tensor-list int8 K/V (batch-1 tensors with individual S) with per-channel combined dequantization."""
    seed = 717
    g = gen(seed + 1)
    lens = [13, 30]
    q = query(seed, F16)
    ks = [rand_int((1, KVN, l, D), g) for l in lens]
    vs = [rand_int((1, KVN, l, D), g) for l in lens]
    sc, off = channel_scale(g, (2, KVN, 1, D), F16), offset_like(g, (2, KVN, 1, D), F16)
    scale = 1 / math.sqrt(D)
    out, l = fia.npu_fused_infer_attention_score(q, ks, vs, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
                                                 scale=scale, antiquant_scale=sc, antiquant_offset=off,
                                                 softmax_lse_flag=True)
    for b in range(B):
        fk = dict(b=1, kvn=KVN, s=lens[b], d=D)
        k64 = dequant(ks[b], factor("channel", sc[0], **fk), factor("channel", off[0], **fk))
        v64 = dequant(vs[b], factor("channel", sc[1], **fk), factor("channel", off[1], **fk))
        ro, rl = naive.attention(q[b:b + 1].double(), k64, v64, scale=scale)
        assert_close(out[b:b + 1], ro, F16)
        assert_lse(l[b:b + 1, ..., 0], rl)


@pytest.mark.case(q_s=1)
def test_shared_prefix_per_channel():
    """Shared prefix (SPEC 7) with int8 K/V: the prefix is int8 too and dequantized with the same per-channel
    parameters; effective keys = prefix[:P] then the batch's own keys."""
    seed = 818
    g = gen(seed + 1)
    s, ps, p = 20, 12, 9
    kq, vq = ints(seed, s=s)
    kp, vp = rand_int((1, KVN, ps, D), g), rand_int((1, KVN, ps, D), g)
    q = query(seed, F16)
    sc, off = channel_scale(g, (2, KVN, 1, D), F16), offset_like(g, (2, KVN, 1, D), F16)
    act = [15, 6]
    fk = dict(b=B, kvn=KVN, s=s, d=D)
    fp = dict(b=1, kvn=KVN, s=ps, d=D)
    k_own = dequant(kq, factor("channel", sc[0], **fk), factor("channel", off[0], **fk))
    v_own = dequant(vq, factor("channel", sc[1], **fk), factor("channel", off[1], **fk))
    k_pre = dequant(kp, factor("channel", sc[0], **fp), factor("channel", off[0], **fp))[:, :, :p]
    v_pre = dequant(vp, factor("channel", sc[1], **fp), factor("channel", off[1], **fp))[:, :, :p]
    k64 = [torch.cat([k_pre[0], k_own[b, :, :act[b]]], dim=1) for b in range(B)]
    v64 = [torch.cat([v_pre[0], v_own[b, :, :act[b]]], dim=1) for b in range(B)]
    scale = 1 / math.sqrt(D)
    out, l = fia.npu_fused_infer_attention_score(
        q, kq, vq, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=scale, antiquant_scale=sc,
        antiquant_offset=off, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[p],
        actual_seq_lengths_kv=act, softmax_lse_flag=True)
    ro, rl = naive.attention([x for x in q.double()], k64, v64, scale=scale)
    assert_close(out, ro, F16)
    assert_lse(l[..., 0], rl)


@pytest.mark.case(q_s=1)
def test_zero_kv_length_batch():
    """A batch with act_kv = 0 (no key) gives output 0 and lse +inf also with dequantization."""
    seed = 919
    g = gen(seed + 1)
    kq, vq = ints(seed, s=16)
    q = query(seed, F16)
    sc = rand_uniform((2, B, 16), g, 0.002, 0.03, F32)
    fk = dict(b=B, kvn=KVN, s=16, d=D)
    k64 = dequant(kq, factor("token", sc[0], **fk))
    v64 = dequant(vq, factor("token", sc[1], **fk))
    oc = run_and_check(q, kv_in(kq, "BNSD"), kv_in(vq, "BNSD"), k64, v64, layout="BNSD", act_kv=[0, 16],
                       kw=dict(antiquant_scale=sc, antiquant_mode=1, actual_seq_lengths_kv=[0, 16]))
    assert (oc[0] == 0).all()
