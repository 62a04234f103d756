"""Full int8 attention and query dequantization (SPEC 11), with float16 or int8 output (SPEC 12, 13).

The expectations come from the independent float64 formulation of (corrected) SPEC 11 in
tests/semantics/test_quant_helpers.py (int8_attention; it never imports fia), on random int8 inputs:
S = (int32(Q·Kᵀ)·dequant_scale1)·scale, E = exp(S - rowmax S) (the flash kernel's unnormalized exponentials),
P8 = sat(rhe(E·quant_scale1)), O = int32(P8·V)·dequant_scale2 / rowsum(E), lse = rowmax S + log rowsum(E).
One test reproduces torch_npu's own all-ones unit test (every scale 1.0: output 1).
P8 entries whose E·quant_scale1 lies within 2e-3 of a rounding boundary may legitimately land on either side;
the comparison allows exactly the output change such flips can cause (plus float16 output rounding), and
int8 outputs must lie within ±1 of the quantized reference.
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
import naive
from test_quant_helpers import (F16, BF16, F32, assert_int8_within, assert_within_amb, f32, int8_attention,
                                out_quant_bounds, rand_int, rand_uniform, uint64_form)
from util import (assert_close, assert_lse, expected_out_shape, gen, out_to_canon, randn, seed_of, to_layout)

I8 = torch.int8
NAN = float("nan")


def qkv8(seed, b, n, kvn, sq, skv, d):
    g = gen(seed)
    return (rand_int((b, n, sq, d), g), rand_int((b, kvn, skv, d), g), rand_int((b, kvn, skv, d), g))


def scale_arg(x: float, form: str):
    if form == "f32":
        return torch.tensor([x], dtype=F32)
    if form == "u64":
        return uint64_form(x)
    if form == "u64-high":
        return uint64_form(x, high=0x1234)          # only the low 32 bits carry the float32 pattern
    if form == "f32-scalar":
        return torch.tensor(x, dtype=F32)
    if form == "torch-uint64":
        return uint64_form(x).to(torch.uint64)     # the documents' DT_UINT64 as torch's own uint64 dtype
    raise ValueError(form)


def run_int8(q8, k8, v8, *, layout, ds1, qs1, ds2, scale, form="f32", lse=True, api="fused", kw=None,
             act_q=None, act_kv=None, naive_kw=None, qscale2=None, qoffset2=None):
    """Run full int8 through the API and return (out_canon, lse_canon, ref_out, ref_lse, amb)."""
    b, n, sq, d = q8.shape
    kvn = k8.shape[1]
    base = layout.split("_")[0]
    kw = dict(kw or {})
    if act_q is not None:
        kw["actual_seq_lengths"] = list(act_q)
    if act_kv is not None:
        kw["actual_seq_lengths_kv"] = list(act_kv)
    if qscale2 is not None:
        kw["quant_scale2"] = qscale2
    if qoffset2 is not None:
        kw["quant_offset2"] = qoffset2
    qq, kk, vv = to_layout(q8, base), to_layout(k8, base), to_layout(v8, base)
    if api == "fused":
        out, l = fia.npu_fused_infer_attention_score(
            qq, kk, vv, num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale,
            dequant_scale1=scale_arg(ds1, form),
            quant_scale1=scale_arg(qs1, form if form.startswith("f32") else "f32"),
            dequant_scale2=scale_arg(ds2, form), softmax_lse_flag=lse, **kw)
    else:
        out = fia.npu_prompt_flash_attention(
            qq, kk, vv, num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale_value=scale,
            deq_scale1=scale_arg(ds1, form), quant_scale1=scale_arg(qs1, "f32"), deq_scale2=scale_arg(ds2, form),
            **kw)
        l, lse = None, False
    nk = dict(naive_kw or {})
    if act_q is not None:
        nk.setdefault("q_windows", [(0, a) for a in (act_q * b if len(act_q) == 1 else act_q)])
    if act_kv is not None:
        nk.setdefault("kv_windows", [(0, a) for a in (act_kv * b if len(act_kv) == 1 else act_kv)])
    ro, rl, amb = int8_attention(q8, k8, v8, ds1=f32(ds1), qs1=f32(qs1), ds2=f32(ds2), scale=f32(scale), **nk)
    want = I8 if qscale2 is not None else F16
    assert out.dtype == want, (out.dtype, want)
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, v8.shape[3]), (tuple(out.shape), layout)
    oc = out_to_canon(out, layout, n)
    lc = None
    if lse:
        lc = l[..., 0]
        assert_lse(lc, rl)
    return oc, lc, ro, rl, amb


def check_f16(oc, ro, amb, rl):
    assert_within_amb(oc, ro, amb, rel=1e-3)
    dead = torch.isposinf(rl)
    assert (oc[dead] == 0).all()


# typical magnitudes: |Q·K| ~ sqrt(D)·73² ≈ 4e4 (D = 64); ds1·scale ≈ 6e-5 -> S std ≈ 2.5
LAYOUTS = ["BSH", "BSND", "BNSD", "BNSD_BSND"]


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("form", ["f32", "u64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_int8_fp16_out(layout, form):
    """int8 Q/K/V, per-tensor scales as float32 or the int64 "UINT64" bit-pattern form; float16 output; GQA;
    right-padded lengths; softmax_lse."""
    seed = seed_of("full", layout, form)
    b, n, kvn, sq, skv, d = 2, 4, 2, 9, 33, 64
    q8, k8, v8 = qkv8(seed, b, n, kvn, sq, skv, d)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout=layout, ds1=5e-4, qs1=127.0, ds2=2e-4, scale=1 / 8,
                                   form=form, act_q=[9, 5], act_kv=[33, 20])
    check_f16(oc, ro, amb, rl)
    assert torch.isposinf(lc[1, :, 5:]).all() and (oc[1, :, 5:] == 0).all()


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("qs1,sstd", [(127.0, 2.5), (40.0, 1.0), (600.0, 6.0), (3000.0, 0.3)],
                         ids=["qs127", "qs40", "qs600-saturating", "qs3000-flat-saturating"])
def test_full_int8_p8_ranges(qs1, sstd):
    """E·quant_scale1 in several ranges, including saturation at 127 (qs1 = 600: the entries near each row's
    max; qs1 = 3000 with near-uniform E: every entry). The test asserts that the intended range is exercised."""
    b, n, kvn, sq, skv, d = 2, 2, 1, 6, 24, 64
    q8, k8, v8 = qkv8(seed_of("p8", qs1), b, n, kvn, sq, skv, d)
    ds1 = sstd / (4e4 * 0.125)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BNSD", ds1=ds1, qs1=qs1, ds2=1e-4, scale=0.125)
    check_f16(oc, ro, amb, rl)
    # how saturated is P8 in the reference?
    acc = torch.einsum("bnqd,bkd->bnqk", q8.double(), k8[:, 0].double()) * f32(ds1) * 0.125
    x = torch.exp(acc - acc.amax(dim=-1, keepdim=True)) * f32(qs1)      # E·quant_scale1
    if qs1 >= 600:
        assert (x > 127.5).any(), "expected saturated P8 entries"
        if qs1 >= 3000:
            assert (x > 127.5).all(), "expected every P8 entry saturated"
    else:
        assert (x <= 127.5).all() and (x.round() > 1).sum() > x.numel() // 4, "expected unsaturated, non-trivial P8"


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("form", ["u64-high", "f32-scalar", "torch-uint64"])
def test_full_int8_scale_forms(form):
    """"UINT64" scales with non-zero high bits (only the low 32 bits are the float32 pattern), a torch.uint64
    tensor (SPEC 11: "a 64-bit integer tensor whose low 32 bits are the float32 bit pattern"; the documents'
    dtype is UINT64) and 0-d float32 scales (one element)."""
    q8, k8, v8 = qkv8(31, 1, 2, 2, 4, 16, 32)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BSH", ds1=1e-3, qs1=127.0, ds2=3e-4, scale=0.17, form=form)
    check_f16(oc, ro, amb, rl)


MASKS = [
    # id, sparse_mode, pre, next, mask kind
    ("s0-mask-band", 0, 3, 1, "rand"),
    ("s1-all", 1, None, None, "rand"),
    ("s2-causal", 2, None, None, "tmpl"),
    ("s3-rdcausal", 3, None, None, "tmpl"),
    ("s4-band", 4, 4, 0, "tmpl"),
]


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("mid,sparse,pre,nxt,mk", MASKS, ids=[m[0] for m in MASKS])
def test_full_int8_masks(mid, sparse, pre, nxt, mk):
    """Masks / sparse modes apply to S after dequantization (SPEC 11 '+ mask …', SPEC 5)."""
    b, n, kvn, sq, skv, d = 2, 2, 2, 8, 20, 32
    q8, k8, v8 = qkv8(seed_of("m8", mid), b, n, kvn, sq, skv, d)
    g = gen(seed_of("m8m", mid))
    kw = dict(sparse_mode=sparse)
    nk = dict(sparse_mode=sparse)
    if pre is not None:
        kw.update(pre_tokens=pre, next_tokens=nxt)
        nk.update(pre_tokens=pre, next_tokens=nxt)
    if mk == "rand":
        m = torch.rand(sq, skv, generator=g) < 0.3
        kw["atten_mask"] = m
        nk["mask"] = m.unsqueeze(0).expand(b, -1, -1)
    else:
        kw["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BSND", ds1=1e-3, qs1=127.0, ds2=2e-4, scale=0.177,
                                   act_q=[8, 6], act_kv=[20, 13], kw=kw, naive_kw=nk)
    check_f16(oc, ro, amb, rl)


@pytest.mark.case(full_quant=True)
def test_full_int8_left_padding():
    """Query and KV left padding (SPEC 4) with full int8: windows [S - pad - act, S - pad); fp16 output + lse."""
    b, n, kvn, sq, skv, d = 2, 2, 2, 6, 8, 32
    q8, k8, v8 = qkv8(404, b, n, kvn, sq, skv, d)
    oc, lc, ro, rl, amb = run_int8(
        q8, k8, v8, layout="BNSD", ds1=1e-3, qs1=127.0, ds2=1e-3, scale=0.17,
        kw=dict(actual_seq_lengths=[4, 3], actual_seq_lengths_kv=[5, 6], query_padding_size=torch.tensor([1]),
                kv_padding_size=torch.tensor([2])),
        naive_kw=dict(q_windows=[(1, 5), (2, 5)], kv_windows=[(1, 6), (0, 6)]))
    check_f16(oc, ro, amb, rl)
    assert (oc[:, :, 5:] == 0).all() and (oc[0, :, :1] == 0).all()


@pytest.mark.case(full_quant=True)
def test_full_int8_pse():
    """pse_shift (float16 for an int8 query, SPEC 3) is added after the dequantized, scaled scores."""
    b, n, kvn, sq, skv, d = 1, 2, 1, 5, 12, 32
    q8, k8, v8 = qkv8(61, b, n, kvn, sq, skv, d)
    pse = randn((1, n, sq, skv), gen(62), F16, std=2.0)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BNSD", ds1=1e-3, qs1=127.0, ds2=2e-4, scale=0.2,
                                   kw=dict(pse_shift=pse), naive_kw=dict(pse=pse))
    check_f16(oc, ro, amb, rl)


@pytest.mark.case(full_quant=True)
def test_prompt_api_full_int8():
    """npu_prompt_flash_attention spells the scales deq_scale1 / deq_scale2 (SPEC 1.1)."""
    b, n, kvn, sq, skv, d = 2, 2, 2, 6, 15, 32
    q8, k8, v8 = qkv8(71, b, n, kvn, sq, skv, d)
    oc, _, ro, rl, amb = run_int8(q8, k8, v8, layout="BSH", ds1=1e-3, qs1=127.0, ds2=2e-4, scale=0.177,
                                  api="prompt", lse=False)
    check_f16(oc, ro, amb, rl)


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("api", ["fused", "prompt"])
def test_full_int8_torch_npu_all_ones(api):
    """torch_npu's own unit test: query, key and value all-ones int8, every scale 1.0, 2048 keys. Every E is 1,
    P8 = 1, int32(P8·V) = 2048, divided by rowsum(E) = 2048: the output is exactly 1 (quantizing the normalized
    softmax instead gives round(1/2048) = 0)."""
    b, n, sq, skv, d = 1, 2, 16, 2048, 128
    q8 = torch.ones(b, n, sq, d, dtype=I8)
    k8 = torch.ones(b, n, skv, d, dtype=I8)
    v8 = torch.ones(b, n, skv, d, dtype=I8)
    one = torch.tensor([1.0], dtype=F32)
    if api == "fused":
        out, l = fia.npu_fused_infer_attention_score(q8, k8, v8, num_heads=n, input_layout="BNSD", scale=1.0,
                                                     dequant_scale1=one, quant_scale1=one, dequant_scale2=one,
                                                     softmax_lse_flag=True)
        # lse of the float scores: S = D everywhere -> D + log(2048)
        assert torch.allclose(l.double(), torch.full_like(l.double(), d + math.log(skv)), rtol=0, atol=1e-4)
    else:
        out = fia.npu_prompt_flash_attention(q8, k8, v8, num_heads=n, input_layout="BNSD", scale_value=1.0,
                                             deq_scale1=one, quant_scale1=one, deq_scale2=one)
    assert out.dtype == F16
    assert torch.equal(out, torch.ones_like(out)), f"expected all ones, got values {out.unique().tolist()}"


def normalized_int8_attention(q8, k8, v8, *, ds1, qs1, ds2, scale):
    """The superseded formulation (P8 quantized from the normalized softmax), float64, no masks: only to show
    that the tests below tell the two apart."""
    grp = q8.shape[1] // k8.shape[1]
    k = k8.double().repeat_interleave(grp, dim=1)
    v = v8.double().repeat_interleave(grp, dim=1)
    s = (q8.double() @ k.transpose(-1, -2)) * ds1 * scale
    p8 = (torch.softmax(s, dim=-1) * qs1).round().clamp(-128, 127)
    return (p8 @ v) * ds2


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("tiling", ["default", "online"])
def test_full_int8_unnormalized(tiling, fia_backend, monkeypatch):
    """Random int8 Q/K/V, GQA, quant_scale1 = 127 (E·127 spans the codes): the corrected formula, which the
    superseded one (normalized P8) misses by far. "online": the torch backend with tiny tiles (several key
    chunks: E is taken against the final row max in a second pass)."""
    if tiling == "online":
        if fia_backend != "torch":
            pytest.skip("a torch backend tiling")
        from fia.backends.torchops.backend import TorchBackend
        for k_, v_ in dict(kv_elems=16 * 64, score_elems=16 * 16, rows_elems=0, max_chunk=16).items():
            monkeypatch.setattr(TorchBackend, k_, v_)
    b, n, kvn, sq, skv, d = 2, 4, 2, 10, 70, 32
    q8, k8, v8 = qkv8(seed_of("unnorm", tiling), b, n, kvn, sq, skv, d)
    ds1, qs1, ds2, scale = 3e-4, 127.0, 1e-3, 0.125          # S std ~ 1: many keys share the weight
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BNSD", ds1=ds1, qs1=qs1, ds2=ds2, scale=scale,
                                   act_kv=[70, 41])
    check_f16(oc, ro, amb, rl)
    old = normalized_int8_attention(q8[:1], k8[:1], v8[:1], ds1=f32(ds1), qs1=f32(qs1), ds2=f32(ds2),
                                    scale=f32(scale))
    with pytest.raises(AssertionError, match="elements off"):       # the check above rejects the old formula
        assert_within_amb(old, ro[:1], amb[:1], rel=1e-3)


@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("ip", [0, 2], ids=["no-fix", "row-invalid-fix"])
def test_full_int8_rows_without_keys(ip):
    """SPEC 6 with full int8. Batch 0: rows 1 and 4 fully masked by the user mask (sparse 1): without row-invalid
    correction every valid key has E = 1 (finite fill), so O = round(qs1)·Σv·ds2 / count and lse = -1e12 +
    log(count); with it, 0 / +inf. Batch 1 (act_kv 13 of 20 keys): rowmax / rowsum over its 13 keys only.
    sparse 3 variant below: rows the geometry leaves without a key are 0 / +inf."""
    b, n, kvn, sq, skv, d = 2, 2, 1, 6, 20, 32
    q8, k8, v8 = qkv8(seed_of("nokey", ip), b, n, kvn, sq, skv, d)
    m = torch.rand(sq, skv, generator=gen(seed_of("nokey-m", ip))) < 0.3
    m[1] = True
    m[4] = True
    mask = torch.stack([m, torch.zeros_like(m)])                   # batch 1: no user-masked key
    kw = dict(sparse_mode=1, atten_mask=mask, inner_precise=ip)
    nk = dict(sparse_mode=1, mask=mask, inner_precise=ip)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BNSD", ds1=1e-3, qs1=127.0, ds2=2e-4, scale=0.177,
                                   act_kv=[20, 13], kw=kw, naive_kw=nk)
    check_f16(oc, ro, amb, rl)
    if ip == 0:
        mean = 127.0 * v8[0, 0].double().sum(dim=0) * f32(2e-4) / skv    # round(qs1)·Σv·ds2 / rowsum(E)
        assert torch.allclose(oc[0, :, 1].double(), mean.expand(n, d), rtol=2e-3, atol=1e-4)
        assert (lc[0, :, [1, 4]] < -1e11).all()
    else:
        assert (oc[0, :, [1, 4]] == 0).all() and torch.isposinf(lc[0, :, [1, 4]]).all()


@pytest.mark.case(full_quant=True)
def test_full_int8_geometry_dead_rows():
    """sparse 3 with act_kv < act_q (BNSD): the first act_q - act_kv rows of batch 1 see no key: 0 / +inf."""
    b, n, kvn, sq, skv, d = 2, 2, 2, 8, 20, 32
    q8, k8, v8 = qkv8(seed_of("dead8"), b, n, kvn, sq, skv, d)
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout="BNSD", ds1=1e-3, qs1=127.0, ds2=2e-4, scale=0.177,
                                   act_q=[8, 8], act_kv=[20, 5], kw=dict(sparse_mode=3, atten_mask=tmpl),
                                   naive_kw=dict(sparse_mode=3))
    check_f16(oc, ro, amb, rl)
    assert (oc[1, :, :3] == 0).all() and torch.isposinf(lc[1, :, :3]).all() and torch.isfinite(lc[1, :, 3:]).all()


# ------------------------------------------------------------------------------- int8 output (SPEC 12)
@pytest.mark.case(full_quant=True)
@pytest.mark.parametrize("layout,shape", [
    ("BSH", "tensor"), ("BSH", (1, 1, "H")), ("BSH", ("H",)),
    ("BNSD", (1, "N", 1, "D")), ("BNSD", ("N", "D")), ("BSND", (1, 1, "N", "D")), ("BSND", ("N", "D")),
    ("BNSD_BSND", (1, 1, "N", "D")),
], ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("with_offset", [False, True], ids=["nooff", "off"])
def test_full_int8_int8_out(layout, shape, with_offset):
    """int8 in, int8 out: y8 = sat(rhe(O·quant_scale2 + quant_offset2)) within ±1; scales spread so that both
    saturation ends are hit; rows past act_q quantize their 0 (-> sat(rhe(offset)))."""
    b, n, kvn, sq, skv, d = 2, 2, 2, 7, 25, 32
    seed = seed_of("i8o", layout, str(shape), with_offset)
    q8, k8, v8 = qkv8(seed, b, n, kvn, sq, skv, d)
    g = gen(seed + 5)
    if shape == "tensor":
        qs2 = torch.tensor([2.0], dtype=F32)
    else:
        dims = tuple({"H": n * d, "N": n, "D": d}.get(x, x) for x in shape)
        qs2 = rand_uniform(dims, g, 0.2, 4.0, F32)
    qo2 = rand_uniform(qs2.shape, g, -40, 40, F32) if with_offset else None
    oc, lc, ro, rl, amb = run_int8(q8, k8, v8, layout=layout, ds1=1e-3, qs1=127.0, ds2=1e-2, scale=0.177,
                                   act_q=[7, 4], qscale2=qs2, qoffset2=qo2)
    sc = qs2.double().reshape(-1) if qs2.numel() == 1 else qs2.double().reshape(n, d)[None, :, None, :]
    off = None
    if qo2 is not None:
        off = qo2.double().reshape(-1) if qo2.numel() == 1 else qo2.double().reshape(n, d)[None, :, None, :]
    lo, hi = out_quant_bounds(ro, amb, sc, off)
    assert_int8_within(oc, lo, hi)
    assert (oc == 127).any() and (oc == -128).any(), "scales should reach both saturation ends"
    # rows past act_q (batch 1, rows 4..6): exactly sat(rhe(offset))
    exp = torch.zeros(n, 3, d, dtype=torch.float64) if off is None else \
        (off.reshape(1, 1, 1).expand(n, 3, d) if off.numel() == 1 else off[0].expand(n, 3, d))
    assert torch.equal(oc[1, :, 4:].double(), exp.round().clamp(-128, 127))


# ------------------------------------------------------------------------------- query dequantization
@pytest.mark.parametrize("kvdt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,sq", [("BSH", 1), ("BNSD", 1), ("BSND", 6), ("BNSD", 11)])
def test_query_dequant(layout, sq, kvdt):
    """int8 query + dequant_scale_query (B, Q_N, Q_S) float32 with query_quant_mode 3 and float K/V:
    Q = Q_q · scale per token and head; output float16 (SPEC 11, 13). Scales of rows past act_q are NaN."""
    kdt = {"fp16": F16, "bf16": BF16}[kvdt]
    b, n, kvn, skv, d = 2, 4, 2, 30, 64
    seed = seed_of("qdq", layout, sq, kvdt)
    g = gen(seed)
    q8 = rand_int((b, n, sq, d), g)
    k, v = randn((b, kvn, skv, d), g, kdt), randn((b, kvn, skv, d), g, kdt)
    dsq = rand_uniform((b, n, sq), g, 0.002, 0.02, F32)
    act_q = [sq, max(1, sq - 3)]
    for i, a in enumerate(act_q):
        dsq[i, :, a:] = NAN
    scale = 1 / math.sqrt(d)
    base = layout.split("_")[0]
    kw = dict(actual_seq_lengths_kv=[30, 17])
    if sq > 1:
        kw["actual_seq_lengths"] = act_q
    out, l = fia.npu_fused_infer_attention_score(
        to_layout(q8, base), to_layout(k, base), to_layout(v, base), num_heads=n, num_key_value_heads=kvn,
        input_layout=layout, scale=scale, dequant_scale_query=dsq, query_quant_mode=3, softmax_lse_flag=True, **kw)
    assert out.dtype == F16, out.dtype
    q64 = q8.double() * dsq.double()[..., None]
    ref, rl = naive.attention(q64, k.double(), v.double(), scale=scale, q_windows=[(0, a) for a in act_q],
                              kv_windows=[(0, 30), (0, 17)])
    oc = out_to_canon(out, layout, n)
    ref = torch.nan_to_num(ref)        # rows past act_q (NaN query scale) are never computed: reference 0
    assert_close(oc, ref, F16)
    assert_lse(l[..., 0], torch.where(torch.isnan(rl), torch.full_like(rl, math.inf), rl))
    if sq > 1:
        assert (oc[1, :, act_q[1]:] == 0).all()


def test_query_dequant_int8_out():
    """Query dequantization combined with output quantization (float32 quant_scale2 / quant_offset2)."""
    b, n, kvn, sq, skv, d = 1, 2, 1, 4, 20, 32
    g = gen(5150)
    q8 = rand_int((b, n, sq, d), g)
    k, v = randn((b, kvn, skv, d), g, F16), randn((b, kvn, skv, d), g, F16)
    dsq = rand_uniform((b, n, sq), g, 0.002, 0.02, F32)
    qs2, qo2 = torch.tensor([90.0]), torch.tensor([3.0])
    out, _ = fia.npu_fused_infer_attention_score(q8, k, v, num_heads=n, num_key_value_heads=kvn, input_layout="BNSD",
                                                 scale=0.177, dequant_scale_query=dsq, query_quant_mode=3,
                                                 quant_scale2=qs2, quant_offset2=qo2)
    ref, _ = naive.attention(q8.double() * dsq.double()[..., None], k.double(), v.double(), scale=0.177)
    lo, hi = out_quant_bounds(ref, None, 90.0, 3.0)
    assert_int8_within(out, lo, hi)


def test_query_dequant_left_padding():
    """Query dequantization with query left padding: the scale of a row is indexed by its physical position;
    scales outside the valid windows are NaN (never read)."""
    b, n, sq, skv, d = 2, 2, 6, 9, 32
    g = gen(6060)
    q8 = rand_int((b, n, sq, d), g)
    k, v = randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    dsq = rand_uniform((b, n, sq), g, 0.002, 0.02, F32)
    win = [(1, 5), (3, 5)]                          # Q_S - pad - act .. Q_S - pad with pad 1, act 4 / 2
    for i, (lo, hi) in enumerate(win):
        dsq[i, :, :lo] = NAN
        dsq[i, :, hi:] = NAN
    out, l = fia.npu_fused_infer_attention_score(q8, k, v, num_heads=n, input_layout="BNSD", scale=0.17,
                                                 dequant_scale_query=dsq, query_quant_mode=3, actual_seq_lengths=[4, 2],
                                                 query_padding_size=torch.tensor([1]), softmax_lse_flag=True)
    ref, rl = naive.attention(q8.double() * dsq.double()[..., None], k.double(), v.double(), scale=0.17,
                              q_windows=win)
    assert out.dtype == F16
    assert_close(out, ref, F16)
    assert_lse(l[..., 0], rl)
