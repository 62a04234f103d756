"""npu_fused_infer_attention_score_v2 mapping, learnable sinks, npu_attention_update.

Sinks are checked against a float64 formulation written here (SPEC 1.1b): one extra score column per
row that no mask hides and that carries no value.
"""
import math

import pytest
import torch

import fia
from util import gen, randn, randmask, seed_of

F1 = fia.npu_fused_infer_attention_score
F2 = fia.npu_fused_infer_attention_score_v2


def sink_naive(q, k, v, sink, scale, masked=None, kv_len=None):
    """q [B, N, Sq, D], k/v [B, KV_N, Skv, D] float64; sink [N]; masked [B, Sq, Skv] bool (user mask).

    Returns out [B, N, Sq, Dv], lse [B, N, Sq]. Rows with no key at all (kv_len 0) -> 0 / +inf."""
    b, n, sq, _ = q.shape
    kv_n = k.shape[1]
    g = n // kv_n
    out = torch.zeros(b, n, sq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, n, sq), math.inf, dtype=torch.float64)
    for bi in range(b):
        L = k.shape[2] if kv_len is None else kv_len[bi]
        if L == 0:
            continue
        for h in range(n):
            s = scale * q[bi, h] @ k[bi, h // g, :L].T                      # [Sq, L]
            if masked is not None:
                s = s.masked_fill(masked[bi, :, :L], -1e12)
            full = torch.cat([s, sink[h].expand(sq, 1)], dim=1)            # the sink column
            p = torch.softmax(full, dim=1)[:, :L]
            out[bi, h] = p @ v[bi, h // g, :L]
            lse[bi, h] = torch.logsumexp(full, dim=1)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,kv_n,sq", [(4, 4, 1), (8, 2, 1), (8, 2, 5), (4, 1, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_sink_matches_float64(dtype, n, kv_n, sq, masked):
    g = gen(seed_of("sink", dtype, n, kv_n, sq, masked))
    b, skv, d = 3, 24, 32
    q = randn((b, n, sq, d), g, dtype)
    k = randn((b, kv_n, skv, d), g, dtype)
    v = randn((b, kv_n, skv, d), g, dtype)
    sink = randn((n,), g, torch.float32, std=2.0)
    m = None
    if masked:
        m = randmask((b, sq, skv), g, 0.4)
        m[0, 0, :] = True                       # one fully user-masked row: all weight on the sink
    kv_len = [24, 0, 11]                        # batch 1 has no key at all: 0 / +inf
    kw = dict(num_query_heads=n, num_key_value_heads=kv_n, input_layout="BNSD", softmax_scale=0.3,
              learnable_sink=sink, return_softmax_lse=True, actual_seq_kvlen=kv_len)
    if masked:
        kw.update(atten_mask=m if sq > 1 else m[:, 0], sparse_mode=1 if sq > 1 else 0)
    out, lse = F2(q, k, v, **kw)
    ref, rlse = sink_naive(q.double(), k.double(), v.double(), sink.double(), 0.3, m, kv_len)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-2
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isinf(lse[..., 0]), ~fin)
    assert (lse[..., 0].double()[fin] - rlse[fin]).abs().max() <= 1e-3
    assert torch.all(out[1] == 0)
    if masked:                                  # fully masked row: output 0, lse = sink (bit 1 or not)
        assert torch.all(out[0, :, 0].float().abs() < 1e-6)
        assert torch.allclose(lse[0, :, 0, 0], sink, atol=1e-4)


def test_sink_fully_masked_row_with_row_invalid_correction():
    g = gen(7)
    q, k, v = randn((1, 2, 4, 32), g), randn((1, 2, 8, 32), g), randn((1, 2, 8, 32), g)
    sink = torch.tensor([0.5, -1.0])
    m = randmask((4, 8), g, 0.3)
    m[2] = True
    out, lse = F2(q, k, v, num_query_heads=2, input_layout="BNSD", learnable_sink=sink, atten_mask=m,
                  sparse_mode=1, inner_precise=2, return_softmax_lse=True)
    assert torch.all(out[0, :, 2] == 0)
    assert torch.allclose(lse[0, :, 2, 0], sink)


def test_sink_validation():
    g = gen(8)
    q, k, v = randn((1, 2, 4, 32), g), randn((1, 2, 8, 32), g), randn((1, 2, 8, 32), g)
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2)):
        with pytest.raises(fia.FiaInputError, match="learnable_sink"):
            F2(q, k, v, num_query_heads=2, input_layout="BNSD", learnable_sink=bad)


# ------------------------------------------------------------------------------------------- v2 mapping
def _v1_v2_pair(g):
    b, n, kv_n, sq, skv, d = 2, 4, 2, 6, 20, 32
    q = randn((b, sq, n, d), g, torch.bfloat16)
    k = randn((b, skv, kv_n, d), g, torch.bfloat16)
    v = randn((b, skv, kv_n, d), g, torch.bfloat16)
    return q, k, v, n, kv_n


@pytest.mark.parametrize("case", ["lengths", "mask_band", "pse", "lse", "quant_out", "antiquant_sep", "paged"])
def test_v2_matches_v1(case):
    g = gen(seed_of("v2", case))
    q, k, v, n, kv_n = _v1_v2_pair(g)
    common1 = dict(num_heads=n, num_key_value_heads=kv_n, input_layout="BSND", scale=0.2)
    common2 = dict(num_query_heads=n, num_key_value_heads=kv_n, input_layout="BSND", softmax_scale=0.2)
    k1, k2 = {}, {}
    if case == "lengths":
        k1 = dict(actual_seq_lengths=[6, 3], actual_seq_lengths_kv=[20, 7])
        k2 = dict(actual_seq_qlen=[6, 3], actual_seq_kvlen=[20, 7])
    elif case == "mask_band":
        m = randmask((6, 20), g)
        k1 = k2 = dict(atten_mask=m, sparse_mode=0, pre_tokens=5, next_tokens=2, inner_precise=2)
    elif case == "pse":
        k1 = k2 = dict(pse_shift=randn((1, n, 6, 20), g, torch.bfloat16))
    elif case == "lse":
        k1, k2 = dict(softmax_lse_flag=True), dict(return_softmax_lse=True)
    elif case == "quant_out":
        s, o = torch.rand(n * 32) * 50, torch.randn(n * 32)
        k1, k2 = dict(quant_scale2=s, quant_offset2=o), dict(quant_scale_out=s, quant_offset_out=o)
    elif case == "antiquant_sep":
        q = q[:, :1].contiguous()
        k8 = torch.randint(-128, 128, (2, 20, kv_n, 32), dtype=torch.int8, generator=g)
        v8 = torch.randint(-128, 128, (2, 20, kv_n, 32), dtype=torch.int8, generator=g)
        ks, vs = torch.rand(2, 20, generator=g) * 0.02, torch.rand(2, 20, generator=g) * 0.02
        k, v = k8, v8
        k1 = dict(key_antiquant_scale=ks[None], value_antiquant_scale=vs[None], key_antiquant_mode=1,
                  value_antiquant_mode=1)
        k2 = dict(dequant_scale_key=ks[None], dequant_scale_value=vs[None], key_quant_mode=1, value_quant_mode=1)
    elif case == "paged":
        q = q[:, :1].contiguous()
        bs = 16
        cache_k = randn((5, bs, kv_n * 32), g, torch.bfloat16)
        cache_v = randn((5, bs, kv_n * 32), g, torch.bfloat16)
        bt = torch.tensor([[3, 1], [4, -1]], dtype=torch.int32)
        k, v = cache_k, cache_v
        k1 = dict(block_table=bt, block_size=bs, actual_seq_lengths_kv=[20, 9])
        k2 = dict(block_table=bt, block_size=bs, actual_seq_kvlen=[20, 9])
    o1, l1 = F1(q, k, v, **common1, **k1)
    o2, l2 = F2(q, k, v, **common2, **k2)
    assert o1.dtype == o2.dtype and torch.equal(o1, o2)
    if case == "lse":
        assert torch.equal(l1, l2)
    else:
        assert l1.shape == (0,) and l2.shape == (1,) and l2.dtype == torch.float32 and l2.item() == 0


@pytest.mark.parametrize("name", ["antiquant_scale", "dequant_scale1", "query_padding_size", "key_shared_prefix",
                                  "actual_shared_prefix_len"])
def test_v2_rejects_unreachable_arguments(name):
    g = gen(1)
    q, k, v, n, kv_n = _v1_v2_pair(g)
    with pytest.raises(fia.FiaInputError, match="npu_fused_infer_attention_score") as e:
        F2(q, k, v, num_query_heads=n, num_key_value_heads=kv_n, input_layout="BSND", **{name: torch.ones(1)})
    assert name in str(e.value)


@pytest.mark.parametrize("name", ["query_dtype", "key_rope_dtype", "dequant_scale_key_rope",
                                  "dequant_scale_value_dtype"])
def test_v2_reserved_arguments(name):
    g = gen(2)
    q, k, v, n, kv_n = _v1_v2_pair(g)
    F2(q, k, v, num_query_heads=n, num_key_value_heads=kv_n, input_layout="BSND", **{name: None})
    with pytest.raises(fia.FiaInputError) as e:
        F2(q, k, v, num_query_heads=n, num_key_value_heads=kv_n, input_layout="BSND",
           **{name: torch.ones(1) if name == "dequant_scale_key_rope" else 1})
    assert name in str(e.value) and e.value.status == 161002


def test_v2_error_names_v2_argument():
    g = gen(3)
    q, k, v, n, kv_n = _v1_v2_pair(g)
    with pytest.raises(fia.FiaInputError, match="num_query_heads"):
        F2(q, k, v, num_query_heads=3, num_key_value_heads=kv_n, input_layout="BSND")
    with pytest.raises(fia.FiaInputError, match="actual_seq_kvlen"):
        F2(q, k, v, num_query_heads=n, num_key_value_heads=kv_n, input_layout="BSND", actual_seq_kvlen=[30])


def test_v2_int8_query_without_dequant_scale_query_names_v2_argument():
    """Full int8 (dequant_scale1 & co) is not reachable through v2: the error names v2's own argument."""
    g = gen(4)
    q = torch.randint(-5, 5, (1, 8, 4, 64), dtype=torch.int8, generator=g)
    k = torch.randint(-5, 5, (1, 2, 16, 64), dtype=torch.int8, generator=g)
    with pytest.raises(fia.FiaInputError, match="npu_fused_infer_attention_score\\b") as e:
        F2(q, k, k, num_query_heads=8, num_key_value_heads=2, input_layout="BNSD")
    assert e.value.argument == "dequant_scale_query" and "dequant_scale1" in str(e.value)


# ------------------------------------------------------------------------------------- attention update
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_split_keys_merge_equals_unsplit(parts, masked):
    g = gen(seed_of("merge", parts, masked))
    b, n, kv_n, sq, skv, d = 2, 4, 2, 5, 30, 32
    with fia.validation_mode("portable"):
        q = randn((b, n, sq, d), g, torch.float32)
        k = randn((b, kv_n, skv, d), g, torch.float32)
        v = randn((b, kv_n, skv, d), g, torch.float32)
        cuts = sorted(torch.randperm(skv - 1, generator=g)[:parts - 1].add(1).tolist())
        bounds = [0] + cuts + [skv]
        m = randmask((b, sq, skv), g, 0.5) if masked else None
        if masked:
            m[:, 1, : bounds[1]] = True          # row 1 has no valid key in part 0
        kw = dict(num_heads=n, num_key_value_heads=kv_n, input_layout="BNSD", scale=0.25, softmax_lse_flag=True,
                  inner_precise=2)
        outs, lses = [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            extra = dict(atten_mask=m[:, :, lo:hi].contiguous(), sparse_mode=1) if masked else {}
            o, l = F1(q, k[:, :, lo:hi], v[:, :, lo:hi], **kw, **extra)
            outs.append(o.reshape(-1, d))
            lses.append(l.reshape(-1))
        merged, mlse = fia.npu_attention_update(lses, outs, 1)
        extra = dict(atten_mask=m, sparse_mode=1) if masked else {}
        ref, rlse = F1(q, k, v, **kw, **extra)
    ref, rlse = ref.reshape(-1, d), rlse.reshape(-1)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isinf(mlse), ~fin)
    assert (merged - ref).abs().max() / ref.abs().max() <= 1e-3
    assert (mlse[fin] - rlse[fin]).abs().max() <= 1e-3


def test_update_empty_partials_and_dtype():
    g = gen(9)
    o1, o2 = randn((4, 8), g, torch.bfloat16), randn((4, 8), g, torch.bfloat16)
    o2[1] = float("nan")                         # garbage in an empty partial must not leak
    l1 = torch.tensor([0.5, 1.0, float("inf"), float("inf")])
    l2 = torch.tensor([float("-inf"), float("inf"), 0.2, float("inf")])
    out, lse = fia.npu_attention_update([l1, l2], [o1, o2], 1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], o1[0]) and torch.equal(out[1], o1[1]) and torch.equal(out[2], o2[2])
    assert torch.all(out[3] == 0) and lse[3] == float("inf")
    assert lse[0] == 0.5 and lse[2].item() == pytest.approx(0.2)
    out0, none = fia.npu_attention_update([l1, l2], [o1, o2], 0)
    assert none is None and torch.equal(out0, out)


def test_update_validation():
    l = torch.zeros(4)
    o = torch.zeros(4, 8)
    with pytest.raises(fia.FiaInputError, match="lse"):
        fia.npu_attention_update([l.double()], [o], 0)
    with pytest.raises(fia.FiaInputError, match="local_out"):
        fia.npu_attention_update([l, l], [o], 0)
    with pytest.raises(fia.FiaInputError, match="local_out"):
        fia.npu_attention_update([l], [torch.zeros(5, 8)], 0)
    with pytest.raises(fia.FiaInputError, match="update_type"):
        fia.npu_attention_update([l], [o], 2)
