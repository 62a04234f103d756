"""Paged KV (SPEC 8): block_table + block_size, both cache layouts, shuffled / shared / unused blocks,
per-batch lengths, masks / pse indexed over max_blocks x block_size, TND + paged, the other entry points.

Every case is checked twice: against the naive float64 formulation on the gathered (dense) KV, and
against fia's own dense path on the same gathered KV (metamorphic: paged == dense after gathering).
Unused pool blocks, slots past each sequence's length and query rows past act_q are NaN.
"""
import math

import pytest
import torch

import fia
import naive
from util import (fused_kwargs, INT_MAX, assert_close, assert_lse, assert_zero_rows, batched_mask, block_table, cumsum,
                  expected_out_shape, gather_paged, gen, out_to_canon, paged_pool, poison_rows, pool_as_cache,
                  randmask, randn, seed_of, template_mask, tnd_split, to_layout, to_tnd)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT = {"fp16": F16, "bf16": BF16, "fp32": F32}


def paged_case(*, seed, layout="BSH", fmt="3d", b=3, n=4, kvn=2, sq=1, d=32, dv=None, lens, act_q=None, bs=16,
               dtype=F16, spare=2, share=0, extra_cols=0, unused=-1, mask=None, sparse_mode=0, pre=None, nxt=None,
               pse=None, inner_precise=0, lse=True, dense_too=True, scale=None, table_dtype=torch.int32):
    """Build a paged call from random data, run it, compare with naive (float64) and with fia dense.

    Returns (out_canon, lse_canon, ref_out, ref_lse)."""
    dv = dv or d
    g = gen(seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = randn((b, n, sq, d), g, dtype)
    table, nb = block_table(lens, bs, g, spare=spare, share=share, extra_cols=extra_cols, unused=unused)
    kpool = paged_pool(table, lens, bs, nb, kvn, d, g, dtype)
    vpool = paged_pool(table, lens, bs, nb, kvn, dv, g, dtype)
    kd, vd = gather_paged(kpool, table, lens, bs), gather_paged(vpool, table, lens, bs)
    decode = sq == 1
    aq = [1] * b if decode else (list(act_q) if act_q is not None else [sq] * b)
    q_in = poison_rows(q, aq)
    base = layout.split("_")[0]
    kw = fused_kwargs(n, kvn, layout, scale, lse=lse, sparse_mode=sparse_mode, inner_precise=inner_precise,
                      actual_seq_lengths_kv=list(lens), act_q=act_q, decode=decode, mask=mask, pse=pse, pre=pre, nxt=nxt)
    out, l = fia.npu_fused_infer_attention_score(
        to_layout(q_in, base), pool_as_cache(kpool, fmt), pool_as_cache(vpool, fmt),
        block_table=table.to(table_dtype), block_size=bs, **kw)

    # naive float64 on the gathered KV (physical position p = column p of masks and pse)
    ns = sparse_mode
    mask_b = None
    if mask is not None and (ns in (0, 1) or decode):     # modes 2-4: the template carries no information
        mask_b = batched_mask(mask, b, decode)
    if decode:                                           # SPEC 5: Q_S = 1 without rope -> only a plain mask
        ns = 1 if mask_b is not None else 0
    ref_o, ref_l = naive.attention(
        q.double(), kd.double(), vd.double(), scale=scale, q_windows=[(0, x) for x in aq],
        kv_windows=[(0, x) for x in lens], mask=mask_b, sparse_mode=ns,
        pre_tokens=INT_MAX if pre is None else pre, next_tokens=INT_MAX if nxt is None else nxt,
        pse=None if pse is None else pse.double().expand(b, -1, -1, -1), inner_precise=inner_precise)
    assert out.dtype == dtype
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, dv), tuple(out.shape)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_o, dtype)
    lc = None
    if lse:
        assert tuple(l.shape) == (b, n, sq, 1) and l.dtype == torch.float32
        lc = l[..., 0]
        assert_lse(lc, ref_l)
    assert_zero_rows(oc, lc, torch.isposinf(ref_l))

    if dense_too:   # metamorphic: the same call on the gathered dense KV (NaN past the lengths)
        out2, l2 = fia.npu_fused_infer_attention_score(to_layout(q_in, base), to_layout(kd, base),
                                                       to_layout(vd, base), **kw)
        oc2 = out_to_canon(out2, layout, n)
        assert_close(oc, oc2.double(), dtype, what="paged vs dense")
        if lse:
            assert_lse(lc, l2[..., 0].double())
    return oc, lc, ref_o, ref_l


# --------------------------------------------------------------------------------------------- layouts
LAYOUT_FMT = [("BSH", "3d"), ("BSND", "3d"), ("BNSD", "3d"), ("BNSD", "4d"), ("BNSD_BSND", "4d"),
              ("BSH_NBSD", "3d"), ("BNSD_NBSD", "4d")]


DECODE_LAYOUT_FMT = [c for c in LAYOUT_FMT if c[0] != "BNSD_BSND"]     # BNSD_BSND is Q_S > 1 only


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,fmt", DECODE_LAYOUT_FMT, ids=[f"{l}-{f}" for l, f in DECODE_LAYOUT_FMT])
def test_paged_decode_layouts(layout, fmt, dt):
    """Decode (Q_S = 1), block_size 16, shuffled ids, spare NaN blocks, -1 past each sequence's last block,
    a zero-length batch, GQA (4 query heads on 2 KV heads), lse."""
    paged_case(seed=seed_of("pdec", layout, fmt, dt), layout=layout, fmt=fmt, sq=1, lens=[37, 5, 0, 64],
               b=4, bs=16, dtype=DT[dt])


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,fmt", LAYOUT_FMT, ids=[f"{l}-{f}" for l, f in LAYOUT_FMT])
def test_paged_prefill_layouts(layout, fmt, dt):
    """Q_S > 1 (block_size 128 in strict mode), per-batch query and KV lengths, lse."""
    sq = 6 if "NBSD" in layout else 9
    paged_case(seed=seed_of("ppre", layout, fmt, dt), layout=layout, fmt=fmt, sq=sq, lens=[300, 17, 129],
               act_q=[sq, 3, 1], bs=128, dtype=DT[dt])


@pytest.mark.case(q_s=1)
def test_paged_3d_and_4d_cache_agree():
    """The two cache layouts of the same pool give the same result (BNSD query)."""
    g = gen(5)
    b, n, kvn, d, bs = 2, 4, 2, 32, 16
    lens = [40, 19]
    q = randn((b, n, 1, d), g, F16)
    table, nb = block_table(lens, bs, g)
    kp, vp = paged_pool(table, lens, bs, nb, kvn, d, g), paged_pool(table, lens, bs, nb, kvn, d, g)
    outs = []
    for fmt in ("3d", "4d"):
        o, _ = fia.npu_fused_infer_attention_score(q, pool_as_cache(kp, fmt), pool_as_cache(vp, fmt),
                                                   num_heads=n, num_key_value_heads=kvn, input_layout="BNSD",
                                                   scale=0.2, block_table=table, block_size=bs,
                                                   actual_seq_lengths_kv=lens)
        outs.append(o)
    assert torch.isfinite(outs[0].float()).all()
    assert_close(outs[0], outs[1].double(), F16)


# --------------------------------------------------------------------------------------------- pool shapes
@pytest.mark.case(q_s=1)
def test_paged_shared_pool_smaller_than_b_times_kvs():
    """Blocks shared between sequences (prefix caching): 4 sequences of 40 tokens (3 blocks each) live in a
    pool of 2 shared + 4 own + 1 spare = 7 blocks < B x KV_S / block_size = 12."""
    table, nb = block_table([40, 40, 33, 40], 16, gen(0), share=2, spare=1)     # the test data's shape
    assert nb * 16 < 4 * 40 and torch.equal(table[:, :2], table[:1, :2].expand(4, -1))
    paged_case(seed=11, sq=1, b=4, lens=[40, 40, 33, 40], bs=16, share=2, spare=1)


@pytest.mark.parametrize("sq", [1, 5], ids=lambda x: f"qs{x}")
def test_paged_shared_pool_prefill(sq):
    paged_case(seed=seed_of("sharepre", sq), layout="BNSD", fmt="4d", sq=sq, b=3, lens=[200, 256, 130],
               bs=128, share=1, spare=1, dtype=BF16)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("garbage", ["minus1", "huge", "mixed"])
def test_paged_unused_entries_are_never_read(garbage):
    """Entries past a sequence's last block are unused: -1 or any garbage value (SPEC 8: only used ids are
    range-checked), plus extra table columns beyond the needed max_blocks."""
    unused = {"minus1": -1, "huge": 10 ** 6, "mixed": lambda b, c: [-1, 999, -(2 ** 31), 2 ** 31 - 1][(b + c) % 4]}
    paged_case(seed=seed_of("unused", garbage), sq=1, b=4, lens=[3, 17, 0, 33], bs=16, extra_cols=2,
               unused=unused[garbage])


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("form", ["tuple", "np_int32", "torch_int32", "torch_int64"])
def test_paged_kv_length_forms(form):
    """actual_seq_lengths_kv as tuple / NumPy array / int32 or int64 tensor with paged KV (SPEC 1.1)."""
    import numpy as np
    conv = {"tuple": tuple, "np_int32": lambda x: np.array(x, dtype=np.int32),
            "torch_int32": lambda x: torch.tensor(x, dtype=torch.int32),
            "torch_int64": lambda x: torch.tensor(x, dtype=torch.int64)}[form]
    b, n, kvn, d, bs = 3, 4, 1, 32, 16
    lens = [17, 0, 40]
    g = gen(seed_of("pform", form))
    q = randn((b, n, 1, d), g, F16)
    table, nb = block_table(lens, bs, g)
    kp, vp = paged_pool(table, lens, bs, nb, kvn, d, g), paged_pool(table, lens, bs, nb, kvn, d, g)
    out, lse = fia.npu_fused_infer_attention_score(
        to_layout(q, "BSND"), pool_as_cache(kp, "3d"), pool_as_cache(vp, "3d"), num_heads=n, num_key_value_heads=kvn,
        input_layout="BSND", scale=0.2, block_table=table, block_size=bs, actual_seq_lengths_kv=conv(lens),
        softmax_lse_flag=True)
    ref, ref_l = naive.attention(q, gather_paged(kp, table, lens, bs), gather_paged(vp, table, lens, bs), scale=0.2,
                                 kv_windows=[(0, l) for l in lens])
    assert_close(out_to_canon(out, "BSND", n), ref, F16)
    assert_lse(lse[..., 0], ref_l)


@pytest.mark.case(q_s=1)
def test_paged_all_batches_empty():
    """Every act_kv = 0: no block is used (the whole table may be -1); output 0, lse +inf."""
    oc, lc, _, _ = paged_case(seed=21, sq=1, b=2, lens=[0, 0], bs=16, dense_too=True)
    assert (oc == 0).all() and torch.isposinf(lc).all()


@pytest.mark.case(q_s=1)
def test_paged_exact_block_multiple_and_single_token():
    """Lengths exactly at block boundaries and single-token sequences."""
    paged_case(seed=23, sq=1, b=4, lens=[16, 32, 1, 48], bs=16, extra_cols=0, spare=0)


@pytest.mark.case(q_s=1)
def test_paged_int64_table_portable():
    """Portable mode accepts an int64 block table (int32 only in strict mode)."""
    with fia.validation_mode("portable"):
        paged_case(seed=25, sq=1, b=2, lens=[20, 7], bs=16, table_dtype=torch.int64)


@pytest.mark.parametrize("bs", [1, 3, 7, 24, 600], ids=lambda x: f"bs{x}")
@pytest.mark.parametrize("sq", [1, 4], ids=lambda x: f"qs{x}")
def test_paged_portable_any_block_size(bs, sq):
    """Portable mode: any positive block_size (even > 512), float32, tolerance 1e-5 (SPEC 1.4, 8)."""
    with fia.validation_mode("portable"):
        paged_case(seed=seed_of("pbs", bs, sq), layout="BNSD", fmt="4d" if bs % 2 else "3d", sq=sq, b=3,
                   lens=[25, 9, 0] if bs < 600 else [601, 9, 0], act_q=None if sq == 1 else [4, 2, 0], bs=bs,
                   dtype=F32, d=20)


# --------------------------------------------------------------------------------------------- masks / pse
@pytest.mark.parametrize("sparse", [0, 1])
@pytest.mark.parametrize("ip", [0, 2], ids=lambda x: f"ip{x}")
def test_paged_gqa_mask_lse(sparse, ip):
    """paged + GQA (G = 4) + a user mask covering max_blocks x block_size columns (+ padding; the mask's
    column p is physical position p) + lse + row-invalid correction; a fully masked row in batch 0."""
    b, sq, bs = 2, 7, 128
    lens = [200, 90]
    mb = 2
    g = gen(seed_of("pmask", sparse, ip))
    mask = randmask((b, 1, sq + 3, mb * bs + 5), g, 0.4)
    mask[0, 0, 2, :] = True        # fully user-masked row
    kw = dict(pre=3, nxt=1) if sparse == 0 else {}
    paged_case(seed=seed_of("pmask-data", sparse, ip), layout="BSND", sq=sq, b=b, n=8, kvn=2, lens=lens,
               act_q=[7, 5], bs=bs, mask=mask, sparse_mode=sparse, inner_precise=ip, **kw)


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_paged_pse_and_mask_prefill(dt):
    """pse_shift (B, N, Q_S, >= max_blocks x block_size) indexed like the mask; unused pse region NaN."""
    b, n, sq, bs = 2, 4, 5, 128
    lens = [140, 30]
    kv_cols = 2 * bs
    g = gen(seed_of("ppse", dt))
    pse = randn((b, n, sq, kv_cols + 4), g, DT[dt], std=2.0)
    for i, l in enumerate(lens):
        pse[i, :, :, l:] = float("nan")
    mask = randmask((sq, kv_cols), g, 0.25)
    paged_case(seed=seed_of("ppse-d", dt), layout="BNSD", fmt="4d", sq=sq, b=b, n=n, lens=lens, bs=bs,
               dtype=DT[dt], pse=pse, mask=mask, sparse_mode=1)


@pytest.mark.case(q_s=1)
def test_paged_decode_mask_and_pse():
    """Decode: mask (B, max_blocks x block_size) and pse (B, N, 1, max_blocks x block_size)."""
    b, n, bs = 3, 4, 16
    lens = [33, 2, 48]
    g = gen(31)
    mask = randmask((b, 3 * bs), g, 0.3)
    pse = randn((b, n, 1, 3 * bs), g, F16)
    paged_case(seed=32, layout="BSH", sq=1, b=b, n=n, lens=lens, bs=bs, mask=mask, pse=pse)


@pytest.mark.parametrize("sparse", [2, 3, 4])
def test_paged_sparse_modes(sparse):
    """Band modes with the template on a paged cache: the geometry uses each batch's act_q / act_kv."""
    kw = dict(pre=20, nxt=2) if sparse == 4 else {}
    paged_case(seed=seed_of("psparse", sparse), layout="BSH", sq=8, b=3, lens=[130, 8, 3], act_q=[8, 5, 6],
               bs=128, mask=template_mask(), sparse_mode=sparse, **kw)


# --------------------------------------------------------------------------------------------- TND + paged
TND_CASES = [
    # layout, fmt, qlens, kvlens, sparse, bs
    ("TND", "3d", [1, 1, 1], [33, 1, 16], 0, 16),
    ("TND", "4d", [1, 1], [70, 0], 0, 32),
    ("TND", "4d", [3, 5, 1], [130, 5, 256], 3, 128),
    ("TND", "3d", [4, 0, 2], [4, 9, 200], 0, 128),
    ("TND_NTD", "3d", [2, 6], [140, 6], 3, 128),
    ("TND", "4d", [6, 2], [150, 40], 4, 128),
]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout,fmt,qlens,kvlens,sparse,bs", TND_CASES,
                         ids=[f"{c[0]}-{c[1]}-sm{c[4]}-{i}" for i, c in enumerate(TND_CASES)])
def test_paged_tnd(layout, fmt, qlens, kvlens, sparse, bs, dt):
    """TND + paged: actual_seq_lengths cumulative (the query), actual_seq_lengths_kv per-batch lengths
    (SPEC 2); sparse 3 with act_q <= act_kv, sparse 4 sliding window (SPEC 15.11)."""
    dtype = DT[dt]
    n, kvn, d = 4, 2, 128
    g = gen(seed_of("ptnd", layout, fmt, tuple(qlens), dt))
    qs = [randn((n, l, d), g, dtype) for l in qlens]
    table, nb = block_table(kvlens, bs, g)
    kp, vp = paged_pool(table, kvlens, bs, nb, kvn, d, g, dtype), paged_pool(table, kvlens, bs, nb, kvn, d, g, dtype)
    kd, vd = gather_paged(kp, table, kvlens, bs), gather_paged(vp, table, kvlens, bs)
    kw = dict(sparse_mode=sparse)
    if sparse in (3, 4):
        kw["atten_mask"] = template_mask()
    if sparse == 4:
        kw.update(pre_tokens=30, next_tokens=0)
    scale = 1 / math.sqrt(d)
    # strict mode: paged TND block_size 128 / 512 / 1024 (SPEC 14b.4 T14), TND_NTD only with D = 512 (T11); the
    # other cases are hardware-only violations, run in portable mode
    strict = bs in (128, 512, 1024) and layout != "TND_NTD"
    with fia.validation_mode("strict" if strict else "portable"):
        out, lse = fia.npu_fused_infer_attention_score(
            to_tnd(qs), pool_as_cache(kp, fmt), pool_as_cache(vp, fmt), num_heads=n, num_key_value_heads=kvn,
            input_layout=layout, scale=scale, actual_seq_lengths=cumsum(qlens), actual_seq_lengths_kv=kvlens,
            block_table=table, block_size=bs, softmax_lse_flag=True, **kw)
    ref_o, ref_l = naive.attention(qs, [kd[i] for i in range(len(qlens))], [vd[i] for i in range(len(qlens))],
                                   scale=scale, kv_windows=[(0, l) for l in kvlens],
                                   sparse_mode=sparse if len(set(qlens)) > 1 or qlens[0] > 1 else 0,
                                   pre_tokens=kw.get("pre_tokens", INT_MAX), next_tokens=kw.get("next_tokens", INT_MAX),
                                   stack=False)
    t = sum(qlens)
    assert out.dtype == dtype
    if layout == "TND_NTD":
        assert tuple(out.shape) == (n, t, d)
        outs = tnd_split(out.permute(1, 0, 2), qlens)
    else:
        assert tuple(out.shape) == (t, n, d)
        outs = tnd_split(out, qlens)
    assert tuple(lse.shape) == (t, n, 1)
    lses = [x[..., 0] for x in tnd_split(lse, qlens)]
    o, r = torch.cat(outs, 1), torch.cat(ref_o, 1)
    assert_close(o, r, dtype)
    lc, rl = torch.cat(lses, 1), torch.cat(ref_l, 1)
    assert_lse(lc, rl)
    assert_zero_rows(o, lc, torch.isposinf(rl))


# --------------------------------------------------------------------------------------------- other APIs
@pytest.mark.case(q_s=1)
def test_paged_incre_flash_attention():
    """npu_incre_flash_attention with block_table: its actual_seq_lengths are the KV lengths."""
    b, n, kvn, d, bs = 3, 8, 1, 64, 32
    lens = [65, 1, 31]
    g = gen(41)
    q = randn((b, n, 1, d), g, BF16)
    table, nb = block_table(lens, bs, g)
    kp, vp = paged_pool(table, lens, bs, nb, kvn, d, g, BF16), paged_pool(table, lens, bs, nb, kvn, d, g, BF16)
    out = fia.npu_incre_flash_attention(to_layout(q, "BSH"), pool_as_cache(kp, "3d"), pool_as_cache(vp, "3d"),
                                        num_heads=n, num_key_value_heads=kvn, input_layout="BSH", scale_value=0.125,
                                        block_table=table, block_size=bs, actual_seq_lengths=lens)
    ref, _ = naive.attention(q, gather_paged(kp, table, lens, bs), gather_paged(vp, table, lens, bs), scale=0.125,
                             kv_windows=[(0, l) for l in lens])
    assert_close(out_to_canon(out, "BSH", n), ref, BF16)


@pytest.mark.case(q_s=1)
def test_paged_v2_entry_point():
    """npu_fused_infer_attention_score_v2 takes block_table / block_size / actual_seq_kvlen too."""
    b, n, kvn, d, bs = 2, 4, 2, 32, 16
    lens = [21, 40]
    g = gen(43)
    q = randn((b, n, 1, d), g, F16)
    table, nb = block_table(lens, bs, g)
    kp, vp = paged_pool(table, lens, bs, nb, kvn, d, g), paged_pool(table, lens, bs, nb, kvn, d, g)
    out, lse = fia.npu_fused_infer_attention_score_v2(
        q, pool_as_cache(kp, "4d"), pool_as_cache(vp, "4d"), num_query_heads=n, num_key_value_heads=kvn,
        input_layout="BNSD", softmax_scale=0.2, block_table=table, block_size=bs, actual_seq_kvlen=lens,
        return_softmax_lse=True)
    ref, ref_l = naive.attention(q, gather_paged(kp, table, lens, bs), gather_paged(vp, table, lens, bs), scale=0.2,
                                 kv_windows=[(0, l) for l in lens])
    assert_close(out, ref, F16)
    assert_lse(lse[..., 0], ref_l)


def test_block_size_without_block_table_is_ignored():
    """SPEC 15.11: block_size given without block_table is ignored (dense KV)."""
    g = gen(45)
    q, k, v = randn((2, 2, 3, 16), g, F16), randn((2, 2, 9, 16), g, F16), randn((2, 2, 9, 16), g, F16)
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=0.25,
                                                 block_size=128)
    ref, _ = naive.attention(q, k, v, scale=0.25)
    assert_close(out, ref, F16)


# --------------------------------------------------------------------------------------------- int8 + paged
@pytest.mark.case(q_s=1)
def test_paged_int8_antiquant_decode_block32():
    """int8 K/V (per-tensor antiquant) on a paged cache with block_size 32 (the int8 decode alignment)."""
    b, n, kvn, d, bs = 2, 4, 2, 32, 32
    lens = [50, 7]
    g = gen(47)
    q = randn((b, n, 1, d), g, F16)
    table, nb = block_table(lens, bs, g)
    kp = torch.randint(-100, 100, (nb, kvn, bs, d), generator=g, dtype=torch.int8)
    vp = torch.randint(-100, 100, (nb, kvn, bs, d), generator=g, dtype=torch.int8)
    scale_kv = torch.tensor([0.02, 0.03], dtype=F16)
    out, lse = fia.npu_fused_infer_attention_score(
        q, pool_as_cache(kp, "4d"), pool_as_cache(vp, "4d"), num_heads=n, num_key_value_heads=kvn,
        input_layout="BNSD", scale=0.2, block_table=table, block_size=bs, actual_seq_lengths_kv=lens,
        antiquant_scale=scale_kv, softmax_lse_flag=True)
    kd = gather_paged(kp, table, lens, bs).double() * float(scale_kv[0])
    vd = gather_paged(vp, table, lens, bs).double() * float(scale_kv[1])
    ref, ref_l = naive.attention(q, kd, vd, scale=0.2, kv_windows=[(0, l) for l in lens])
    assert_close(out, ref, F16)
    assert_lse(lse[..., 0], ref_l)


@pytest.mark.case(q_s=1)
def test_paged_int8_per_token_scales_over_max_blocks():
    """Per-token antiquant scales (antiquant_mode 1: (2, B, KV_S), float32) with paged KV are indexed by the
    sequence position p and must cover max_blocks x block_size positions (SPEC 8, 10.3); entries past each
    length are NaN and must not leak."""
    b, n, kvn, d, bs = 2, 4, 1, 32, 32
    lens = [40, 64]
    g = gen(49)
    q = randn((b, n, 1, d), g, BF16)
    table, nb = block_table(lens, bs, g)
    kp = torch.randint(-100, 100, (nb, kvn, bs, d), generator=g, dtype=torch.int8)
    vp = torch.randint(-100, 100, (nb, kvn, bs, d), generator=g, dtype=torch.int8)
    mb = table.shape[1]
    sc = (torch.rand(2, b, mb * bs, generator=g) * 0.03 + 0.005)
    sc_in = sc.clone()
    for i, l in enumerate(lens):
        sc_in[:, i, l:] = float("nan")
    out = fia.npu_fused_infer_attention_score(
        to_layout(q, "BSH"), pool_as_cache(kp, "3d"), pool_as_cache(vp, "3d"), num_heads=n, num_key_value_heads=kvn,
        input_layout="BSH", scale=0.2, block_table=table, block_size=bs, actual_seq_lengths_kv=lens,
        antiquant_scale=sc_in, antiquant_mode=1)[0]
    kd = gather_paged(kp, table, lens, bs).double() * sc[0, :, None, :, None].double()
    vd = gather_paged(vp, table, lens, bs).double() * sc[1, :, None, :, None].double()
    ref, _ = naive.attention(q, kd, vd, scale=0.2, kv_windows=[(0, l) for l in lens])
    assert_close(out_to_canon(out, "BSH", n), ref, BF16)


@pytest.mark.case(q_s=1)
def test_paged_non_contiguous_views_and_inputs_untouched():
    """Real clients pass views: a 4-D cache that is a transpose of a (blocknum, block_size, KV_N, D) buffer,
    key and value as the two halves of one stacked KV buffer, and a block table sliced out of a larger
    one (rows and columns). Results match the naive model; no input is modified."""
    b, n, kvn, d, bs = 2, 4, 2, 32, 16
    lens = [37, 12]
    g = gen(51)
    q = randn((b, n, 1, d), g, F16)
    table, nb = block_table(lens, bs, g)
    kp, vp = paged_pool(table, lens, bs, nb, kvn, d, g), paged_pool(table, lens, bs, nb, kvn, d, g)
    kv = torch.stack([kp.permute(0, 2, 1, 3), vp.permute(0, 2, 1, 3)])      # [2, NB, bs, KV_N, D] contiguous
    kc, vc = kv[0].transpose(1, 2), kv[1].transpose(1, 2)                   # (NB, KV_N, bs, D) views
    assert not kc.is_contiguous()
    big = torch.full((b + 3, table.shape[1] + 5), 12345, dtype=torch.int32)
    big[1:1 + b, 2:2 + table.shape[1]] = table
    bt = big[1:1 + b, 2:2 + table.shape[1]]
    assert not bt.is_contiguous()
    before = [x.clone() for x in (q, kv, big)]
    out, lse = fia.npu_fused_infer_attention_score(q, kc, vc, num_heads=n, num_key_value_heads=kvn,
                                                   input_layout="BNSD", scale=0.2, block_table=bt, block_size=bs,
                                                   actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    ref, ref_l = naive.attention(q, gather_paged(kp, table, lens, bs), gather_paged(vp, table, lens, bs), scale=0.2,
                                 kv_windows=[(0, l) for l in lens])
    assert_close(out, ref, F16)
    assert_lse(lse[..., 0], ref_l)
    for x, y in zip(before, (q, kv, big)):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
