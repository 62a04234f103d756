"""Output quantization (SPEC 12, 13) with float16 / bfloat16 inputs (and with int8 K/V dequantization).

y8 = saturate_int8(round_half_even(y · quant_scale2 + quant_offset2)), per-tensor (1,) or per-channel in every
documented shape; float32 scales, or bfloat16 with a bfloat16 query. The float64 reference is quantized the
same way. Every backend quantizes from its float32 result (SPEC 12, 15.5; DECISIONS 44: no rounding to the
query dtype first), so the int8 output must equal the quantized float64 reference except where that value lies
within F32_EPS codes of a rounding boundary (float32 accumulation error); exactly where the float result is exact
(one key: softmax weight 1, so y = V). (The ±1 of SPEC 15.5 is the hardware's own float16 rounding.)
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
import naive
from test_quant_helpers import (F16, BF16, F32, assert_int8_within, dequant, factor, out_quant_bounds, rand_int,
                                rand_uniform)
from util import (expected_out_shape, gen, out_to_canon, randn, seed_of, to_layout, to_tnd, cumsum)

I8 = torch.int8
DT = {"fp16": F16, "bf16": BF16}


F32_EPS = 2e-3      # codes: float32 accumulation (~1e-6 of |y|) at |y·scale| <= a few hundred, with margin


def f32_bounds(ref: torch.Tensor, sc, off):
    """The float32-based expectation: sat(rhe(ref·sc + off)) exactly, either neighbour only within F32_EPS codes
    of a rounding boundary."""
    amb = torch.full_like(ref, F32_EPS) / torch.as_tensor(sc, dtype=torch.float64).abs()
    return out_quant_bounds(ref, amb, sc, off, slack=0)


def dims_of(shape, n, d):
    return tuple({"H": n * d, "N": n, "D": d}.get(x, x) for x in shape)


def canon_param(t: torch.Tensor, n: int, d: int):
    """quant_scale2 / quant_offset2 -> float64 broadcastable to canonical [B, N, S, D]."""
    if t is None:
        return None
    if t.numel() == 1:
        return t.double().reshape(())
    return t.double().reshape(n, d)[None, :, None, :]


SHAPES = [
    ("BSH", "tensor"), ("BSH", (1, 1, "H")), ("BSH", ("H",)),
    ("BNSD", "tensor"), ("BNSD", (1, "N", 1, "D")), ("BNSD", ("N", "D")),
    ("BSND", (1, 1, "N", "D")), ("BSND", ("N", "D")),
    ("BNSD_BSND", (1, 1, "N", "D")), ("BSH_NBSD", ("N", "D")),
]


# a bfloat16 quant_scale2 needs a bfloat16 query (see test_validation_quant): no fp16 query with bf16 scales
@pytest.mark.parametrize("dt,sdt", [("fp16", "f32"), ("bf16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("layout,shape", SHAPES, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("with_offset", [False, True], ids=["nooff", "off"])
def test_output_quant(layout, shape, dt, sdt, with_offset):
    """Per-tensor and per-channel output quantization in every documented shape; both saturation ends are
    reached; rows past act_q and a batch without keys give exactly sat(rhe(offset))."""
    dtype = DT[dt]
    pdt = F32 if sdt == "f32" else BF16
    b, n, kvn, skv, d = 3, 4, 2, 21, 32
    sq = 4 if "NBSD" in layout else 6
    seed = seed_of("oq", layout, str(shape), dt, sdt, with_offset)
    g = gen(seed)
    q, k, v = randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype,
                                                                                        std=3.0)
    if shape == "tensor":
        qs2 = torch.tensor([70.0], dtype=pdt)
    else:
        qs2 = rand_uniform(dims_of(shape, n, d), g, 5.0, 150.0, pdt)
    qo2 = rand_uniform(qs2.shape, g, -30.0, 30.0, pdt) if with_offset else None
    act_q, act_kv = [sq, 3, sq], [21, 9, 0]
    base = layout.split("_")[0]
    scale = 1 / math.sqrt(d)
    kw = dict(quant_scale2=qs2, actual_seq_lengths=act_q, actual_seq_lengths_kv=act_kv)
    if qo2 is not None:
        kw["quant_offset2"] = qo2
    out, lse = fia.npu_fused_infer_attention_score(
        to_layout(q, base), to_layout(k, base), to_layout(v, base), num_heads=n, num_key_value_heads=kvn,
        input_layout=layout, scale=scale, softmax_lse_flag=True, **kw)
    assert out.dtype == I8 and lse.dtype == F32
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, d)
    ref, rl = naive.attention(q.double(), k.double(), v.double(), scale=scale,
                              q_windows=[(0, a) for a in act_q], kv_windows=[(0, a) for a in act_kv])
    sc, off = canon_param(qs2, n, d), canon_param(qo2, n, d)
    lo, hi = f32_bounds(ref, sc, off)
    oc = out_to_canon(out, layout, n)
    assert_int8_within(oc, lo, hi)
    assert (oc == 127).any() and (oc == -128).any(), "scales should reach both saturation ends"
    # never-computed rows: batch 1 rows >= 3, all of batch 2 (no keys): their 0 quantizes to sat(rhe(offset))
    zero_q = torch.round(torch.zeros_like(ref) * sc + (0.0 if off is None else off)).clamp(-128, 127)
    assert torch.equal(oc[1, :, 3:].double(), zero_q[1, :, 3:])
    assert torch.equal(oc[2].double(), zero_q[2])
    assert torch.isposinf(lse[2]).all()


@pytest.mark.case(q_s=1)
def test_round_half_even_exact():
    """One key per batch: softmax weight exactly 1, so y = V exactly and y·scale + offset hits exact .5 ties;
    round half to even (SPEC 12): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2, -2.5 -> -2; saturation
    above 127 / below -128."""
    vals = [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, 127.5, 300.0, -128.5, -129.0, -1000.0, 0.0, 7.25]
    d = len(vals)
    v = torch.tensor(vals, dtype=F16).reshape(1, 1, 1, d)
    k = torch.randn(1, 1, 1, d).half()
    q = torch.randn(1, 1, 1, d).half()
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=1, input_layout="BNSD", scale=0.25,
                                                 quant_scale2=torch.tensor([1.0]))
    exp = [0, 2, 2, 4, 0, -2, -2, -4, 126, 127, 127, -128, -128, -128, 0, 7]
    assert out.reshape(-1).tolist() == exp
    # the same ties produced by scale and offset: y = 1 -> y·2.5 + 0.5 = 3 exactly; y·1.25 + 1.25 = 2.5 -> 2
    v1 = torch.ones(1, 1, 1, d, dtype=F16)
    out, _ = fia.npu_fused_infer_attention_score(q, k, v1, num_heads=1, input_layout="BNSD", scale=0.25,
                                                 quant_scale2=torch.tensor([1.25]), quant_offset2=torch.tensor([1.25]))
    assert (out == 2).all(), out


@pytest.mark.case(q_s=1)
def test_per_channel_values_land_on_their_channel():
    """Per-channel parameters are indexed (head, channel) in output order: with one key, y = V and a (N, D)
    scale of distinct powers of two, every element must come out exactly as V·scale (exact arithmetic)."""
    n, d = 2, 16
    v = torch.full((1, n, 1, d), 1.0, dtype=F16)
    qs2 = torch.tensor([float(1 + (i % 100)) for i in range(n * d)], dtype=F32).reshape(n, d)
    qo2 = torch.tensor([float(-(i % 7)) for i in range(n * d)], dtype=F32).reshape(n, d)
    q, k = torch.randn(1, n, 1, d).half(), torch.randn(1, n, 1, d).half()
    for layout in ("BNSD", "BSND", "BSH"):
        out, _ = fia.npu_fused_infer_attention_score(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout),
                                                     num_heads=n, input_layout=layout, scale=0.25,
                                                     quant_scale2=qs2, quant_offset2=qo2)
        oc = out_to_canon(out, layout, n)
        assert torch.equal(oc[0, :, 0].double(), (qs2 + qo2).double()), layout


def test_tnd_per_channel():
    """Packed TND output [T, N, D]: per-channel (N, D) parameters (product N·D), bf16 scale with bf16 query."""
    n, d = 2, 128
    qlens, kvlens = [3, 5], [7, 4]
    g = gen(2024)
    qs = [randn((n, l, d), g, BF16) for l in qlens]
    ks = [randn((n, l, d), g, BF16) for l in kvlens]
    vs = [randn((n, l, d), g, BF16, std=2.0) for l in kvlens]
    qs2 = rand_uniform((n, d), g, 10.0, 120.0, BF16)
    qo2 = rand_uniform((n, d), g, -10.0, 10.0, BF16)
    with fia.validation_mode("portable"):     # TND: no output quantization in strict mode (SPEC 14b.4 T17)
        out, _ = fia.npu_fused_infer_attention_score(to_tnd(qs), to_tnd(ks), to_tnd(vs), num_heads=n,
                                                     input_layout="TND", scale=0.088, actual_seq_lengths=cumsum(qlens),
                                                     actual_seq_lengths_kv=cumsum(kvlens), quant_scale2=qs2,
                                                     quant_offset2=qo2)
    assert out.dtype == I8 and out.shape == (sum(qlens), n, d)
    t = 0
    for i, l in enumerate(qlens):
        ref, _ = naive.attention([qs[i].double()], [ks[i].double()], [vs[i].double()], scale=0.088, stack=False)
        lo, hi = f32_bounds(ref[0], qs2.double()[:, None, :], qo2.double()[:, None, :])
        assert_int8_within(out[t:t + l].permute(1, 0, 2), lo, hi)
        t += l


@pytest.mark.case(q_s=64)
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("sparse", [0, 3])
def test_prefill_quantizes_float32_result(dt, sparse):
    """Prefill at D = 128 (the prefill backend's own flash kernel where the CPU runs it): int8 codes quantized
    from the float32 result, not from one rounded to the query dtype first (with bf16 that put 2-3 % of the codes
    one off the float64 result). Codes spread over the whole int8 range."""
    dtype = DT[dt]
    b, n, kvn, sq, skv, d = 2, 8, 2, 64, 300, 128
    g = gen(seed_of("oq-f32", dt, sparse))
    q, k, v = randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)
    kw = dict(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)) if sparse else {}
    scale = 1 / math.sqrt(d)
    ref, _ = naive.attention(q.double(), k.double(), v.double(), scale=scale, sparse_mode=sparse,
                             kv_windows=[(0, skv), (0, 200)])
    qs2 = float(torch.tensor(127.0 / ref.abs().amax().item() * 1.2, dtype=F32))
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=kvn, input_layout="BNSD",
                                                 scale=scale, actual_seq_lengths_kv=[skv, 200],
                                                 quant_scale2=torch.tensor([qs2]), **kw)
    lo, hi = f32_bounds(ref, qs2, None)
    assert_int8_within(out, lo, hi)
    assert (out == 127).any() and (out == -128).any()


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("api", ["incre", "v2", "fused-antiquant"])
def test_output_quant_entry_points(api):
    """Output quantization through npu_incre_flash_attention, the v2 entry point (quant_scale_out /
    quant_offset_out) and with int8 K/V dequantization (decode)."""
    b, n, kvn, skv, d = 2, 4, 2, 19, 64
    g = gen(seed_of("oqapi", api))
    q = randn((b, n, 1, d), g, F16)
    qs2 = rand_uniform((1, 1, n * d), g, 20.0, 100.0, F32)
    qo2 = rand_uniform((1, 1, n * d), g, -5.0, 5.0, F32)
    sc, off = canon_param(qs2, n, d), canon_param(qo2, n, d)
    if api == "fused-antiquant":
        kq, vq = rand_int((b, kvn, skv, d), g), rand_int((b, kvn, skv, d), g)
        asc = rand_uniform((2, kvn * d), g, 0.005, 0.03, F16)
        k64 = dequant(kq, factor("channel", asc[0], b=b, kvn=kvn, s=skv, d=d))
        v64 = dequant(vq, factor("channel", asc[1], b=b, kvn=kvn, s=skv, d=d))
        out, _ = fia.npu_fused_infer_attention_score(to_layout(q, "BSH"), to_layout(kq, "BSH"), to_layout(vq, "BSH"),
                                                     num_heads=n, num_key_value_heads=kvn, scale=0.125,
                                                     antiquant_scale=asc, quant_scale2=qs2, quant_offset2=qo2)
    else:
        k, v = randn((b, kvn, skv, d), g, F16), randn((b, kvn, skv, d), g, F16)
        k64, v64 = k.double(), v.double()
        if api == "incre":
            out = fia.npu_incre_flash_attention(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"),
                                                num_heads=n, num_key_value_heads=kvn, scale_value=0.125,
                                                quant_scale2=qs2, quant_offset2=qo2)
        else:
            out, _ = fia.npu_fused_infer_attention_score_v2(to_layout(q, "BSH"), to_layout(k, "BSH"),
                                                            to_layout(v, "BSH"), num_query_heads=n,
                                                            num_key_value_heads=kvn, softmax_scale=0.125,
                                                            quant_scale_out=qs2, quant_offset_out=qo2)
    ref, _ = naive.attention(q.double(), k64, v64, scale=0.125)
    lo, hi = out_quant_bounds(ref, None, sc, off)
    assert out.dtype == I8
    assert_int8_within(out_to_canon(out, "BSH", n), lo, hi)


def test_band_rows_without_keys_no_offset():
    """Without quant_offset2 the band may leave rows without keys (sparse 3 with act_q > act_kv): those rows are
    0 and quantize to 0 (SPEC 12 rejects this only when quant_offset2 is given)."""
    b, n, sq, skv, d = 1, 2, 8, 5, 32
    g = gen(31337)
    q, k, v = randn((b, n, sq, d), g, F16), randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, input_layout="BNSD", scale=0.17,
                                                 atten_mask=tmpl, sparse_mode=3, quant_scale2=torch.tensor([50.0]))
    ref, rl = naive.attention(q.double(), k.double(), v.double(), scale=0.17, sparse_mode=3)
    lo, hi = out_quant_bounds(ref, None, 50.0)
    assert_int8_within(out, lo, hi)
    assert (out[:, :, :3] == 0).all()         # rows 0..2 see no key (j > i + S2 - S1 = i - 3)


def test_left_padding_per_tensor_rows_outside_window():
    """Per-tensor output quantization with query/KV left padding (allowed, SPEC 12): rows outside the query
    window and a batch whose window starts below 0 (all zeros, SPEC 4) quantize to sat(rhe(offset))."""
    b, n, sq, skv, d = 3, 2, 6, 9, 32
    g = gen(777)
    q, k, v = randn((b, n, sq, d), g, F16), randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    qs2, qo2 = torch.tensor([40.0]), torch.tensor([-7.5])            # rhe(-7.5) = -8
    act_q, act_kv = [4, 2, 6], [5, 8, 3]
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, input_layout="BNSD", scale=0.17,
                                                 actual_seq_lengths=act_q, actual_seq_lengths_kv=act_kv,
                                                 query_padding_size=torch.tensor([1]),
                                                 kv_padding_size=torch.tensor([1]), quant_scale2=qs2,
                                                 quant_offset2=qo2)
    qw = [(sq - 1 - a, sq - 1) for a in act_q]            # batch 2: 6 - 1 - 6 < 0 -> whole batch zeros
    kw = [(skv - 1 - a, skv - 1) for a in act_kv]
    qw[2], kw[2] = (0, 0), (0, 0)
    ref, _ = naive.attention(q.double(), k.double(), v.double(), scale=0.17, q_windows=qw, kv_windows=kw)
    lo, hi = out_quant_bounds(ref, None, 40.0, -7.5)
    assert_int8_within(out, lo, hi)
    assert (out[0, :, :1] == -8).all() and (out[0, :, 5:] == -8).all() and (out[1, :, :3] == -8).all()
    assert (out[2] == -8).all()
