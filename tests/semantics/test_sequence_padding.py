"""Left padding (SPEC 4, 5): query_padding_size / kv_padding_size.

Valid window = [S - pad - act, S - pad); a negative pad counts as 0; a window starting below 0 zeroes that
batch's output (lse +inf); padding is active only together with the matching actual lengths; sparse 0 with
left padding ignores pre/next; masks are physical in modes 0/1 and window-local in 2-4; pse is physical.
Everything outside the valid windows is NaN-poisoned.
"""
import math

import pytest
import torch

import fia
import naive
from util import (INT_MAX, assert_close, assert_lse, assert_zero_rows, batched_mask, expected_out_shape, gen,
                  out_to_canon, poison_window, randmask, randn, seed_of, template_mask, to_layout)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT = {"fp16": F16, "bf16": BF16}


def pad_t(x: int) -> torch.Tensor:
    """A padding size as the documents pass it: a one-element int64 tensor."""
    return torch.tensor([x], dtype=torch.int64)


def windows(total: int, lens, pad, active: bool):
    """Per-batch valid window; None = the window starts below 0 (the batch's output is zeros)."""
    if not active:
        return [(0, l) for l in lens]
    p = max(pad, 0)
    out = []
    for l in lens:
        lo = total - p - l
        out.append(None if lo < 0 else (lo, total - p))
    return out


def lp_case(*, seed, layout="BSH", b=3, n=4, kvn=2, sq=10, skv=24, d=32, dtype=F16, act_q=None, act_kv=None,
            qpad=None, kvpad=None, mask=None, sparse_mode=0, pre=None, nxt=None, pse=None, inner_precise=0,
            api="fused", lse=True, naive_unlimited=None, scale=None):
    """Run a (possibly) left-padded call and compare with the naive model on explicit windows."""
    g = gen(seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = randn((b, n, sq, d), g, dtype)
    k, v = randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)
    decode = sq == 1
    aq = [sq] * b if (act_q is None or decode) else list(act_q)
    akv = [skv] * b if act_kv is None else list(act_kv)
    qw = windows(sq, aq, qpad, qpad is not None and act_q is not None and not decode)
    kw_ = windows(skv, akv, kvpad, kvpad is not None and act_kv is not None)
    dead_batch = [a is None or c is None for a, c in zip(qw, kw_)]
    qw = [(0, 0) if dead else w for w, dead in zip(qw, dead_batch)]
    kw_ = [(0, 0) if dead else w for w, dead in zip(kw_, dead_batch)]
    # poison everything outside the windows (dead batches: everything)
    q_in, k_in, v_in = poison_window(q, qw), poison_window(k, kw_), poison_window(v, kw_)
    base = layout.split("_")[0]
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout)
    if act_q is not None:
        kw["actual_seq_lengths"] = list(act_q)
    if act_kv is not None:
        kw["actual_seq_lengths_kv"] = list(act_kv)
    if qpad is not None:
        kw["query_padding_size"] = pad_t(qpad)
    if kvpad is not None:
        kw["kv_padding_size"] = pad_t(kvpad)
    if mask is not None:
        kw["atten_mask"] = mask
    if pse is not None:
        kw["pse_shift"] = pse
    if api == "fused":
        kw.update(scale=scale, softmax_lse_flag=lse, sparse_mode=sparse_mode, inner_precise=inner_precise)
        if pre is not None:
            kw["pre_tokens"] = pre
        if nxt is not None:
            kw["next_tokens"] = nxt
        out, l = fia.npu_fused_infer_attention_score(to_layout(q_in, base), to_layout(k_in, base),
                                                     to_layout(v_in, base), **kw)
    else:   # incre: decode only, actual_seq_lengths are the KV lengths
        kw.pop("actual_seq_lengths", None)
        kw["actual_seq_lengths"] = kw.pop("actual_seq_lengths_kv")
        out = fia.npu_incre_flash_attention(to_layout(q_in, base), to_layout(k_in, base), to_layout(v_in, base),
                                            scale_value=scale, **kw)
        l = None
        lse = False

    ns = sparse_mode
    mask_b = batched_mask(mask, b, decode) if mask is not None and (ns in (0, 1) or decode) else None
    if decode:
        ns = 1 if mask_b is not None else 0
    unlimited = naive_unlimited
    p_ = INT_MAX if (pre is None or unlimited) else pre
    n_ = INT_MAX if (nxt is None or unlimited) else nxt
    ref_o, ref_l = naive.attention(q.double(), k.double(), v.double(), scale=scale, q_windows=qw, kv_windows=kw_,
                                   mask=mask_b, sparse_mode=ns, pre_tokens=p_, next_tokens=n_,
                                   pse=None if pse is None else pse.double().expand(b, -1, -1, -1),
                                   inner_precise=inner_precise)
    assert out.dtype == dtype
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, d)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_o, dtype)
    lc = None
    if lse:
        lc = l[..., 0]
        assert_lse(lc, ref_l)
    assert_zero_rows(oc, lc, torch.isposinf(ref_l))
    for i, dead in enumerate(dead_batch):
        if dead:
            assert (oc[i] == 0).all(), f"batch {i}: window below 0, output must be zeros"
            if lc is not None:
                assert torch.isposinf(lc[i]).all()
    return oc, lc, ref_o, ref_l


# --------------------------------------------------------------------------------------------- basic windows
WHICH = ["q", "kv", "both"]


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("which", WHICH)
def test_left_padding_windows(which, layout, dt):
    """Query and/or KV left padding with per-batch lengths (GQA, lse)."""
    qpad = 2 if which in ("q", "both") else None
    kvpad = 3 if which in ("kv", "both") else None
    lp_case(seed=seed_of("lp", which, layout, dt), layout=layout, dtype=DT[dt], sq=10, skv=24,
            act_q=[8, 1, 5], act_kv=[21, 7, 1], qpad=qpad, kvpad=kvpad)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_left_padding_decode(layout):
    """Decode: kv_padding_size shifts the KV window; query_padding_size is meaningless (Q_S = 1)."""
    lp_case(seed=seed_of("lpdec", layout), layout=layout, sq=1, skv=30, act_kv=[12, 30, 1], kvpad=0)
    lp_case(seed=seed_of("lpdec2", layout), layout=layout, sq=1, skv=30, act_kv=[12, 25, 1], kvpad=5,
            qpad=4, act_q=[1, 1, 1])


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("shape", ["BK", "B11K"])
def test_left_padding_decode_mask_physical(shape):
    """Decode + kv left padding + a plain mask (decode shapes): the mask column is the physical position."""
    b, skv = 3, 16
    m = randmask((b, skv), gen(seed_of("lpdm", shape)), 0.3)
    if shape == "B11K":
        m = m.reshape(b, 1, 1, skv)
    lp_case(seed=seed_of("lpdm-d", shape), b=b, sq=1, skv=skv, act_kv=[5, 12, 16], kvpad=1, mask=m)


def test_left_padding_zero_length_rows():
    """act_q = 0 / act_kv = 0 under left padding: that batch's rows are 0 / +inf, the others are normal."""
    lp_case(seed=93, sq=7, skv=11, act_q=[0, 5, 7], act_kv=[6, 0, 9], qpad=0, kvpad=2)


@pytest.mark.case(q_s=1)
def test_left_padding_incre_api():
    """npu_incre_flash_attention: kv_padding_size with actual_seq_lengths (= KV lengths)."""
    lp_case(seed=91, layout="BSH", sq=1, skv=20, act_kv=[3, 14], b=2, kvpad=4, api="incre")


def test_left_padding_negative_counts_as_zero():
    """A negative padding size counts as 0: window [S - act, S)."""
    o_neg, l_neg, _, _ = lp_case(seed=5, sq=8, skv=16, act_q=[5, 8, 2], act_kv=[16, 3, 9], qpad=-3, kvpad=-7)
    o_zero, l_zero, _, _ = lp_case(seed=5, sq=8, skv=16, act_q=[5, 8, 2], act_kv=[16, 3, 9], qpad=0, kvpad=0)
    assert torch.equal(o_neg, o_zero)
    assert torch.equal(l_neg, l_zero)


@pytest.mark.parametrize("which", ["q", "kv"])
def test_left_padding_overflow_zeroes_that_batch(which):
    """S - pad - act < 0 for batch 1 only: batch 1's output is all zeros (lse +inf), batch 0 is normal."""
    if which == "q":
        oc, lc, _, _ = lp_case(seed=7, b=2, sq=10, skv=12, act_q=[3, 9], qpad=2)
    else:
        oc, lc, _, _ = lp_case(seed=8, b=2, sq=6, skv=12, act_kv=[5, 11], kvpad=2)
    assert (oc[1] == 0).all() and torch.isposinf(lc[1]).all()
    assert (oc[0] != 0).any()


@pytest.mark.case(q_s=1)
def test_left_padding_overflow_decode_kv():
    lp_case(seed=9, b=3, sq=1, skv=12, act_kv=[10, 11, 4], kvpad=2)


@pytest.mark.parametrize("which", ["q", "kv"])
def test_padding_ignored_without_lengths(which):
    """Padding is active only together with the matching actual lengths: otherwise it is ignored and
    the call equals the unpadded one (a pad that would overflow proves it is not applied)."""
    g = gen(13)
    q, k, v = randn((2, 2, 6, 16), g, F16), randn((2, 2, 9, 16), g, F16), randn((2, 2, 9, 16), g, F16)
    base = dict(num_heads=2, input_layout="BNSD", scale=0.25, softmax_lse_flag=True)
    ref_o, ref_l = fia.npu_fused_infer_attention_score(q, k, v, **base)
    if which == "q":
        # only KV lengths given (full): the query padding has no query lengths to go with
        o, l = fia.npu_fused_infer_attention_score(q, k, v, query_padding_size=pad_t(4),
                                                   actual_seq_lengths_kv=[9, 9], **base)
    else:
        o, l = fia.npu_fused_infer_attention_score(q, k, v, kv_padding_size=pad_t(4),
                                                   actual_seq_lengths=[6, 6], **base)
    assert torch.equal(o, ref_o) and torch.equal(l, ref_l)
    n_o, _ = naive.attention(q, k, v, scale=0.25)
    assert_close(o, n_o, F16)


def test_inactive_padding_keeps_the_band():
    """Padding sizes without their lengths are ignored entirely: sparse 0 + mask + pre/next keeps its band
    (the 'pre/next unlimited' rule belongs to active left padding only)."""
    g = gen(15)
    q, k, v = randn((2, 2, 6, 16), g, F16), randn((2, 2, 9, 16), g, F16), randn((2, 2, 9, 16), g, F16)
    mask = randmask((6, 9), g, 0.2)
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25, softmax_lse_flag=True, atten_mask=mask,
              pre_tokens=1, next_tokens=0)
    o0, l0 = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    o1, l1 = fia.npu_fused_infer_attention_score(q, k, v, query_padding_size=pad_t(2), kv_padding_size=pad_t(1),
                                                 **kw)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    ref, ref_l = naive.attention(q, k, v, scale=0.25, mask=mask.expand(2, -1, -1), sparse_mode=0, pre_tokens=1,
                                 next_tokens=0)
    assert_close(o1, ref, F16)
    assert_lse(l1[..., 0], ref_l)


# --------------------------------------------------------------------------------------------- metamorphic
def shift(x, lens, pad, total):
    """canonical right-padded [B, N, S, D] (rows [0, act)) -> left-padded (rows [S-pad-act, S-pad)), NaN else."""
    y = torch.full_like(x, float("nan"))
    for i, l in enumerate(lens):
        lo = total - pad - l
        y[i, :, lo:lo + l] = x[i, :, :l]
    return y


@pytest.mark.parametrize("pads", [(0, 0), (2, 3)], ids=["pad0", "pad2-3"])
@pytest.mark.parametrize("feature", ["plain", "mask1", "pse", "mask_pse_gqa"])
def test_left_equals_right_after_shift(feature, pads):
    """Metamorphic: the left-padded call on shifted data (and a shifted per-batch mask / pse) equals the
    right-padded call row for row; rows outside the window are 0 / +inf."""
    b, n, kvn, sq, skv, d = 3, 4, 2 if feature == "mask_pse_gqa" else 4, 9, 20, 32
    aq, akv = [7, 4, 6], [13, 17, 2]
    qp, kp = pads
    g = gen(seed_of("meta", feature, pads))
    q = randn((b, n, sq, d), g, BF16)
    k, v = randn((b, kvn, skv, d), g, BF16), randn((b, kvn, skv, d), g, BF16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.2, softmax_lse_flag=True,
              actual_seq_lengths=aq, actual_seq_lengths_kv=akv)
    kw_r, kw_l = dict(kw), dict(kw)
    kw_l.update(query_padding_size=pad_t(qp), kv_padding_size=pad_t(kp))
    if feature in ("mask1", "mask_pse_gqa"):
        m_r = randmask((b, 1, sq, skv), g, 0.3)
        m_l = torch.ones_like(m_r)
        for i in range(b):
            ql, kl = sq - qp - aq[i], skv - kp - akv[i]
            m_l[i, 0, ql:ql + aq[i], kl:kl + akv[i]] = m_r[i, 0, :aq[i], :akv[i]]
        kw_r.update(atten_mask=m_r, sparse_mode=1)
        kw_l.update(atten_mask=m_l, sparse_mode=1)
    if feature in ("pse", "mask_pse_gqa"):
        p_r = randn((b, n, sq, skv), g, BF16, std=2.0)
        p_l = torch.full_like(p_r, float("nan"))
        for i in range(b):
            ql, kl = sq - qp - aq[i], skv - kp - akv[i]
            p_l[i, :, ql:ql + aq[i], kl:kl + akv[i]] = p_r[i, :, :aq[i], :akv[i]]
        kw_r["pse_shift"], kw_l["pse_shift"] = p_r, p_l
    o_r, l_r = fia.npu_fused_infer_attention_score(q, k, v, **kw_r)
    o_l, l_l = fia.npu_fused_infer_attention_score(shift(q, aq, qp, sq), shift(k, akv, kp, skv),
                                                   shift(v, akv, kp, skv), **kw_l)
    for i in range(b):
        lo = sq - qp - aq[i]
        assert_close(o_l[i, :, lo:lo + aq[i]], o_r[i, :, :aq[i]].double(), BF16, what=f"batch {i}")
        assert_lse(l_l[i, :, lo:lo + aq[i], 0], l_r[i, :, :aq[i], 0].double())
        rest = torch.ones(sq, dtype=torch.bool)
        rest[lo:lo + aq[i]] = False
        assert (o_l[i, :, rest] == 0).all() and torch.isposinf(l_l[i, :, rest]).all()


# --------------------------------------------------------------------------------------------- masks / sparse
@pytest.mark.parametrize("kind", ["sparse1", "sparse0"])
def test_left_padding_mask_is_physical(kind):
    """Modes 0/1: the mask is indexed by physical positions (the window sits at its end)."""
    b, sq, skv = 3, 10, 22
    g = gen(seed_of("lpmask", kind))
    mask = randmask((b, sq, skv), g, 0.35)
    lp_case(seed=seed_of("lpmask-d", kind), sq=sq, skv=skv, act_q=[6, 10, 3], act_kv=[15, 5, 20], qpad=1,
            kvpad=2, mask=mask, sparse_mode=0 if kind == "sparse0" else 1, naive_unlimited=True)


@pytest.mark.parametrize("pre,nxt", [(0, 0), (2, -1), (-2, 3)])
def test_left_padding_sparse0_ignores_pre_next(pre, nxt):
    """Sparse 0 + a mask + left padding: pre/next are treated as unlimited (the mask alone applies),
    even values that would otherwise be invalid or leave rows without keys."""
    b, sq, skv = 2, 8, 16
    mask = randmask((sq, skv), gen(seed_of("lp0", pre, nxt)), 0.3)
    lp_case(seed=seed_of("lp0-d", pre, nxt), b=b, sq=sq, skv=skv, act_q=[5, 8], act_kv=[9, 14], qpad=1, kvpad=2,
            mask=mask, sparse_mode=0, pre=pre, nxt=nxt, naive_unlimited=True)


@pytest.mark.parametrize("sparse", [2, 3, 4])
@pytest.mark.parametrize("which", ["q", "kv", "both"])
def test_left_padding_band_modes_window_local(sparse, which):
    """Modes 2-4 with left padding: the band is window-local (row i / column j inside the windows)."""
    kw = dict(pre=3, nxt=1) if sparse == 4 else {}
    lp_case(seed=seed_of("lpband", sparse, which), sq=9, skv=20, act_q=[9, 4, 6], act_kv=[14, 20, 3],
            qpad=0 if which in ("q", "both") else None, kvpad=3 if which in ("kv", "both") else None,
            mask=template_mask((1, 2048, 2048)), sparse_mode=sparse, **kw)


def test_left_padding_row_invalid_correction():
    """A fully user-masked row under left padding: inner_precise 2 gives 0 / +inf, 0 gives mean of V."""
    b, sq, skv = 2, 6, 12
    aq, akv, qp, kp = [4, 6], [7, 12], 1, 0
    mask = torch.zeros(b, sq, skv, dtype=torch.bool)
    lo = sq - qp - aq[0]
    mask[0, lo + 1, :] = True             # batch 0, window row 1: everything masked
    for ip in (0, 2):
        lp_case(seed=17, b=b, sq=sq, skv=skv, act_q=aq, act_kv=akv, qpad=qp, kvpad=kp, mask=mask,
                sparse_mode=1, inner_precise=ip)


# --------------------------------------------------------------------------------------------- pse
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("sq", [1, 8], ids=lambda x: f"qs{x}")
def test_left_padding_pse_physical(sq, dt):
    """pse_shift is indexed like the mask: physical positions under left padding (SPEC 3); its entries
    outside the windows are NaN and must not leak."""
    b, n, skv = 3, 4, 18
    aq, akv, qp, kp = [8, 3, 5], [16, 6, 11], 0, 2
    g = gen(seed_of("lppse", sq, dt))
    pse = randn((b, n, sq, skv), g, DT[dt], std=2.0)
    qw = windows(sq, aq if sq > 1 else [1] * b, qp, sq > 1)
    kw_ = windows(skv, akv, kp, True)
    for i in range(b):
        keep = torch.zeros(sq, skv, dtype=torch.bool)
        keep[qw[i][0]:qw[i][1], kw_[i][0]:kw_[i][1]] = True
        pse[i, :, ~keep] = float("nan")
    lp_case(seed=seed_of("lppse-d", sq, dt), b=b, n=n, kvn=2, sq=sq, skv=skv, dtype=DT[dt],
            act_q=aq if sq > 1 else None, act_kv=akv, qpad=qp if sq > 1 else None, kvpad=kp, pse=pse)


def test_left_padding_pse_mask_gqa_lse_portable():
    """Left padding + pse + mask + GQA + lse in float32 (portable tolerance 1e-5)."""
    b, n, sq, skv = 2, 8, 7, 15
    g = gen(23)
    pse = randn((1, n, sq, skv), g, F32)
    mask = randmask((1, sq, skv), g, 0.3)
    with fia.validation_mode("portable"):
        lp_case(seed=24, b=b, n=n, kvn=2, sq=sq, skv=skv, d=20, dtype=F32, act_q=[5, 7], act_kv=[10, 15],
                qpad=2, kvpad=0, pse=pse, mask=mask, sparse_mode=1)
