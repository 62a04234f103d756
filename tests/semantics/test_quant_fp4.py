"""Antiquant mode 6 (SPEC 10b.1, 14b.6): FP4 E2M1 K / V (torch.float4_e2m1fn_x2, two values a byte) with
per-token-group FLOAT8_E8M0 scales (torch.float8_e8m0fnu), decode only, dense and paged.

The oracle decodes the BYTES itself, in float64, from the document's definitions alone: the 16 E2M1 values, element
2k in the low nibble and 2k + 1 in the high nibble of byte k, E8M0 = 2^(bits - 127) (0xFF = NaN), one scale per 32
consecutive channels of a token and KV head. K / V bytes are random (never all zero); scale positions past each
batch's KV length hold 0xFF (NaN) and must never be read; unused paged blocks hold random bytes.
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
import naive
from util import (assert_close, assert_lse, expected_out_shape, gen, out_to_canon, randn, to_layout)

F16, BF16 = torch.float16, torch.bfloat16
FP4, E8M0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
INVALID = 161002
GROUP = 32                                           # channels per E8M0 scale (SPEC 10b.1 [reading], OCP MX)
# OCP MX v1.0 5.3.3 E2M1: codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
B, N, KVN = 2, 8, 2


# ---------------------------------------------------------------------------------------------- the oracle
def fp4_values(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> float64 [..., D] (element 2k: low nibble of byte k; 2k + 1: high nibble)."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    lo, hi = (b & 0xF).long(), (b >> 4).long()
    return torch.stack((table[lo], table[hi]), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def e8m0_values(e: torch.Tensor) -> torch.Tensor:
    """uint8 -> float64 2^(bits - 127), 0xFF -> NaN."""
    v = torch.pow(torch.tensor(2.0, dtype=torch.float64), e.double() - 127.0)
    return torch.where(e == 255, torch.tensor(math.nan, dtype=torch.float64), v)


def dequant64(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """codes uint8 [B, KV_N, S, D/2], exps uint8 [B, KV_N, S', D/32] (S' >= S) -> float64 [B, KV_N, S, D]."""
    v = fp4_values(codes)
    s = e8m0_values(exps[:, :, :codes.shape[2]])
    return v * s.repeat_interleave(GROUP, dim=-1)


def rand_bytes(shape, g) -> torch.Tensor:
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    assert x.any()
    return x


def rand_exps(shape, g, act, lo=118, hi=134) -> torch.Tensor:
    """E8M0 exponents [B, KV_N, S, G] in [lo, hi); 0xFF (NaN) at positions >= act[b] (never read)."""
    e = torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)
    for b, n in enumerate(act):
        e[b, :, n:] = 255
    return e


def fp4(x: torch.Tensor) -> torch.Tensor:
    return x.view(FP4)


def e8m0(x: torch.Tensor) -> torch.Tensor:
    return x.view(E8M0)


def check(q, kin, vin, k64, v64, act, *, layout="BNSD", api="fused", **kw):
    b, n, _, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qq = to_layout(q, layout)
    if api == "fused":
        out, lse = fia.npu_fused_infer_attention_score(qq, kin, vin, num_heads=n, num_key_value_heads=KVN,
                                                       input_layout=layout, scale=scale, softmax_lse_flag=True,
                                                       actual_seq_lengths_kv=act, **kw)
    else:
        out, lse = fia.npu_fused_infer_attention_score_v2(qq, kin, vin, num_query_heads=n, num_key_value_heads=KVN,
                                                          input_layout=layout, softmax_scale=scale,
                                                          return_softmax_lse=True, actual_seq_kvlen=act, **kw)
    ref, ref_lse = naive.attention(q.double(), k64, v64, scale=scale, kv_windows=[(0, x) for x in act])
    assert out.dtype == q.dtype
    assert tuple(out.shape) == expected_out_shape(layout, b, n, 1, v64.shape[-1])
    assert_close(out_to_canon(out, layout, n), ref, q.dtype)
    assert_lse(lse[..., 0], ref_lse)


def mode6(ks, vs) -> dict:
    return dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=6, value_antiquant_mode=6)


# ---------------------------------------------------------------------------------------------- the oracle itself
@pytest.mark.backend_independent
def test_oracle_matches_torch_definitions():
    """The test's byte decode agrees with torch's own dtypes where torch can convert (E8M0 -> float) and with
    the document's table (E2M1)."""
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = e.view(E8M0).to(torch.float64)
    got = e8m0_values(e)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got[:255], want[:255])
    assert fp4_values(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [0.5, 1.0]     # low nibble first
    assert fp4_values(torch.tensor([0xF8], dtype=torch.uint8)).tolist() == [-0.0, -6.0]


# ---------------------------------------------------------------------------------------------- dense
def _group_forms():
    from fia.cpu import fp4 as F
    return ([("arith", F.fp4_group_arith)] + ([("permw", F.fp4_group_permw)] if F._PERMW else [])
            + ([("vbmi", F.fp4_group_vbmi)] if F._VBMI else []))


@pytest.mark.backend_independent
@pytest.mark.parametrize("form", [f[0] for f in _group_forms()])
def test_group_decoder_bytes(form):
    """The decode kernels' 16-byte -> 32-bf16 group decoder (cpu/fp4.py; both forms where the CPU runs them) equals
    the float64 oracle rounded to bf16 for every byte and scales across the whole E8M0 range (0: subnormal, 255: NaN)."""
    import numpy as np
    from numba import njit
    fn = dict(_group_forms())[form]

    @njit
    def run(src, exps, dst):
        for gi in range(exps.shape[0]):
            s = np.float32(np.nan) if exps[gi] == 255 else (
                np.float32(2.0 ** -127) if exps[gi] == 0 else np.float32(2.0) ** np.float32(np.int32(exps[gi]) - 127))
            fn(dst.ctypes.data + 64 * gi, src.ctypes.data + 16 * gi, s)

    g = gen(7301)
    exps = torch.cat([torch.tensor([0, 1, 2, 3, 126, 127, 128, 251, 252, 253, 254, 255], dtype=torch.uint8),
                      torch.randint(0, 256, (55,), generator=g, dtype=torch.uint8)])
    codes = torch.randint(0, 256, (exps.numel(), 16), generator=g, dtype=torch.uint8)
    codes[0] = torch.arange(0, 256, 16, dtype=torch.uint8) + torch.arange(16, dtype=torch.uint8)   # every nibble
    out = np.full(exps.numel() * 32, 0x7FC1, np.uint16)                                          # NaN poison
    run(codes.numpy().copy(), exps.numpy().copy(), out)
    got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).reshape(exps.numel(), 32)
    want = (fp4_values(codes) * e8m0_values(exps)[:, None]).to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_dense_decode(layout, dt):
    dtype = {"fp16": F16, "bf16": BF16}[dt]
    g = gen(600 + len(layout) + (dt == "bf16"))
    d, s, act = 128, 45, [45, 19]
    kc, vc = rand_bytes((B, KVN, s, d // 2), g), rand_bytes((B, KVN, s, d // 2), g)
    ke, ve = rand_exps((B, KVN, s, d // GROUP), g, act), rand_exps((B, KVN, s, d // GROUP), g, act)
    q = randn((B, N, 1, d), g, dtype)
    kin, vin = fp4(to_layout(kc, layout)), fp4(to_layout(vc, layout))
    assert kin.dtype == FP4 and kin.shape[-1] == (KVN * d // 2 if layout == "BSH" else d // 2)
    check(q, kin, vin, dequant64(kc, ke), dequant64(vc, ve), act, layout=layout,
          **mode6(e8m0(ke[None]), e8m0(ve[None])))


@pytest.mark.case(q_s=1)
def test_dense_4d_scales_longer_s_and_v2_names():
    """(B, KV_N, S, D/32) scales with S > KV_S, through the _v2 names (dequant_scale_key / key_quant_mode)."""
    g = gen(611)
    d, s, act = 64, 33, [33, 7]
    kc, vc = rand_bytes((B, KVN, s, d // 2), g), rand_bytes((B, KVN, s, d // 2), g)
    ke, ve = rand_exps((B, KVN, s + 9, d // GROUP), g, act), rand_exps((B, KVN, s + 9, d // GROUP), g, act)
    q = randn((B, N, 1, d), g, BF16)
    check(q, fp4(kc), fp4(vc), dequant64(kc, ke), dequant64(vc, ve), act, api="v2",
          dequant_scale_key=e8m0(ke), dequant_scale_value=e8m0(ve), key_quant_mode=6, value_quant_mode=6)


@pytest.mark.case(q_s=1)
def test_nibble_order_and_groups():
    """One key (softmax weight 1): the output is the dequantized value row exactly. Every code 0..15 appears in
    both nibbles; each group of 32 channels has its own exponent."""
    d = 128
    codes = torch.tensor([(i * 7) % 16 for i in range(d)], dtype=torch.uint8)
    byts = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 1, 1, d // 2)
    exps = torch.tensor([127, 126, 129, 120], dtype=torch.uint8).reshape(1, 1, 1, 1, 4)
    want = torch.tensor([E2M1[c] for c in codes.tolist()], dtype=torch.float64) * \
        torch.tensor([1.0, 0.5, 4.0, 2.0 ** -7], dtype=torch.float64).repeat_interleave(GROUP)
    k = torch.zeros(1, 1, 1, d // 2, dtype=torch.uint8)
    q = torch.randn(1, 1, 1, d).half()
    out, _ = fia.npu_fused_infer_attention_score(q, fp4(k), fp4(byts), num_heads=1, input_layout="BNSD", scale=0.1,
                                                 **mode6(e8m0(exps), e8m0(exps)))
    assert torch.equal(out.reshape(-1).double(), want), (out.reshape(-1).tolist(), want.tolist())


@pytest.mark.case(q_s=1)
def test_nan_scale_propagates():
    """E8M0 0xFF (NaN) in a read value group: NaN in that group's channels of its KV head's query heads, nowhere
    else (SPEC 14: NaN propagates); in a read key group: the whole rows of that KV head."""
    g = gen(620)
    d, s, act = 64, 16, [16, 16]
    kc, vc = rand_bytes((B, KVN, s, d // 2), g), rand_bytes((B, KVN, s, d // 2), g)
    ke, ve = rand_exps((B, KVN, s, 2), g, act), rand_exps((B, KVN, s, 2), g, act)
    ve[1, 0, 5, 1] = 255
    q = randn((B, N, 1, d), g, F16)
    out, _ = fia.npu_fused_infer_attention_score(q, fp4(kc), fp4(vc), num_heads=N, num_key_value_heads=KVN,
                                                 input_layout="BNSD", **mode6(e8m0(ke), e8m0(ve)))
    nan = torch.isnan(out)
    want = torch.zeros_like(nan)
    want[1, :N // KVN, :, GROUP:] = True
    assert torch.equal(nan, want)
    ke[0, 1, 3, 0] = 255
    ve[1, 0, 5, 1] = 127
    out, _ = fia.npu_fused_infer_attention_score(q, fp4(kc), fp4(vc), num_heads=N, num_key_value_heads=KVN,
                                                 input_layout="BNSD", **mode6(e8m0(ke), e8m0(ve)))
    want = torch.zeros_like(nan)
    want[0, N // KVN:] = True
    assert torch.equal(torch.isnan(out), want)


# ---------------------------------------------------------------------------------------------- paged
@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("cache", ["3d", "4d"])
def test_paged_decode(cache):
    """A shuffled block table over a pool with spare blocks (-1 past each batch's blocks); scales by logical
    position (S >= max_blocks x block_size), NaN past each length."""
    g = gen(630 + (cache == "4d"))
    d, bs, act = 128, 64, [150, 64]
    need = [(n + bs - 1) // bs for n in act]
    mb, nb = max(need) + 1, sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((B, mb), -1, dtype=torch.int32)
    j = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[j:j + n], dtype=torch.int32)
        j += n
    pk, pv = rand_bytes((nb, KVN, bs, d // 2), g), rand_bytes((nb, KVN, bs, d // 2), g)
    ke, ve = rand_exps((B, KVN, mb * bs, d // GROUP), g, act), rand_exps((B, KVN, mb * bs, d // GROUP), g, act)

    def logical(pool):                               # [B, KV_N, max act, D/2] bytes at logical positions
        out = torch.zeros(B, KVN, max(act), d // 2, dtype=torch.uint8)
        for b, n in enumerate(act):
            for p in range(n):
                out[b, :, p] = pool[table[b, p // bs], :, p % bs]
        return out

    def as_cache(pool):
        return pool.permute(0, 2, 1, 3).reshape(nb, bs, KVN * d // 2).contiguous() if cache == "3d" else pool

    q = randn((B, N, 1, d), g, BF16)
    check(q, fp4(as_cache(pk)), fp4(as_cache(pv)), dequant64(logical(pk), ke), dequant64(logical(pv), ve), act,
          layout="BSH" if cache == "3d" else "BNSD", block_table=table, block_size=bs,
          **mode6(e8m0(ke[None]), e8m0(ve[None])))


@pytest.mark.backend_independent
@pytest.mark.parametrize("eo", [True, False], ids=["even-odd", "in-order"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_decode_on_the_float32_fma_kernels(paged, eo, monkeypatch):
    """CPUs off the bf16 dp kernels (no AVX512-BF16; Intel's) run FP4 K / V through the build with the generic paths:
    each chunk decoded to bf16 rows, then the float32 FMA kernel (decode.kernels.items._qk_loops / _pv_loops), bf16
    widened in even / odd halves or in order (DP_EO), forced here by clearing the dp bits: chunks of several 64-row
    blocks and a remainder, split KV, the prefetch requests on, dense and paged, against the oracle; fia.explain
    says so."""
    pytest.importorskip("numba")
    from fia.backends.decode import kernels as K, plan as DEC_PLAN
    flags = K.DP_FLAGS & ~(K.DP_QK | K.DP_PV | K.DP_AMX | K.DP_EO)
    monkeypatch.setattr(K, "DP_FLAGS", flags | (K.DP_EO if eo else 0))
    monkeypatch.setattr(DEC_PLAN, "PREFETCH_MIN_BYTES", -1)
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 128)     # (items of ~150 keys: sub-blocks 64, 64, 22)
    g = gen(650 + paged)
    d, act = 128, [300, 141]
    s = max(act)
    q = randn((B, N, 1, d), g, BF16)
    ke, ve = rand_exps((B, KVN, 512, d // GROUP), g, act), rand_exps((B, KVN, 512, d // GROUP), g, act)
    kc, vc = rand_bytes((B, KVN, s, d // 2), g), rand_bytes((B, KVN, s, d // 2), g)
    kw = dict(layout="BNSD")
    kin, vin = fp4(kc), fp4(vc)
    if paged:                                           # each batch's rows in its own blocks of 64, in order
        bs = 64
        mb = (s + bs - 1) // bs
        pool = lambda x: torch.nn.functional.pad(x, (0, 0, 0, mb * bs - s)).reshape(B, KVN, mb, bs, d // 2) \
            .permute(0, 2, 1, 3, 4).reshape(B * mb, KVN, bs, d // 2).contiguous()   # noqa: E731
        kin, vin = fp4(pool(kc)), fp4(pool(vc))
        kw.update(block_table=torch.arange(B * mb, dtype=torch.int32).reshape(B, mb), block_size=bs)
    with fia.use_backend("decode"):
        check(q, kin, vin, dequant64(kc, ke[:, :, :s]), dequant64(vc, ve[:, :, :s]), act,
              **mode6(e8m0(ke[None]), e8m0(ve[None])), **kw)
        text = str(fia.explain(q, kin, vin, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
                               actual_seq_lengths_kv=act, **{k: v for k, v in kw.items() if k != "layout"},
                               **mode6(e8m0(ke[None]), e8m0(ve[None]))))
    fma = "float32 FMA (bf16 in even / odd halves)" if eo else "float32 FMA"
    assert f"QK {fma}, PV {fma}, software prefetch" in text and "decoded to bf16 a chunk at a time" in text


# ---------------------------------------------------------------------------------------------- invalid calls
def _call(**over):
    """A valid dense mode-6 decode call (BNSD, D = 64), with `over` replacing arguments."""
    g = gen(640)
    d, s = 64, 8
    a = dict(query=torch.randn(B, N, 1, d).half(), key=fp4(rand_bytes((B, KVN, s, d // 2), g)),
             value=fp4(rand_bytes((B, KVN, s, d // 2), g)), num_heads=N, num_key_value_heads=KVN,
             input_layout="BNSD", **mode6(e8m0(rand_exps((1, B, KVN, s, 2), g, [s])),
                                          e8m0(rand_exps((1, B, KVN, s, 2), g, [s]))))
    a.update(over)
    return a


def _run(a):
    a = dict(a)
    return fia.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)


@pytest.mark.backend_independent
def test_valid_base_call():
    for mode in ("strict", "portable"):
        with fia.validation_mode(mode):
            out, _ = _run(_call())
            assert out.shape == (B, N, 1, 64) and torch.isfinite(out).all()


I8 = torch.ones(B, KVN, 8, 64, dtype=torch.int8)
_S5 = (1, B, KVN, 8, 2)
INVALID_CASES = [
    # F1: mode 6 with int8 K/V (E8M0 scales)
    ("F1-int8-kv", dict(key=I8, value=I8), "key"),
    # F2: offsets
    ("F2-key-offset", dict(key_antiquant_offset=torch.zeros(_S5, dtype=torch.uint8).view(E8M0),
                           value_antiquant_offset=torch.zeros(_S5, dtype=torch.uint8).view(E8M0)),
     "key_antiquant_offset"),
    # F3: scale dtype
    ("F3-fp16-scales", dict(key_antiquant_scale=torch.ones(_S5, dtype=F16),
                            value_antiquant_scale=torch.ones(_S5, dtype=F16)), "key_antiquant_scale"),
    ("F3-value-f32", dict(value_antiquant_scale=torch.ones(_S5)), "value_antiquant_scale"),
    # F4: FP4 with another mode; FP4 with the combined set; FP4 without scales
    ("F4-mode1", dict(key_antiquant_mode=1, value_antiquant_mode=1), "key_antiquant_mode"),
    ("F4-combined", dict(key_antiquant_scale=None, value_antiquant_scale=None, key_antiquant_mode=0,
                         value_antiquant_mode=0, antiquant_scale=torch.ones(2, dtype=F16)), "antiquant_scale"),
    # F5: key mode = value mode
    ("F5-v1", dict(value_antiquant_mode=1), "value_antiquant_mode"),
    ("F5-k0", dict(key_antiquant_mode=0), "key_antiquant_mode"),
    # F6: Q_S = 1 only
    ("F6-qs2", dict(query=torch.randn(B, N, 2, 64).half()), "key_antiquant_mode"),
    # F8: the combined antiquant_mode takes 0 and 1 only
    ("F8-combined-mode6", dict(key=I8, value=I8, key_antiquant_scale=None, value_antiquant_scale=None,
                               key_antiquant_mode=0, value_antiquant_mode=0, antiquant_mode=6,
                               antiquant_scale=torch.ones(2, dtype=F16)), "antiquant_mode"),
    ("F4-F8-fp4-combined-mode6", dict(key_antiquant_scale=None, value_antiquant_scale=None, key_antiquant_mode=0,
                                      value_antiquant_mode=0, antiquant_mode=6,
                                      antiquant_scale=torch.ones(2, dtype=F16)), "antiquant_scale"),
    # F9: K/V dtypes outside FLOAT16, BFLOAT16, INT8, INT4(INT32), FP4
    ("F9-float8", dict(key=torch.zeros(B, KVN, 8, 64).to(torch.float8_e4m3fn),
                       value=torch.zeros(B, KVN, 8, 64).to(torch.float8_e4m3fn)), "key"),
    ("F9-uint8", dict(key=torch.zeros(B, KVN, 8, 32, dtype=torch.uint8),
                      value=torch.zeros(B, KVN, 8, 32, dtype=torch.uint8)), "key"),
    # shapes
    ("scale-S-short", dict(key_antiquant_scale=torch.zeros(1, B, KVN, 7, 2, dtype=torch.uint8).view(E8M0)),
     "key_antiquant_scale"),
    ("scale-groups", dict(key_antiquant_scale=torch.zeros(1, B, KVN, 8, 4, dtype=torch.uint8).view(E8M0)),
     "key_antiquant_scale"),
    ("scale-batch", dict(key_antiquant_scale=torch.zeros(1, 1, KVN, 8, 2, dtype=torch.uint8).view(E8M0)),
     "key_antiquant_scale"),
    ("kv-head-dim", dict(key=fp4(torch.zeros(B, KVN, 8, 16, dtype=torch.uint8))), "key"),
    ("out-quant", dict(quant_scale2=torch.ones(1)), "quant_scale2"),
]


@pytest.mark.backend_independent
@pytest.mark.parametrize("over,arg", [c[1:] for c in INVALID_CASES], ids=[c[0] for c in INVALID_CASES])
def test_invalid(over, arg):
    """Each rule of SPEC 14b.6 (and the shapes of 10b.1): an input error (161002) naming the argument, what was
    expected and what was received, in strict and portable mode alike."""
    for mode in ("strict", "portable"):
        with fia.validation_mode(mode), pytest.raises(fia.FiaInputError) as ei:
            _run(_call(**over))
        assert ei.value.status == INVALID, str(ei.value)
        assert ei.value.argument == arg, str(ei.value)
        assert "expected" in str(ei.value).lower(), str(ei.value)


@pytest.mark.backend_independent
def test_paged_scale_shorter_than_table():
    """F7: paged scales need S >= block_table.shape[1] x block_size (here 2 x 64 = 128), even past act_kv."""
    g = gen(650)
    table = torch.tensor([[0, -1], [1, -1]], dtype=torch.int32)
    pool = fp4(rand_bytes((3, KVN, 64, 32), g))
    short = e8m0(torch.full((1, B, KVN, 127, 2), 127, dtype=torch.uint8))
    a = _call(key=pool, value=pool, block_table=table, block_size=64, actual_seq_lengths_kv=[10, 64],
              key_antiquant_scale=short, value_antiquant_scale=short)
    with pytest.raises(fia.FiaInputError) as ei:
        _run(a)
    assert ei.value.argument == "key_antiquant_scale" and "128" in str(ei.value), str(ei.value)
    ok = e8m0(torch.full((1, B, KVN, 128, 2), 127, dtype=torch.uint8))
    out, _ = _run(dict(a, key_antiquant_scale=ok, value_antiquant_scale=ok))
    assert torch.isfinite(out).all()


@pytest.mark.backend_independent
def test_hardware_alignment_strict_only():
    """[reading] D % 64 and block_size % 64 with FP4: hardware rules (strict rejects, portable runs)."""
    g = gen(660)
    a = _call(query=torch.randn(B, N, 1, 32).half(), key=fp4(rand_bytes((B, KVN, 8, 16), g)),
              value=fp4(rand_bytes((B, KVN, 8, 16), g)),
              **mode6(e8m0(torch.full((1, B, KVN, 8, 1), 127, dtype=torch.uint8)),
                      e8m0(torch.full((1, B, KVN, 8, 1), 127, dtype=torch.uint8))))
    with fia.validation_mode("strict"), pytest.raises(fia.FiaInputError) as ei:
        _run(a)
    assert ei.value.argument == "key"
    with fia.validation_mode("portable"):
        assert torch.isfinite(_run(a)[0]).all()
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    pool = fp4(rand_bytes((2, KVN, 32, 32), g))
    sc = e8m0(torch.full((1, B, KVN, 32, 2), 127, dtype=torch.uint8))
    p = _call(key=pool, value=pool, block_table=table, block_size=32, actual_seq_lengths_kv=[32, 5],
              **mode6(sc, sc))
    with fia.validation_mode("strict"), pytest.raises(fia.FiaInputError) as ei:
        _run(p)
    assert ei.value.argument == "block_size"
    with fia.validation_mode("portable"):
        assert torch.isfinite(_run(p)[0]).all()
