"""Lengths and padding (SPEC 4), empty inputs, tensor-list KV (SPEC 8)."""
import math

import numpy as np
import pytest
import torch

import fia
import naive
from util import (assert_close, assert_lse, check_dense, gen, out_to_canon,
                  randn, seed_of, to_layout)

F16, BF16 = torch.float16, torch.bfloat16

FORMS = {
    "list": list,
    "tuple": tuple,
    "np_int32": lambda x: np.array(x, dtype=np.int32),
    "np_int64": lambda x: np.array(x, dtype=np.int64),
    "torch_int32": lambda x: torch.tensor(x, dtype=torch.int32),
    "torch_int64": lambda x: torch.tensor(x, dtype=torch.int64),
}


def qkv(seed, b, n, kvn, sq, skv, d, dtype):
    g = gen(seed)
    return randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("sq", [1, 11], ids=lambda x: f"qs{x}")
def test_length_forms(form, sq):
    """actual_seq_lengths(_kv) as list, tuple, NumPy int array, int32/int64 tensor (SPEC 1.1); rows past the
    lengths are NaN-poisoned and must not leak; rows past act_q give exactly 0 and lse +inf (SPEC 4)."""
    b, n, kvn, skv, d = 3, 4, 2, 26, 32
    q, k, v = qkv(seed_of(form, sq), b, n, kvn, sq, skv, d, F16)
    aq, akv = [11, 4, 7], [26, 9, 1]
    conv = FORMS[form]
    len_kw = {"actual_seq_lengths_kv": conv(akv)}
    if sq > 1:
        len_kw["actual_seq_lengths"] = conv(aq)
    check_dense(q, k, v, layout="BSH", act_q=aq if sq > 1 else None, act_kv=akv, len_kw=len_kw)


@pytest.mark.parametrize("sq", [1, 9], ids=lambda x: f"qs{x}")
def test_length_one_list_applies_to_all(sq):
    b, n, skv, d = 3, 2, 20, 16
    q, k, v = qkv(seed_of("one", sq), b, n, n, sq, skv, d, BF16)
    len_kw = {"actual_seq_lengths_kv": [13]}
    aq = None
    if sq > 1:
        len_kw["actual_seq_lengths"] = [6]
        aq = [6] * b
    check_dense(q, k, v, layout="BSND", act_q=aq, act_kv=[13] * b, len_kw=len_kw)


@pytest.mark.parametrize("sq", [1, 9], ids=lambda x: f"qs{x}")
def test_length_longer_list_uses_first_b(sq):
    b, n, skv, d = 2, 2, 20, 16
    q, k, v = qkv(seed_of("long", sq), b, n, n, sq, skv, d, F16)
    len_kw = {"actual_seq_lengths_kv": [5, 20, 3, 1, 0]}
    aq = None
    if sq > 1:
        len_kw["actual_seq_lengths"] = (9, 2, 0, 0)
        aq = [9, 2]
    check_dense(q, k, v, layout="BNSD", act_q=aq, act_kv=[5, 20], len_kw=len_kw)


@pytest.mark.parametrize("sq", [1, 8], ids=lambda x: f"qs{x}")
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_zero_lengths(dt, sq):
    """Batches with act_q = 0 or act_kv = 0 give output 0 and lse +inf (SPEC 4)."""
    b, n, skv, d = 3, 4, 15, 32
    dtype = {"fp16": F16, "bf16": BF16}[dt]
    q, k, v = qkv(seed_of("zero", dt, sq), b, n, 2, sq, skv, d, dtype)
    aq = [8, 0, 5] if sq > 1 else None
    akv = [0, 15, 6] if sq > 1 else [0, 15, 0]
    out, lse, _, ref_lse = check_dense(q, k, v, layout="BSH", act_q=aq, act_kv=akv)
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()


def test_poisoned_everything_past_lengths_bnsd_gqa():
    """Larger GQA case with poison in both q and kv padding, mixed lengths (SPEC 4)."""
    b, n, kvn, sq, skv, d = 3, 8, 2, 17, 40, 64
    q, k, v = qkv(99, b, n, kvn, sq, skv, d, BF16)
    check_dense(q, k, v, layout="BNSD", act_q=[17, 1, 9], act_kv=[3, 40, 22])


# ----------------------------------------------------------------------------------------------- empty
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("which", ["B0", "QS0"])
def test_empty_query(which, layout):
    """An empty query returns an empty output of the right shape (SPEC 4)."""
    b, sq = (0, 5) if which == "B0" else (2, 0)
    n, skv, d = 2, 7, 16
    g = gen(seed_of("empty", which, layout))
    q = randn((b, n, sq, d), g, F16)
    k, v = randn((b, n, skv, d), g, F16), randn((b, n, skv, d), g, F16)
    out, lse = fia.npu_fused_infer_attention_score(to_layout(q, layout), to_layout(k, layout),
                                                   to_layout(v, layout), num_heads=n, input_layout=layout,
                                                   scale=0.25)
    assert out.dtype == F16
    assert tuple(out.shape) == tuple(to_layout(q, layout).shape)


def test_empty_query_with_lse():
    q = torch.empty(2, 4, 0, 16, dtype=F16)
    g = gen(3)
    k, v = randn((2, 4, 5, 16), g, F16), randn((2, 4, 5, 16), g, F16)
    out, lse = fia.npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD",
                                                   softmax_lse_flag=True)
    assert tuple(out.shape) == (2, 4, 0, 16)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 0, 1)


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sq", [1, 6], ids=lambda x: f"qs{x}")
def test_empty_kv(sq, layout):
    """KV_S = 0: all-zero output (SPEC 4); lse +inf (no key at all)."""
    b, n, d = 2, 4, 32
    g = gen(seed_of("emptykv", sq, layout))
    q = randn((b, n, sq, d), g, F16)
    k = torch.empty(b, n, 0, d, dtype=F16)
    v = torch.empty(b, n, 0, d, dtype=F16)
    out, lse = fia.npu_fused_infer_attention_score(to_layout(q, layout), to_layout(k, layout),
                                                   to_layout(v, layout), num_heads=n, input_layout=layout,
                                                   scale=0.2, softmax_lse_flag=True)
    assert out.dtype == F16 and tuple(out.shape) == tuple(to_layout(q, layout).shape)
    assert (out == 0).all()
    assert tuple(lse.shape) == (b, n, sq, 1) and torch.isposinf(lse).all()


# ----------------------------------------------------------------------------------------------- tensor list
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("sq", [1, 5], ids=lambda x: f"qs{x}")
def test_tensor_list_kv(sq, layout):
    """key/value as Python lists of B tensors with batch 1 and individual KV_S (SPEC 1.1, 8)."""
    b, n, kvn, d = 3, 4, 2, 32
    lens = [7, 19, 2]
    g = gen(seed_of("tlist", sq, layout))
    q = randn((b, n, sq, d), g, BF16)
    ks = [randn((1, kvn, s, d), g, BF16) for s in lens]
    vs = [randn((1, kvn, s, d), g, BF16) for s in lens]
    scale = 1 / math.sqrt(d)
    out, lse = fia.npu_fused_infer_attention_score(
        to_layout(q, layout), [to_layout(x, layout) for x in ks], [to_layout(x, layout) for x in vs],
        num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale, softmax_lse_flag=True)
    ref_o, ref_l = naive.attention(q, [x[0] for x in ks], [x[0] for x in vs], scale=scale)
    oc = out_to_canon(out, layout, n)
    assert out.dtype == BF16
    assert_close(oc, ref_o, BF16)
    assert_lse(lse[..., 0], ref_l)


@pytest.mark.case(q_s=1)
def test_tensor_list_kv_with_kv_lengths():
    """Tensor list combined with actual_seq_lengths_kv shorter than each tensor (padding NaN-poisoned)."""
    b, n, d, sq = 2, 2, 16, 1
    lens, act = [9, 14], [4, 14]
    g = gen(555)
    q = randn((b, n, sq, d), g, F16)
    ks = [randn((n, s, d), g, F16) for s in lens]
    vs = [randn((n, s, d), g, F16) for s in lens]
    kp = [x.clone() for x in ks]
    vp = [x.clone() for x in vs]
    for i, a in enumerate(act):
        kp[i][:, a:] = float("nan")
        vp[i][:, a:] = float("nan")
    out, lse = fia.npu_fused_infer_attention_score(
        q, [x.unsqueeze(0) for x in kp], [x.unsqueeze(0) for x in vp], num_heads=n, input_layout="BNSD",
        scale=0.25, actual_seq_lengths_kv=act, softmax_lse_flag=True)
    ref_o, ref_l = naive.attention(q, ks, vs, scale=0.25, kv_windows=[(0, a) for a in act])
    assert_close(out, ref_o, F16)
    assert_lse(lse[..., 0], ref_l)
