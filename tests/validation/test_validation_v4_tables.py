"""The V4 strict tables (SPEC 14b.1-14b.6, src/fia/parse/v4_rules.py).

Every rule: one invalid call strict mode rejects (FiaInputError, status 161002, the message naming the argument,
the expectation and what was received) and the nearest valid call accepted; hardware-only rules are lifted by
portable mode, the semantic ones (NZ geometry, mode 6 / FP4) are not. Rules whose feature parse does not accept
yet (5-D NZ caches SPEC 8b, FP4 K/V SPEC 10b.1) are checked on the tables' own input (`V4Call` + raw arguments).
What SPEC 15.11 keeps for real clients stays accepted (lse with MLA, sparse 0 + per-request mask at Q_S > 1,
paged TND sparse 4, act_q == act_kv; and 14b.7's act_kv == 0).
"""
import math

import pytest
import torch

import fia
from fia.parse.context import Ctx
from fia.parse.v4_rules import E8M0, FP4, V4Call, check_call
from util import cumsum

pytestmark = pytest.mark.backend_independent

BF16, F16, F32, I8, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32
INVALID = 161002
_G = torch.Generator().manual_seed(1414)


def r(*shape, dtype=BF16):
    """Small random values (never zeros / ones)."""
    return (torch.randn(*shape, generator=_G) * 0.5).to(dtype)


def i8(*shape):
    return torch.randint(-8, 8, shape, generator=_G, dtype=torch.int8)


def tmpl():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def run(qkv, kw, mode="strict"):
    q, k, v = qkv
    with fia.validation_mode(mode):
        out, _ = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert torch.isfinite(out.float()).all()
    return out


def rejects(names, qkv, kw, *, portable="accepts"):
    """Strict mode raises FiaInputError 161002 about one of `names`; portable mode then accepts the call
    ("accepts"), rejects it too ("rejects": a semantic rule) or is not tried (None)."""
    names = (names,) if isinstance(names, str) else names
    with fia.validation_mode("strict"), pytest.raises(fia.FiaInputError) as ei:
        fia.npu_fused_infer_attention_score(*qkv, **kw)
    e = ei.value
    assert e.status == INVALID, str(e)
    assert e.argument in names, f"{e.argument!r} not in {names}: {e}"
    assert ": expected " in str(e) and ", got " in str(e), str(e)
    if portable == "accepts":
        run(qkv, kw, "portable")
    elif portable == "rejects":
        with fia.validation_mode("portable"), pytest.raises(fia.FiaInputError) as ep:
            fia.npu_fused_infer_attention_score(*qkv, **kw)
        assert ep.value.argument in names, str(ep.value)
    return e


# ------------------------------------------------------------------------------------------------ bases
def mla(*, s=1, n=2, kvn=1, skv=8, b=1, dt=BF16, layout="BSND", d=512, **kw):
    """Absorbed MLA (query D = 512 + rope 64), dense latent cache as key and value."""
    bn = layout.startswith("BNSD")
    qshape, kshape = ((b, n, s), (b, kvn, skv)) if bn else ((b, s, n), (b, skv, kvn))
    k = r(*kshape, d, dtype=dt)
    a = dict(query_rope=r(*qshape, 64, dtype=dt), key_rope=r(*kshape, 64, dtype=dt), num_heads=n,
             num_key_value_heads=kvn, input_layout=layout, scale=1 / math.sqrt(d + 64))
    if s > 1:
        a.update(sparse_mode=3, atten_mask=tmpl())
    a.update(kw)
    return (r(*qshape, d, dtype=dt), k, k), a


def tnd(*, d=128, dv=None, n=2, kvn=2, qlens=(2, 3), kvlens=(4, 5), layout="TND", rope=False, dt=BF16, **kw):
    """Dense TND-family call with cumulative lengths."""
    dv = dv or d
    tq, tk = sum(qlens), sum(kvlens)

    def lay(h, t, x):
        return (h, t, x) if layout.startswith("NTD") else (t, h, x)
    a = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.08,
             actual_seq_lengths=cumsum(qlens), actual_seq_lengths_kv=cumsum(kvlens))
    if rope:
        a.update(query_rope=r(*lay(n, tq, 64), dtype=dt), key_rope=r(*lay(kvn, tk, 64), dtype=dt))
    a.update(kw)
    return (r(*lay(n, tq, d), dtype=dt), r(*lay(kvn, tk, d), dtype=dt), r(*lay(kvn, tk, dv), dtype=dt)), a


def tnd_paged(*, d=128, dv=None, n=2, kvn=2, qlens=(1, 1), kvlens=(20, 9), bs=128, rope=False, layout="TND",
              dt=BF16, latent=False, **kw):
    """TND-family query on a paged 3-D cache (blocknum, block_size, KV_N * D); per-batch KV lengths."""
    dv = dv or d
    blocks = [max(1, -(-n_ // bs)) for n_ in kvlens]
    nb, mb = sum(blocks), max(blocks)
    ids = torch.randperm(nb, generator=_G).to(I32)
    table = torch.full((len(kvlens), mb), -1, dtype=I32)
    at = 0
    for i, c in enumerate(blocks):
        table[i, :c] = ids[at:at + c]
        at += c
    tq = sum(qlens)
    q = r(n, tq, d, dtype=dt) if layout.startswith("NTD") else r(tq, n, d, dtype=dt)
    k = r(nb, bs, kvn * d, dtype=dt)
    v = k if latent else r(nb, bs, kvn * dv, dtype=dt)
    a = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.05, block_table=table,
             block_size=bs, actual_seq_lengths=cumsum(qlens), actual_seq_lengths_kv=list(kvlens))
    if rope:
        a.update(query_rope=r(n, tq, 64, dtype=dt) if layout.startswith("NTD") else r(tq, n, 64, dtype=dt),
                 key_rope=r(nb, bs, kvn * 64, dtype=dt))
    if max(qlens) > 1:
        a.update(sparse_mode=3, atten_mask=tmpl())
    a.update(kw)
    return (q, k, v), a


def with_(base, **kw):
    qkv, a = base
    a = dict(a)
    a.update(kw)
    return qkv, a


# ------------------------------------------------------------------------------------------------ 14b.1 MLA D = 512
def test_mla_d512_base_valid_with_lse():
    """The nearest valid call (dense D = 512 stays accepted, SPEC 14b.1 M7 [reading]); lse [15.11]."""
    qkv, a = mla()
    out, lse = fia.npu_fused_infer_attention_score(*qkv, softmax_lse_flag=True, **a)
    assert out.shape == (1, 1, 2, 512) and lse.shape == (1, 2, 1, 1)


def test_mla_m1_q_s_17_rejected_16_accepted():
    rejects("query", *mla(s=17))
    run(*mla(s=16))


def test_mla_m1_heads():
    rejects("num_heads", *mla(n=3))
    run(*mla(n=4))


def test_mla_m2_one_kv_head():
    rejects("num_key_value_heads", *mla(n=4, kvn=2))
    run(*mla(n=4, kvn=1))


def test_mla_m2_m9_no_kv_dequantization():
    (q, _, _), a = mla()
    k = i8(1, 8, 1, 512)
    a.update(key_rope=r(1, 8, 1, 64, dtype=BF16), antiquant_scale=(torch.rand(2, generator=_G) * 0.1 + 0.01)
             .to(BF16))
    rejects("key", (q, k, k), a, portable=None)


def test_mla_m3_m9_no_output_quantization():
    rejects("quant_scale2", *with_(mla(), quant_scale2=torch.tensor([0.7])))


def test_mla_m5_layouts():
    rejects("input_layout", *mla(s=4, layout="BNSD_BSND"))
    run(*mla(s=4, layout="BNSD"))
    run(*mla(s=4, layout="BNSD_NBSD"))


def test_mla_m6_sparse_modes():
    # Q_S = 1: sparse 0 without mask or sparse 4 with the template
    rejects("sparse_mode", *with_(mla(b=2), atten_mask=torch.rand(2, 1, 1, 8, generator=_G) > 0.7))
    rejects("sparse_mode", *with_(mla(), sparse_mode=3, atten_mask=tmpl()))
    run(*with_(mla(), sparse_mode=4, atten_mask=tmpl(), pre_tokens=5, next_tokens=0))
    # Q_S > 1: sparse 3 / 4 with the template; sparse 0 without a mask is not in the table
    rejects("sparse_mode", *with_(mla(s=3), sparse_mode=0, atten_mask=None))
    rejects("sparse_mode", *with_(mla(s=3), sparse_mode=2))
    run(*with_(mla(s=3), sparse_mode=4, pre_tokens=8, next_tokens=0))
    # [15.11] Q_S > 1 with a per-request mask under sparse 0 stays accepted
    run(*with_(mla(s=3, b=2), sparse_mode=0, atten_mask=torch.rand(2, 1, 3, 8, generator=_G) > 0.7))


def test_mla_m9_no_pse_left_padding():
    rejects("pse_shift", *with_(mla(), pse_shift=r(1, 2, 1, 8)), portable=None)
    rejects(("kv_padding_size", "query_padding_size"),
            *with_(mla(), kv_padding_size=torch.tensor([1]), actual_seq_lengths_kv=[5]), portable=None)


def test_mla_m9_tensor_list_and_prefix_already_rejected():
    """M9's tensor list and prefix: parse rejects rope with either (semantic, both modes)."""
    (q, k, _), a = mla(b=2)
    ks = [r(1, 8, 1, 512), r(1, 5, 1, 512)]
    rejects("key_rope", (q, ks, ks), dict(a, key_rope=r(2, 8, 1, 64)), portable="rejects")
    rejects("key_shared_prefix", (q, k, k), dict(a, key_shared_prefix=r(1, 3, 1, 512),
                                                  value_shared_prefix=r(1, 3, 1, 512)), portable="rejects")


# ------------------------------------------------------------------------------------------------ NZ (dormant today)
def ctx(strict=True):
    return Ctx("npu_fused_infer_attention_score", strict)


def nz_mla(**kw):
    """An MLA D = 512 call on NZ caches (SPEC 8b.2 b), as the tables see it."""
    f = dict(layout="BSND", query_dtype=BF16, kv_dtype=BF16, n=16, kv_n=1, d=512, dv=512, q_s=1, decode=True,
             rope=True, rope_d=64, query_rope_dtype=BF16, key_rope_dtype=BF16, key_shape=(4, 1, 32, 128, 16),
             value_shape=(4, 1, 32, 128, 16), key_rope_shape=(4, 1, 4, 128, 16), paged=True, block_size=128,
             table_cols=2)
    f.update(kw)
    return V4Call(**f)


def nz_fq(**kw):
    """MLA full quantization on NZ caches (SPEC 10b.3)."""
    f = dict(query_dtype=I8, kv_dtype=I8, key_shape=(4, 1, 16, 128, 32), value_shape=(4, 1, 16, 128, 32),
             query_dequant=True, kv_quant="int8")
    f.update(kw)
    return nz_mla(**f)


def nz_gqa(**kw):
    """GQA dequantization on int8 NZ caches (SPEC 8b.2 a)."""
    f = dict(layout="BSND", query_dtype=BF16, kv_dtype=I8, n=64, kv_n=8, d=128, dv=128, q_s=1, decode=True,
             key_shape=(4, 8, 4, 128, 32), value_shape=(4, 8, 4, 128, 32), paged=True, block_size=128,
             table_cols=2, inner_precise=1, kv_quant="int8")
    f.update(kw)
    return V4Call(**f)


def table_rejects(name, c, a=None, *, hw=True):
    with pytest.raises(fia.FiaInputError) as ei:
        check_call(ctx(), dict(a or {}), c)
    assert ei.value.status == INVALID and ei.value.argument == name, str(ei.value)
    if hw:
        check_call(ctx(strict=False), dict(a or {}), c)      # portable: lifted
    else:
        with pytest.raises(fia.FiaInputError):
            check_call(ctx(strict=False), dict(a or {}), c)


def test_nz_mla_m5_m7_m10():
    check_call(ctx(), {}, nz_mla())
    table_rejects("input_layout", nz_mla(layout="BNSD"))                      # M5 (1496)
    table_rejects("block_table", nz_mla(paged=False, block_size=0))           # M7 (1537)
    table_rejects("block_size", nz_mla(block_size=64, key_shape=(4, 1, 32, 64, 16),
                                       value_shape=(4, 1, 32, 64, 16), key_rope_shape=(4, 1, 4, 64, 16)))
    table_rejects("key", nz_mla(key_shape=(4, 1, 16, 128, 32)), hw=False)     # M10 (1477): D0 16 for bf16
    table_rejects("key_rope", nz_mla(key_rope_shape=(4, 1, 2, 128, 32)), hw=False)


FQ_A = dict(dequant_scale_query=torch.rand(1, 1, 16, generator=_G) + 0.1, query_quant_mode=3)


def test_nz_mla_full_quant_q1_q8():
    check_call(ctx(), FQ_A, nz_fq())
    table_rejects("dequant_scale_query", nz_fq(), dict(FQ_A, dequant_scale_query=FQ_A["dequant_scale_query"].half()))
    table_rejects("value", nz_fq(value_shape=(4, 128, 512)), FQ_A)                                    # Q2
    table_rejects("query_rope", nz_fq(query_rope_dtype=F16), FQ_A)                                    # Q4 / Q3
    table_rejects("key_rope", nz_fq(key_rope_shape=(4, 128, 64)), FQ_A)                               # Q4: 5-D only
    table_rejects("block_size", nz_fq(block_size=256, key_shape=(4, 1, 16, 256, 32), value_shape=(4, 1, 16, 256, 32),
                                      key_rope_shape=(4, 1, 4, 256, 16)), FQ_A)                  # Q5
    table_rejects("quant_scale2", nz_fq(), dict(FQ_A, quant_scale2=torch.tensor([1.0])))        # Q6
    table_rejects("pse_shift", nz_fq(), dict(FQ_A, pse_shift=r(1, 16, 1, 256)))                 # Q6
    table_rejects("key_antiquant_offset", nz_fq(), dict(FQ_A, key_antiquant_offset=torch.tensor([1.0])))
    check_call(ctx(), FQ_A, nz_fq(layout="TND", n=32))                                             # Q8 open: TND kept


def test_mla_full_quant_nd_form_kept_and_q7():
    """SPEC 10b.3 open: the ND-cache form (int8 query + dequant_scale_query, bf16 latent) stays accepted; Q7:
    an int8 query at Q_S = 1 without dequant_scale_query is all-int8 decode (an input error)."""
    (q, k, _), a = mla(n=2)
    qi = i8(*q.shape)
    a.update(dequant_scale_query=torch.rand(1, 2, 1, generator=_G) * 0.02 + 0.001, query_quant_mode=3)
    out = run((qi, k, k), a)
    assert out.dtype == BF16
    qkv = (i8(1, 2, 1, 64), i8(1, 2, 8, 64), i8(1, 2, 8, 64))
    rejects("query", qkv, dict(num_heads=2, input_layout="BNSD", scale=0.1, dequant_scale1=torch.tensor([0.01]),
                               quant_scale1=torch.tensor([100.0]), dequant_scale2=torch.tensor([0.01])),
            portable="rejects")


def test_nz_gqa_g1_g10():
    check_call(ctx(), {}, nz_gqa())
    check_call(ctx(), dict(sparse_mode=3, atten_mask=tmpl()), nz_gqa(q_s=4, decode=False, sparse_mode=3))
    table_rejects("query", nz_gqa(query_dtype=F16))                                          # G1
    table_rejects("query", nz_gqa(q_s=17, decode=False), dict(sparse_mode=3, atten_mask=tmpl()))
    table_rejects("value", nz_gqa(value_shape=(4, 128, 1024)))                                # G2
    table_rejects("input_layout", nz_gqa(layout="BNSD_BSND"))                                 # G3
    table_rejects("num_heads", nz_gqa(n=32))                                                  # G4
    table_rejects("inner_precise", nz_gqa(inner_precise=0))                                   # G5
    table_rejects("sparse_mode", nz_gqa(q_s=4, decode=False))                                 # G6
    table_rejects("antiquant_scale", nz_gqa(), dict(antiquant_scale=torch.tensor([0.1, 0.1])))  # G7
    table_rejects("value_antiquant_offset", nz_gqa(), dict(value_antiquant_offset=torch.tensor([1.0])))
    table_rejects("query_rope", nz_gqa(rope=True, rope_d=64))
    table_rejects("key_antiquant_mode", nz_gqa(), dict(key_antiquant_mode=3, value_antiquant_mode=3))  # G8
    table_rejects("block_size", nz_gqa(block_size=256, key_shape=(4, 8, 4, 256, 32),
                                       value_shape=(4, 8, 4, 256, 32)))                       # G9
    table_rejects("pse_shift", nz_gqa(), dict(pse_shift=r(1, 64, 1, 256)))                    # G10
    table_rejects("key", nz_gqa(key_shape=(4, 8, 8, 128, 16)), hw=False)                      # 8b.1 geometry


# ------------------------------------------------------------------------------------------------ 14b.3 MLA D = 128
def test_mla_d128():
    run(*tnd(rope=True))
    run(*tnd(rope=True, layout="NTD_TND"))
    (q, k, v), a = tnd(rope=True)
    b4 = lambda x: x.reshape(1, *x.shape)                                      # noqa: E731
    rejects("input_layout", (b4(q[:2]), b4(k[:4]), b4(v[:4])),
            dict(num_heads=2, input_layout="BSND", scale=0.1, query_rope=b4(a["query_rope"][:2]),
                 key_rope=b4(a["key_rope"][:4])))
    rejects("value", *tnd(rope=True, dv=64))
    rejects("block_table", *tnd_paged(rope=True), portable=None)
    rejects("quant_scale2", *with_(tnd(rope=True), quant_scale2=torch.tensor([0.5])))


# ------------------------------------------------------------------------------------------------ 14b.4 TND
def test_tnd_t2_sparse4_only_paged():
    rejects("sparse_mode", *tnd(kvlens=(4, 6), sparse_mode=4, atten_mask=tmpl(), pre_tokens=3, next_tokens=0))
    run(*tnd(kvlens=(4, 6), sparse_mode=3, atten_mask=tmpl()))
    run(*tnd_paged(qlens=(2, 3), kvlens=(20, 9), sparse_mode=4, pre_tokens=4, next_tokens=0))   # [15.11]


def tnd512(**kw):
    f = dict(d=512, n=32, kvn=1, rope=True, latent=True, qlens=(1, 1), kvlens=(20, 9))
    f.update(kw)
    return tnd_paged(**f)


def test_tnd_d512_valid():
    run(*tnd512())
    run(*tnd512(qlens=(3, 0, 2), kvlens=(20, 9, 0)))            # zero-length and graph-padded requests
    run(*tnd512(layout="TND_NTD", qlens=(2, 4)))
    out, lse = fia.npu_fused_infer_attention_score(*tnd512()[0], softmax_lse_flag=True, **tnd512()[1])   # [15.11]
    assert lse.shape == (2, 32, 1)


def test_tnd_t4_t5_t6_t7_t8():
    rejects("input_layout", *tnd512(layout="NTD_TND"))                                             # T4 / M5
    rejects("input_layout", *tnd512(layout="NTD_TND", rope=False))                                 # T4
    rejects("actual_seq_lengths", *tnd512(rope=False, qlens=(17, 1), kvlens=(20, 9)))              # T5
    run(*tnd512(rope=False, qlens=(16, 1), kvlens=(20, 9)))
    rejects("num_heads", *tnd512(n=16))                                                            # T6
    rejects("num_key_value_heads", *tnd512(rope=False, kvn=2, latent=False))                       # T7
    (q, _, _), a = tnd512()
    k = r(29, 1, 512)
    rejects("block_table", (q, k, k), dict(num_heads=32, num_key_value_heads=1, input_layout="TND", scale=0.05,
                                           query_rope=a["query_rope"], key_rope=r(29, 1, 64),
                                           actual_seq_lengths=[1, 2], actual_seq_lengths_kv=[20, 29]))   # T8


def test_tnd_t10_no_quantization():
    rejects("quant_scale2", *with_(tnd512(), quant_scale2=torch.tensor([0.5])))
    (q, k, _), a = tnd512(rope=False)
    ki = i8(*k.shape)
    rejects("key", (q, ki, ki), dict(a, key_antiquant_scale=torch.rand(1, generator=_G).to(BF16) + 0.01,
                                     value_antiquant_scale=torch.rand(1, generator=_G).to(BF16) + 0.01),
            portable=None)


def test_tnd_t11_layouts():
    rejects("input_layout", *tnd(layout="TND_NTD"))
    run(*tnd(layout="NTD_TND"))


def test_tnd_t12_fp16():
    rejects("query", *tnd(dt=F16))
    run(*tnd_paged(dt=F16))                  # fp16 with paged KV (T12 note: dlinfer)
    run(*tnd(dt=F16, rope=True))             # fp16 with rope


def test_tnd_t13_sparse3_lengths():
    rejects("actual_seq_lengths", *tnd(qlens=(3, 2), kvlens=(2, 5), sparse_mode=3, atten_mask=tmpl()))
    run(*tnd(qlens=(3, 2), kvlens=(3, 5), sparse_mode=3, atten_mask=tmpl()))              # == [15.11]
    run(*tnd(qlens=(3, 2), kvlens=(0, 5), sparse_mode=3, atten_mask=tmpl()))              # act_kv 0 (14b.7)


def test_tnd_t14_block_size():
    rejects("block_size", *tnd_paged(bs=256))
    rejects("block_size", *tnd_paged(bs=16))
    out = run(*tnd_paged(bs=1024, kvlens=(1030, 9), qlens=(2, 1)))
    assert out.shape == (3, 2, 128)
    run(*tnd_paged(bs=512))
    rejects("block_size", *tnd_paged(bs=2048), portable=None)


def test_tnd_t15_t16_head_dims():
    rejects("query", *tnd(d=64, rope=True))                                  # T15
    rejects("query", *tnd(d=64))                                             # T16
    rejects("value", *tnd(d=128, dv=192))
    run(*tnd(d=192, dv=192))
    run(*tnd(d=192, dv=128))
    rejects("value", *tnd(d=192, dv=192, layout="NTD_TND"))
    run(*tnd(d=192, dv=128, layout="NTD_TND"))
    rejects("value", *tnd(d=192, dv=192, n=4, kvn=2))                        # GQA: no V_D 192
    rejects("value", *tnd_paged(d=192, dv=192))                              # paged: no V_D 192
    run(*tnd_paged(d=192, dv=128))


def test_tnd_t17_no_quantization():
    rejects("quant_scale2", *with_(tnd(), quant_scale2=torch.tensor([0.5])))
    (q, k, v), a = tnd()
    rejects("key", (q, i8(*k.shape), i8(*v.shape)),
            dict(a, antiquant_scale=(torch.rand(2, generator=_G) + 0.01).to(BF16)), portable=None)


# ------------------------------------------------------------------------------------------------ 14b.6 mode 6 / FP4
def dec_int8(**kw):
    qkv = (r(2, 2, 1, 64), i8(2, 2, 9, 64), i8(2, 2, 9, 64))
    a = dict(num_heads=2, input_layout="BNSD", scale=0.1, key_antiquant_scale=r(1, 2, 1, 64) * 0.1,
             value_antiquant_scale=r(1, 2, 1, 64) * 0.1)
    a.update(kw)
    return qkv, a


def e8m0(*shape):
    return torch.randint(120, 130, shape, generator=_G, dtype=torch.uint8).view(E8M0)


def test_mode6_rules_on_real_calls():
    run(*dec_int8())                                                                         # mode 0: valid
    rejects("value_antiquant_mode", *dec_int8(key_antiquant_mode=6), portable="rejects")     # F5
    (q, k, v), a = dec_int8(key_antiquant_mode=6, value_antiquant_mode=6)
    rejects("key_antiquant_mode", (r(2, 2, 4, 64), k, v), a, portable="rejects")            # F6
    rejects("key_antiquant_offset", *dec_int8(key_antiquant_mode=6, value_antiquant_mode=6,
                                              key_antiquant_offset=r(1, 2, 1, 64),
                                              value_antiquant_offset=r(1, 2, 1, 64)), portable="rejects")   # F2
    rejects("key_antiquant_scale", (q, k, v), a, portable="rejects")                         # F3
    rejects("key", *dec_int8(key_antiquant_mode=6, value_antiquant_mode=6, key_antiquant_scale=e8m0(1, 2, 2, 9, 2),
                             value_antiquant_scale=e8m0(1, 2, 2, 9, 2)), portable="rejects")  # F1
    rejects("antiquant_mode", (q, k, v), dict(num_heads=2, input_layout="BNSD", scale=0.1, antiquant_mode=6,
                                              antiquant_scale=r(2) * 0.1), portable="rejects")   # F8
    rejects("key", (q, k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)),
            dict(num_heads=2, input_layout="BNSD", scale=0.1), portable="rejects")           # F9


@pytest.mark.skipif(FP4 is None, reason="torch without float4_e2m1fn_x2")
def test_fp4_rules_on_the_table():
    """F4 / F7 need FP4 K/V, which parse does not accept yet: checked on the table's input."""
    c = V4Call(layout="BNSD", query_dtype=BF16, kv_dtype=FP4, n=2, kv_n=2, d=64, dv=64, q_s=1, decode=True,
               key_shape=(2, 2, 9, 32), value_shape=(2, 2, 9, 32))
    ok = dict(key_antiquant_mode=6, value_antiquant_mode=6, key_antiquant_scale=e8m0(1, 2, 2, 9, 2),
              value_antiquant_scale=e8m0(1, 2, 2, 9, 2))
    for strict in (True, False):
        check_call(ctx(strict), ok, c)
        with pytest.raises(fia.FiaInputError) as ei:
            check_call(ctx(strict), dict(ok, key_antiquant_mode=0, value_antiquant_mode=0), c)   # F4
        assert ei.value.argument == "key_antiquant_mode"
        with pytest.raises(fia.FiaInputError) as ei:
            check_call(ctx(strict), dict(ok, antiquant_scale=r(2)), c)
        assert ei.value.argument == "antiquant_scale"
    paged = V4Call(**{**c.__dict__, "paged": True, "block_size": 128, "table_cols": 2,
                      "key_shape": (4, 128, 64), "value_shape": (4, 128, 64)})
    check_call(ctx(), dict(ok, key_antiquant_scale=e8m0(1, 2, 2, 256, 2), value_antiquant_scale=e8m0(1, 2, 2, 256, 2)),
               paged)
    with pytest.raises(fia.FiaInputError) as ei:                                                # F7
        check_call(ctx(), ok, paged)
    assert ei.value.argument == "key_antiquant_scale" and "256" in str(ei.value)
