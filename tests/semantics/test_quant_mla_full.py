"""MLA full quantization (SPEC 10b.3, 14b.2): int8 query with dequant_scale_query (per token and head, float32,
token-major shapes as clients pass them), int8 NZ K/V [nb, 1, 16, 128, 32] with per-tensor float32 key / value
scales, bf16 query_rope and NZ key_rope [nb, 1, 4, 128, 16], bf16 output; decode and MTP (Q_S <= 16).

Checked against an independent float64 formulation written here:
    Q = Q_q * dsq[token, head];  K = K_q * s_k;  V = V_q * s_v
    S = scale * (Q K^T + Q_rope K_rope^T);  P = softmax(S);  O = P V
and against the same call on the equivalent ND (3-D) paged caches (identical results on the same backend).
Unused pool blocks and padding tokens: extreme int8 values in K/V, NaN in the rope cache.
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
from test_quant_helpers import rand_int, rand_uniform
from test_storage_nz import int8_pool, mtp_mask_kw, to_nz
from util import (assert_close, assert_lse, block_table, gen, out_to_canon, paged_pool, pool_as_cache, randn, seed_of,
                  to_layout)

BF16, F32 = torch.bfloat16, torch.float32
D, DR, BS = 512, 64, 128

pytestmark = pytest.mark.backends("reference", "torch", "prefill", "decode")


def expected(q8, dsq, qr, k8, kr, v8, sk, sv, lens, scale, sq):
    """Float64 MLA full quantization on canonical tensors: q8 [B, N, S, D], dsq [B, N, S], qr [B, N, S, Dr];
    k8 / v8 [B, S_kv, D] and kr [B, S_kv, Dr] (the gathered latent caches, KV_N = 1). Rows attend to the keys
    below their causal limit when sq > 1 (sparse 3: row i sees keys j <= i + len - sq)."""
    b, n, s, _ = q8.shape
    out = torch.zeros(b, n, s, v8.shape[-1], dtype=torch.float64)
    lse = torch.zeros(b, n, s, dtype=torch.float64)
    for i in range(b):
        L = lens[i]
        q = q8[i].double() * dsq[i].double()[..., None]                                # [N, S, D]
        k = k8[i, :L].double() * sk
        v = v8[i, :L].double() * sv
        sc = scale * (q @ k.T + qr[i].double() @ kr[i, :L].double().T)                 # [N, S, L]
        if sq > 1:
            j = torch.arange(L)[None, :]
            r = torch.arange(s)[:, None]
            sc = sc.masked_fill(j > r + L - s, -math.inf)
        lse[i] = torch.logsumexp(sc, -1)
        out[i] = torch.softmax(sc, -1) @ v
    return out, lse


def gather(pool, table, lens):
    """Canonical pool [NB, 1, bs, X] -> [B, max_len, X] (KV head 0; past each length: zeros, never read)."""
    b = len(lens)
    out = torch.zeros(b, max(lens), pool.shape[-1], dtype=pool.dtype)
    for i, n in enumerate(lens):
        nblk = -(-n // BS)
        out[i, :n] = pool[table[i, :nblk].long(), 0].reshape(nblk * BS, -1)[:n]
    return out


# dsq forms: "token" (B, Q_S, N) token-major; "head" (B, N, Q_S) (Q_S = 1: the same numbers);
# "vllm" (T, 1, N) with BSND_NBSD and Q_S = 1 (vllm-ascend's fa_quant decode)
CASES = [("BSND", 1, "token"), ("BSND", 4, "token"), ("BSH", 2, "token"), ("BSND_NBSD", 1, "vllm"),
         ("BSH_NBSD", 1, "head"), ("BSND_NBSD", 16, "token")]


@pytest.mark.case(q_s="sq")
@pytest.mark.parametrize("layout,sq,form", CASES, ids=[f"{c[0]}-sq{c[1]}-{c[2]}" for c in CASES])
def test_mla_full_quant(layout, sq, form):
    g = gen(seed_of("mla-fq", layout, sq, form))
    n = 8
    lens = [260, 17, 129] if form != "vllm" else [260, 17, 129, 40]
    b = len(lens)
    table, nb = block_table(lens, BS, g, spare=2, extra_cols=1)
    kpool, vpool = int8_pool(table, lens, BS, nb, 1, D, g), int8_pool(table, lens, BS, nb, 1, D, g)
    rpool = paged_pool(table, lens, BS, nb, 1, DR, g, BF16)                 # NaN in unused slots
    q8, qr = rand_int((b, n, sq, D), g), randn((b, n, sq, DR), g, BF16)
    dsq = rand_uniform((b, sq, n), g, 0.001, 0.01, F32)                      # token-major [B, Q_S, N]
    dsq_arg = {"token": dsq, "head": dsq.permute(0, 2, 1).contiguous(), "vllm": dsq.reshape(b * sq, 1, n)}[form]
    sk, sv = rand_uniform((1,), g, 0.001, 0.01, F32), rand_uniform((1,), g, 0.001, 0.01, F32)
    scale = 1 / math.sqrt(D + DR)
    base = layout.split("_")[0]
    kw = dict(num_heads=n, num_key_value_heads=1, input_layout=layout, scale=scale, block_table=table,
              block_size=BS, actual_seq_lengths_kv=lens, query_rope=to_layout(qr, base), dequant_scale_query=dsq_arg,
              query_quant_mode=3, key_antiquant_scale=sk, value_antiquant_scale=sv, key_antiquant_mode=0,
              value_antiquant_mode=0, **mtp_mask_kw(sq))
    q_in = to_layout(q8, base)
    out, _ = fia.npu_fused_infer_attention_score(q_in, to_nz(kpool, 32), to_nz(vpool, 32), key_rope=to_nz(rpool, 16),
                                                 **kw)
    with fia.validation_mode("portable"):                                 # the ND form (outside 14b.2's table)
        out_nd, _ = fia.npu_fused_infer_attention_score(q_in, pool_as_cache(kpool, "3d"), pool_as_cache(vpool, "3d"),
                                                        key_rope=pool_as_cache(rpool, "3d"), **kw)
    assert torch.equal(out, out_nd), "NZ vs ND: outputs differ"
    assert out.dtype == BF16
    oc = out_to_canon(out, layout, n)
    ref, _ = expected(q8, dsq.permute(0, 2, 1), qr, gather(kpool, table, lens), gather(rpool, table, lens),
                      gather(vpool, table, lens), float(sk), float(sv), lens, scale, sq)
    assert_close(oc, ref, BF16)


@pytest.mark.case(q_s=1)
def test_mla_full_quant_tnd_token_scales():
    """TND (portable: Q8 keeps it out of the strict table) with dequant_scale_query (T, Q_N) and (T, Q_N, 1):
    the per-token scales follow the packed rows; lse checked too."""
    g = gen(seed_of("mla-fq-tnd"))
    n, lens = 32, [150, 9]
    b = len(lens)
    table, nb = block_table(lens, BS, g)
    kpool, vpool = int8_pool(table, lens, BS, nb, 1, D, g), int8_pool(table, lens, BS, nb, 1, D, g)
    rpool = paged_pool(table, lens, BS, nb, 1, DR, g, BF16)
    q8, qr = rand_int((b, n, 1, D), g), randn((b, n, 1, DR), g, BF16)
    dsq = rand_uniform((b, n), g, 0.001, 0.01, F32)                           # [T, N]
    sk, sv = rand_uniform((1,), g, 0.001, 0.01, F32), rand_uniform((1,), g, 0.001, 0.01, F32)
    scale = 0.05
    ref, rl = expected(q8, dsq[:, :, None], qr, gather(kpool, table, lens), gather(rpool, table, lens),
                       gather(vpool, table, lens), float(sk), float(sv), lens, scale, 1)
    outs = []
    for form in (dsq, dsq[:, :, None]):
        with fia.validation_mode("portable"):
            out, lse = fia.npu_fused_infer_attention_score(
                q8[:, :, 0], to_nz(kpool, 32), to_nz(vpool, 32), key_rope=to_nz(rpool, 16), query_rope=qr[:, :, 0],
                num_heads=n, num_key_value_heads=1, input_layout="TND", scale=scale, block_table=table,
                block_size=BS, actual_seq_lengths=[1, 2], actual_seq_lengths_kv=lens, dequant_scale_query=form,
                query_quant_mode=3, key_antiquant_scale=sk, value_antiquant_scale=sv, softmax_lse_flag=True)
        assert out.dtype == BF16 and out.shape == (b, n, D)
        assert_close(out[:, :, None], ref, BF16)
        assert_lse(lse.reshape(b, n), rl[..., 0])
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.backend_independent
def test_dequant_scale_query_shape_error():
    """A dequant_scale_query matching neither (B, Q_N, Q_S) nor the token-major (B, Q_S, Q_N) (here: one token
    short) is an input error."""
    g = gen(seed_of("mla-fq-err"))
    lens = [40]
    table, nb = block_table(lens, BS, g)
    kpool = int8_pool(table, lens, BS, nb, 1, D, g)
    rpool = paged_pool(table, lens, BS, nb, 1, DR, g, BF16)
    q8, qr = rand_int((1, 2, 8, D), g), randn((1, 2, 8, DR), g, BF16)
    with pytest.raises(fia.FiaInputError, match="dequant_scale_query"):
        fia.npu_fused_infer_attention_score(
            q8, to_nz(kpool, 32), to_nz(kpool, 32), key_rope=to_nz(rpool, 16), query_rope=qr, num_heads=8,
            num_key_value_heads=1, input_layout="BSND", scale=0.05, block_table=table, block_size=BS,
            actual_seq_lengths_kv=lens, dequant_scale_query=rand_uniform((1, 1, 8), g, 0.001, 0.01, F32),
            query_quant_mode=3, key_antiquant_scale=torch.tensor([0.01]), value_antiquant_scale=torch.tensor([0.01]),
            sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
