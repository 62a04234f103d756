"""Tensor-list KV (SPEC 1.1, 8): key / value as lists of B tensors with batch 1 and individual KV_S.

Metamorphic: the list call equals the dense call on the same keys padded to the longest S (padding NaN)
with actual_seq_lengths_kv = the individual lengths; both are checked against the naive model. Masks and
pse then index the KV axis over the longest S.
"""
import math

import pytest
import torch

import fia
import naive
from util import (fused_kwargs, INT_MAX, assert_close, assert_lse, assert_zero_rows, batched_mask, gen, out_to_canon,
                  poison_rows, randmask, randn, seed_of, template_mask, to_layout)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def list_case(*, seed, layout="BSH", n=4, kvn=2, sq=1, d=32, dtype=F16, lens, act_kv=None, act_q=None, mask=None,
              sparse_mode=0, pse=None, pre=None, nxt=None, inner_precise=0, extra=None):
    b = len(lens)
    g = gen(seed)
    scale = 1 / math.sqrt(d)
    s_max = max(lens)
    q = randn((b, n, sq, d), g, dtype)
    ks = [randn((kvn, s, d), g, dtype) for s in lens]
    vs = [randn((kvn, s, d), g, dtype) for s in lens]
    decode = sq == 1
    akv = list(lens) if act_kv is None else list(act_kv)
    aq = [1] * b if decode else ([sq] * b if act_q is None else list(act_q))
    # poison each element past its act_kv, and dense padding past it too
    ks_in = [poison_rows(k[None], [a])[0] for k, a in zip(ks, akv)]
    vs_in = [poison_rows(v[None], [a])[0] for v, a in zip(vs, akv)]
    kd = torch.full((b, kvn, s_max, d), float("nan"), dtype=dtype)
    vd = torch.full((b, kvn, s_max, d), float("nan"), dtype=dtype)
    for i in range(b):
        kd[i, :, :lens[i]] = ks_in[i]
        vd[i, :, :lens[i]] = vs_in[i]
    base = layout.split("_")[0]
    q_in = to_layout(poison_rows(q, aq), base)
    kw = fused_kwargs(n, kvn, layout, scale, sparse_mode=sparse_mode, inner_precise=inner_precise,
                      act_q=act_q, decode=decode, mask=mask, pse=pse, pre=pre, nxt=nxt)
    kw_list = dict(kw, **(extra or {}))       # extra keywords go to the list call only
    if act_kv is not None:
        kw_list["actual_seq_lengths_kv"] = list(act_kv)
    out, lse = fia.npu_fused_infer_attention_score(q_in, [to_layout(k[None], base) for k in ks_in],
                                                   [to_layout(v[None], base) for v in vs_in], **kw_list)
    kw_dense = dict(kw, actual_seq_lengths_kv=akv)
    out_d, lse_d = fia.npu_fused_infer_attention_score(q_in, to_layout(kd, base), to_layout(vd, base), **kw_dense)

    ns = sparse_mode
    mask_b = None
    if mask is not None and (ns in (0, 1) or decode):
        mask_b = batched_mask(mask, b, decode)
    if decode:
        ns = 1 if mask_b is not None else 0
    ref_o, ref_l = naive.attention(q.double(), [k.double() for k in ks], [v.double() for v in vs], scale=scale,
                                   q_windows=[(0, a) for a in aq], kv_windows=[(0, a) for a in akv], mask=mask_b,
                                   sparse_mode=ns, pre_tokens=INT_MAX if pre is None else pre,
                                   next_tokens=INT_MAX if nxt is None else nxt,
                                   pse=None if pse is None else pse.double().expand(b, -1, -1, -1),
                                   inner_precise=inner_precise)
    oc, oc_d = out_to_canon(out, layout, n), out_to_canon(out_d, layout, n)
    assert out.dtype == dtype and out.shape == out_d.shape
    assert_close(oc, ref_o, dtype)
    assert_close(oc, oc_d.double(), dtype, what="list vs dense")
    assert_lse(lse[..., 0], ref_l)
    assert_lse(lse[..., 0], lse_d[..., 0].double())
    assert_zero_rows(oc, lse[..., 0], torch.isposinf(ref_l))
    return oc, lse[..., 0]


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BSND_NBSD"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_list_equals_dense_decode(dt, layout):
    list_case(seed=seed_of("ldec", layout, dt), layout=layout, dtype={"fp16": F16, "bf16": BF16}[dt],
              lens=[7, 30, 1, 16])


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BNSD_BSND"])
def test_list_equals_dense_prefill(layout):
    list_case(seed=seed_of("lpre", layout), layout=layout, sq=6, lens=[9, 3, 20], act_q=[6, 2, 5])


@pytest.mark.case(q_s=1)
def test_list_with_shorter_kv_lengths_and_mask():
    """actual_seq_lengths_kv below each element's S (NaN past it) + a mask over the longest S."""
    lens, act = [12, 25, 6], [5, 25, 0]
    mask = randmask((3, 1, 1, 25), gen(3), 0.3)
    list_case(seed=4, lens=lens, act_kv=act, mask=mask)


@pytest.mark.parametrize("sparse", [1, 3])
def test_list_prefill_mask_pse_sparse(sparse):
    """Prefill list KV with pse and a mask (sparse 1) or the template (sparse 3: S2 = each batch's length)."""
    lens, sq, n = [14, 5, 9], 5, 4
    g = gen(seed_of("lmask", sparse))
    mask = randmask((3, sq, 14), g, 0.3) if sparse == 1 else template_mask()
    pse = randn((3, n, sq, 14), g, F16)
    list_case(seed=seed_of("lmask-d", sparse), sq=sq, n=n, lens=lens, act_q=[5, 5, 3], mask=mask, sparse_mode=sparse,
              pse=pse)


@pytest.mark.case(q_s=1)
def test_list_kv_padding_falls_back_to_right_padding():
    """The documents: 'kv left padding does not support tensorlist; otherwise kv right padding is used' --
    a kv_padding_size with a tensor list leaves the right-padded result unchanged."""
    lens, act = [10, 6], [4, 6]
    pad = torch.tensor([3], dtype=torch.int64)
    list_case(seed=6, lens=lens, act_kv=act, extra=dict(kv_padding_size=pad))


def test_list_portable_float32():
    with fia.validation_mode("portable"):
        list_case(seed=8, sq=3, d=20, dtype=F32, lens=[4, 11], act_q=[3, 1], mask=template_mask(), sparse_mode=3)
