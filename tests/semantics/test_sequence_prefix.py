"""Shared prefix (SPEC 7): key_shared_prefix / value_shared_prefix / actual_shared_prefix_len.

Effective keys of every batch = prefix[:P] then the batch's own valid keys; mask and pse columns count the
prefix first (own key p is column P + p); sparse 3/4 use S2 = act_kv + P. Checked against the naive model
on the concatenated KV, and metamorphically against fia's dense path with the prefix concatenated into
every batch's KV. Prefix positions past P, KV past act_kv and query rows past act_q are NaN.
"""
import math

import numpy as np
import pytest
import torch

import fia
import naive
from util import (fused_kwargs, INT_MAX, assert_close, assert_lse, assert_zero_rows, batched_mask, expected_out_shape, gen,
                  out_to_canon, poison_rows, randmask, randn, seed_of, template_mask, to_layout)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT = {"fp16": F16, "bf16": BF16}


def prefix_case(*, seed, layout="BSH", b=3, n=4, kvn=2, sq=6, skv=12, ps=10, plen="none", d=32, dtype=F16,
                act_q=None, act_kv=None, mask=None, sparse_mode=0, pre=None, nxt=None, pse=None, inner_precise=0,
                lse=True, plen_form=list, dense_too=True, scale=None):
    """plen: "none" (argument not passed = the prefix S) or an int P (passed as plen_form([P]))."""
    g = gen(seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    p = ps if plen == "none" else plen
    q = randn((b, n, sq, d), g, dtype)
    k, v = randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)
    kp, vp = randn((1, kvn, ps, d), g, dtype), randn((1, kvn, ps, d), g, dtype)
    decode = sq == 1
    aq = [1] * b if decode else ([sq] * b if act_q is None else list(act_q))
    akv = [skv] * b if act_kv is None else list(act_kv)
    kp_in, vp_in = poison_rows(kp, [p]), poison_rows(vp, [p])       # prefix positions past P: NaN
    q_in, k_in, v_in = poison_rows(q, aq), poison_rows(k, akv), poison_rows(v, akv)
    base = layout.split("_")[0]
    kw = fused_kwargs(n, kvn, layout, scale, lse=lse, sparse_mode=sparse_mode, inner_precise=inner_precise,
                      act_q=act_q, decode=decode, mask=mask, pse=pse, pre=pre, nxt=nxt)
    if act_kv is not None:
        kw["actual_seq_lengths_kv"] = list(act_kv)
    pkw = dict(key_shared_prefix=to_layout(kp_in, base), value_shared_prefix=to_layout(vp_in, base))
    if plen != "none":
        pkw["actual_shared_prefix_len"] = plen_form([p])
    out, l = fia.npu_fused_infer_attention_score(to_layout(q_in, base), to_layout(k_in, base),
                                                 to_layout(v_in, base), **pkw, **kw)

    # naive on the concatenated KV: [prefix[:P] | own keys], window (0, P + act_kv)
    kc = torch.cat([kp[:, :, :p].expand(b, -1, -1, -1), k], dim=2)
    vc = torch.cat([vp[:, :, :p].expand(b, -1, -1, -1), v], dim=2)
    ns = sparse_mode
    mask_b = batched_mask(mask, b, decode) if mask is not None and (ns in (0, 1) or decode) else None
    if decode:
        ns = 1 if mask_b is not None else 0
    ref_o, ref_l = naive.attention(
        q.double(), kc.double(), vc.double(), scale=scale, q_windows=[(0, x) for x in aq],
        kv_windows=[(0, p + x) for x in akv], mask=mask_b, sparse_mode=ns,
        pre_tokens=INT_MAX if pre is None else pre, next_tokens=INT_MAX if nxt is None else nxt,
        pse=None if pse is None else pse.double().expand(b, -1, -1, -1), inner_precise=inner_precise)
    assert out.dtype == dtype
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, d)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_o, dtype)
    lc = None
    if lse:
        lc = l[..., 0]
        assert_lse(lc, ref_l)
    assert_zero_rows(oc, lc, torch.isposinf(ref_l))

    if dense_too:   # metamorphic: the prefix concatenated into every batch's KV, lengths P + act_kv
        kc_in = torch.cat([kp[:, :, :p].expand(b, -1, -1, -1), k_in], dim=2)
        vc_in = torch.cat([vp[:, :, :p].expand(b, -1, -1, -1), v_in], dim=2)
        kw2 = dict(kw)
        kw2["actual_seq_lengths_kv"] = [p + x for x in akv]
        o2, l2 = fia.npu_fused_infer_attention_score(to_layout(q_in, base), to_layout(kc_in, base),
                                                     to_layout(vc_in, base), **kw2)
        assert_close(oc, out_to_canon(o2, layout, n).double(), dtype, what="prefix vs concatenated")
        if lse:
            assert_lse(lc, l2[..., 0].double())
    return oc, lc, ref_o, ref_l


# --------------------------------------------------------------------------------------------- P = None / 0 / P
PLENS = ["none", 0, 4, 10]


# every prefix length in BSH / BNSD, decode and prefill; the other layouts with P < prefix S
LAYOUT_SQ_P = ([(l, s, p) for l in ("BSH", "BNSD") for s in (1, 6) for p in PLENS]
               + [("BSND", 1, 4), ("BSND", 6, 4), ("BSND_NBSD", 1, 4), ("BNSD_BSND", 6, 4)])


@pytest.mark.parametrize("layout,sq,plen", LAYOUT_SQ_P, ids=[f"{l}-qs{s}-P{p}" for l, s, p in LAYOUT_SQ_P])
def test_prefix_layouts_and_lengths(sq, layout, plen):
    """Prefix in every dense layout, decode and prefill; actual_shared_prefix_len None (= prefix S), 0
    (no prefix), 4 (< prefix S; positions past P are NaN) and = prefix S; per-batch KV lengths incl. 0."""
    prefix_case(seed=seed_of("pfx", sq, layout, plen), layout=layout, sq=sq, skv=12, ps=10, plen=plen,
                act_q=None if sq == 1 else [6, 2, 5], act_kv=[12, 0, 7], dtype=BF16 if sq == 1 else F16)


def test_prefix_zero_equals_no_prefix():
    """actual_shared_prefix_len = [0] is an empty prefix (SPEC 15.4): same result as no prefix at all."""
    g = gen(3)
    q, k, v = randn((2, 2, 5, 16), g, F16), randn((2, 2, 8, 16), g, F16), randn((2, 2, 8, 16), g, F16)
    kp = torch.full((1, 2, 6, 16), float("nan"), dtype=F16)
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25, softmax_lse_flag=True)
    o0, l0 = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    o1, l1 = fia.npu_fused_infer_attention_score(q, k, v, key_shared_prefix=kp, value_shared_prefix=kp.clone(),
                                                 actual_shared_prefix_len=[0], **kw)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)


@pytest.mark.parametrize("form", ["tuple", "np_int64", "torch_int32", "torch_int64"])
def test_prefix_len_forms(form):
    """actual_shared_prefix_len as tuple / NumPy array / int32 or int64 tensor (SPEC 1.1)."""
    conv = {"tuple": tuple, "np_int64": lambda x: np.array(x, dtype=np.int64),
            "torch_int32": lambda x: torch.tensor(x, dtype=torch.int32),
            "torch_int64": lambda x: torch.tensor(x, dtype=torch.int64)}[form]
    prefix_case(seed=seed_of("pform", form), layout="BNSD", sq=4, ps=9, plen=5, plen_form=conv)


def test_prefix_batch_without_own_keys():
    """act_kv = 0 with a prefix: the batch still attends to the prefix (SPEC 4: "no key at all" needs both)."""
    oc, lc, _, _ = prefix_case(seed=7, sq=5, act_kv=[0, 0, 12], ps=6, plen="none")
    assert (oc[0] != 0).any() and torch.isfinite(lc[0]).all()


@pytest.mark.parametrize("sq", [1, 4], ids=lambda x: f"qs{x}")
def test_prefix_with_empty_own_kv(sq):
    """key/value with KV_S = 0 plus a prefix: every batch attends to the prefix alone (effective keys =
    prefix[:P] + no own keys, SPEC 7); not the all-zero output of a call without any key."""
    g = gen(seed_of("pempty", sq))
    q = randn((2, 4, sq, 32), g, BF16)
    kp, vp = randn((1, 2, 7, 32), g, BF16), randn((1, 2, 7, 32), g, BF16)
    empty = torch.empty(2, 2, 0, 32, dtype=BF16)
    out, lse = fia.npu_fused_infer_attention_score(q, empty, empty, key_shared_prefix=kp, value_shared_prefix=vp,
                                                   num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                                   scale=0.2, softmax_lse_flag=True)
    ref, ref_l = naive.attention(q, kp.expand(2, -1, -1, -1), vp.expand(2, -1, -1, -1), scale=0.2)
    assert_close(out, ref, BF16)
    assert_lse(lse[..., 0], ref_l)


# --------------------------------------------------------------------------------------------- masks / pse
@pytest.mark.parametrize("sparse", [0, 1])
def test_prefix_mask_columns_prefix_first(sparse):
    """The mask's KV axis counts prefix columns first (P + KV_S columns, oversized here); GQA; lse."""
    b, sq, skv, ps, p = 2, 7, 11, 9, 6
    g = gen(seed_of("pmask", sparse))
    mask = randmask((b, 1, sq + 2, p + skv + 3), g, 0.35)
    kw = dict(pre=4, nxt=1) if sparse == 0 else {}
    prefix_case(seed=seed_of("pmask-d", sparse), b=b, n=8, kvn=2, sq=sq, skv=skv, ps=ps, plen=p,
                act_q=[7, 4], act_kv=[11, 5], mask=mask, sparse_mode=sparse, **kw)


@pytest.mark.case(q_s=1)
def test_prefix_decode_mask():
    """Decode with a prefix: mask (B, P + KV_S)."""
    b, skv, p = 3, 10, 8
    mask = randmask((b, p + skv), gen(9), 0.3)
    prefix_case(seed=10, b=b, sq=1, skv=skv, ps=p, mask=mask, act_kv=[10, 3, 0])


@pytest.mark.parametrize("ip", [0, 2], ids=lambda x: f"ip{x}")
def test_prefix_fully_masked_row(ip):
    """A row whose every key (prefix and own) is user-masked: mean of V (ip 0) or 0 / +inf (ip 2)."""
    b, sq, skv, p = 2, 4, 6, 5
    mask = torch.zeros(b, sq, p + skv, dtype=torch.bool)
    mask[1, 2, :] = True
    prefix_case(seed=11, b=b, sq=sq, skv=skv, ps=p, mask=mask, sparse_mode=1, inner_precise=ip)


@pytest.mark.parametrize("sq", [1, 6], ids=lambda x: f"qs{x}")
def test_prefix_pse_columns_prefix_first(sq):
    """pse_shift columns count the prefix first too (B, N, Q_S, P + KV_S)."""
    b, n, skv, p = 2, 4, 9, 7
    g = gen(seed_of("ppse", sq))
    pse = randn((b, n, sq, p + skv), g, F16, std=2.0)
    prefix_case(seed=seed_of("ppse-d", sq), b=b, n=n, sq=sq, skv=skv, ps=p, plen=p, pse=pse,
                act_q=None if sq == 1 else [6, 3], act_kv=[9, 4])


@pytest.mark.parametrize("sparse", [2, 3, 4])
def test_prefix_band_modes(sparse):
    """Sparse 3/4 use S2 = act_kv + P (the diagonal ends at the last own key); 2 is left-up."""
    kw = dict(pre=5, nxt=0) if sparse == 4 else {}
    prefix_case(seed=seed_of("pband", sparse), b=3, sq=8, skv=10, ps=6, plen=4, act_q=[8, 3, 5], act_kv=[10, 2, 0],
                mask=template_mask(), sparse_mode=sparse, **kw)


def test_prefix_sparse3_with_pse_gqa_lse_bf16():
    """prefix + sparse 3 + pse + GQA (G = 4) + lse (bf16)."""
    b, n, sq, skv, p = 2, 8, 6, 9, 5
    pse = randn((1, n, sq, p + skv), gen(13), BF16)
    prefix_case(seed=14, b=b, n=n, kvn=2, sq=sq, skv=skv, ps=p, dtype=BF16, act_q=[6, 4], act_kv=[3, 9],
                mask=template_mask((1, 1, 2048, 2048)), sparse_mode=3, pse=pse)


def test_prefix_portable_float32():
    with fia.validation_mode("portable"):
        prefix_case(seed=15, b=2, n=2, kvn=1, sq=5, skv=7, ps=4, d=20, dtype=F32, act_q=[5, 2], act_kv=[7, 1],
                    mask=template_mask(), sparse_mode=3)


@pytest.mark.parametrize("pre,nxt", [(-2, 6), (3, -1), (0, 0)])
def test_prefix_sparse0_band_counts_prefix_columns(pre, nxt):
    """Sparse 0 + mask + finite pre/next: the band is window-local over [prefix | own keys] (column P + p);
    rows the band leaves without keys are 0 / +inf."""
    b, sq, skv, p = 2, 6, 8, 5
    mask = randmask((sq, p + skv), gen(seed_of("pb0", pre, nxt)), 0.15)
    prefix_case(seed=seed_of("pb0-d", pre, nxt), b=b, sq=sq, skv=skv, ps=p, act_q=[6, 4], act_kv=[8, 3], mask=mask,
                pre=pre, nxt=nxt)
