"""5-D "NZ" paged caches (SPEC 8b): (blocknum, KV_N, D/D0, block_size, D0), read in place like every cache.

Each case is run twice on the same backend: with the NZ cache and with the equivalent ND paged cache (the same
values laid out (blocknum, block_size, H) or (blocknum, KV_N, block_size, D)); the results must be identical.
Both are also checked against the naive float64 formulation on the gathered (dense, dequantized) KV. Unused pool
blocks and the padding tokens of each sequence's last block are poison: NaN in float caches and per-token
scales, extreme int8 values in int8 caches.

Cases: the GQA C8 decode / MTP path (int8 NZ K/V, bf16 query, per-channel or per-token dequantization, SPEC
8b.2 a / 14b.5) and MLA fp16 / bf16 NZ K/V with the NZ rope cache (SPEC 8b.2 b / 14b.1), strict mode, on every backend (the decode
fast path packs each chunk's fragments into rows and runs its usual kernels).
"""
from __future__ import annotations

import math

import pytest
import torch

import fia
import naive
from test_quant_helpers import rand_int, rand_uniform
from util import (assert_close, assert_lse, block_table, gather_paged, gen, out_to_canon, paged_pool,
                  pool_as_cache, randn, seed_of, template_mask, to_layout)

F16, BF16, F32, I8 = torch.float16, torch.bfloat16, torch.float32, torch.int8
NAN = float("nan")

# the NZ cases run on every backend that takes paged caches
pytestmark = pytest.mark.backends("reference", "torch", "prefill", "decode")


def to_nz(pool: torch.Tensor, d0: int) -> torch.Tensor:
    """Canonical pool [NB, KV_N, bs, D] -> the NZ cache (NB, KV_N, D/d0, bs, d0) (SPEC 8b.1)."""
    nb, kvn, bs, d = pool.shape
    return pool.reshape(nb, kvn, bs, d // d0, d0).permute(0, 1, 3, 2, 4).contiguous()


def nd_cache(pool: torch.Tensor, layout: str) -> torch.Tensor:
    """The same pool as an ND paged cache valid for the layout (4-D only with BNSD / TND)."""
    return pool_as_cache(pool, "4d" if layout.split("_")[0] in ("BNSD", "TND") else "3d")


def used_slots(table: torch.Tensor, lens, bs: int, nb: int) -> torch.Tensor:
    """[NB, bs] bool: slots holding some sequence's valid token."""
    used = torch.zeros(nb, bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        nblk = -(-n // bs)
        used[table[b, :nblk].long()] |= (torch.arange(nblk * bs) < n).reshape(nblk, bs)
    return used


def int8_pool(table, lens, bs, nb, kvn, d, g) -> torch.Tensor:
    """Random int8 pool [NB, KV_N, bs, D]; unused slots hold +-127 / -128 poison."""
    pool = rand_int((nb, kvn, bs, d), g)
    poison = torch.where(torch.rand(nb, kvn, bs, d, generator=g) < 0.5, torch.tensor(127, dtype=I8),
                         torch.tensor(-128, dtype=I8))
    keep = used_slots(table, lens, bs, nb)[:, None, :, None].expand_as(pool)
    return torch.where(keep, pool, poison)


def run_both(q_in, nz_k, nz_v, nd_k, nd_v, *, nz_rope=None, nd_rope=None, **kw):
    """(NZ call, ND call) on the forced backend; NZ in the ambient (strict) mode, ND in portable mode (the ND
    form of the V4 scenarios is outside their strict tables)."""
    o5, l5 = fia.npu_fused_infer_attention_score(q_in, nz_k, nz_v, key_rope=nz_rope, **kw)
    with fia.validation_mode("portable"):
        o4, l4 = fia.npu_fused_infer_attention_score(q_in, nd_k, nd_v, key_rope=nd_rope, **kw)
    assert torch.equal(o5, o4), "NZ vs ND: outputs differ"
    if l5 is not None and l5.numel():
        assert torch.equal(l5, l4), "NZ vs ND: lse differ"
    return o5, l5


def mtp_mask_kw(sq: int) -> dict:
    """Q_S = 1: sparse 0 without mask; Q_S 2..16 (MTP): sparse 3 with the 2048 x 2048 template (G6 / M6)."""
    return {} if sq == 1 else dict(sparse_mode=3, atten_mask=template_mask())


# --------------------------------------------------------------------------------------------- GQA C8 (8b.2 a)
GQA_CASES = [("BSH", 10, 1, 128), ("BSND", 64, 8, 128), ("BNSD", 80, 8, 512)]


@pytest.mark.case(q_s="sq")
@pytest.mark.parametrize("gran", ["channel", "token"])
@pytest.mark.parametrize("sq", [1, 3], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("layout,n,kvn,bs", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa_int8_nz(layout, n, kvn, bs, sq, gran):
    """int8 NZ K/V [nb, KV_N, D/32, bs, 32] with a bf16 query, D = 128 (the C8 decode / MTP path): per-channel
    (mode 0, the layout's scale shape, bf16) or per-token (mode 1, (B, S) float32) separate K/V scales."""
    g = gen(seed_of("nz-gqa", layout, sq, gran))
    b, d = 3, 128
    lens = [bs + 37, 5, 2 * bs + 1] if bs == 128 else [bs + 37, 200]
    b = len(lens)
    table, nb = block_table(lens, bs, g, spare=2, extra_cols=1)
    kpool, vpool = int8_pool(table, lens, bs, nb, kvn, d, g), int8_pool(table, lens, bs, nb, kvn, d, g)
    q = randn((b, n, sq, d), g, BF16)
    s_tok = table.shape[1] * bs
    if gran == "channel":
        ksc, vsc = rand_uniform((kvn, d), g, 0.002, 0.02, BF16), rand_uniform((kvn, d), g, 0.002, 0.02, BF16)
        shape = {"BSH": (kvn * d,), "BSND": (kvn, d), "BNSD": (kvn, 1, d)}[layout]
        sc_kw = dict(key_antiquant_scale=ksc.reshape(shape), value_antiquant_scale=vsc.reshape(shape),
                     key_antiquant_mode=0, value_antiquant_mode=0)
        kf, vf = ksc.double()[None, :, None, :], vsc.double()[None, :, None, :]
    else:
        ksc, vsc = rand_uniform((b, s_tok), g, 0.002, 0.02, F32), rand_uniform((b, s_tok), g, 0.002, 0.02, F32)
        for i, n_ in enumerate(lens):                    # positions past each length: NaN (never read)
            ksc[i, n_:] = NAN
            vsc[i, n_:] = NAN
        sc_kw = dict(key_antiquant_scale=ksc, value_antiquant_scale=vsc, key_antiquant_mode=1, value_antiquant_mode=1)
        kf, vf = ksc.double()[:, None, :, None], vsc.double()[:, None, :, None]
    scale = 1 / math.sqrt(d)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale, block_table=table,
              block_size=bs, actual_seq_lengths_kv=lens, inner_precise=1, softmax_lse_flag=True,
              **mtp_mask_kw(sq), **sc_kw)
    out, lse = run_both(to_layout(q, layout), to_nz(kpool, 32), to_nz(vpool, 32), nd_cache(kpool, layout),
                        nd_cache(vpool, layout), **kw)
    assert out.dtype == BF16
    kd = gather_paged(kpool, table, lens, bs).double() * kf
    vd = gather_paged(vpool, table, lens, bs).double() * vf
    ref, rl = naive.attention(q.double(), kd, vd, scale=scale, kv_windows=[(0, x) for x in lens],
                              sparse_mode=3 if sq > 1 else 0)
    assert_close(out_to_canon(out, layout, n), ref, BF16)
    assert_lse(lse[..., 0], rl)


# --------------------------------------------------------------------------------------------- MLA (8b.2 b)
MLA_CASES = [("BSND", 16, "bf16"), ("BSH", 8, "fp16"), ("TND", 32, "bf16"), ("BSND_NBSD", 4, "fp16")]


@pytest.mark.case(q_s="sq")
@pytest.mark.parametrize("sq", [1, 2], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("layout,n,dt", MLA_CASES, ids=[f"{c[0]}-{c[2]}" for c in MLA_CASES])
def test_mla_nz(layout, n, dt, sq):
    """MLA D = 512 + rope 64: fp16 / bf16 NZ K/V [nb, 1, 32, 128, 16] and NZ key_rope [nb, 1, 4, 128, 16];
    unused blocks and padding tokens NaN in all three caches."""
    dtype = {"bf16": BF16, "fp16": F16}[dt]
    g = gen(seed_of("nz-mla", layout, sq, dt))
    d, dr, bs = 512, 64, 128
    lens = [300, 3, 129]
    b = len(lens)
    table, nb = block_table(lens, bs, g, spare=2, extra_cols=1)
    kpool = paged_pool(table, lens, bs, nb, 1, d, g, dtype)
    vpool = paged_pool(table, lens, bs, nb, 1, d, g, dtype)
    rpool = paged_pool(table, lens, bs, nb, 1, dr, g, dtype)
    q, qr = randn((b, n, sq, d), g, dtype), randn((b, n, sq, dr), g, dtype)
    scale = 1 / math.sqrt(d + dr)
    base = layout.split("_")[0]
    kw = dict(num_heads=n, num_key_value_heads=1, input_layout=layout, scale=scale, block_table=table,
              block_size=bs, actual_seq_lengths_kv=lens, softmax_lse_flag=True, **mtp_mask_kw(sq))
    if base == "TND":                                       # every request sq rows: T = B * sq
        def tnd(x):
            return x.permute(0, 2, 1, 3).reshape(b * sq, n, x.shape[-1])
        q_in, qr_in = tnd(q), tnd(qr)
        kw["actual_seq_lengths"] = [sq * (i + 1) for i in range(b)]
    else:
        q_in, qr_in = to_layout(q, base), to_layout(qr, base)
    out, lse = run_both(q_in, to_nz(kpool, 16), to_nz(vpool, 16), nd_cache(kpool, layout), nd_cache(vpool, layout),
                        nz_rope=to_nz(rpool, 16), nd_rope=nd_cache(rpool, layout), query_rope=qr_in, **kw)
    assert out.dtype == dtype
    if base == "TND":
        oc = out.reshape(b, sq, n, d).permute(0, 2, 1, 3)
        lc = lse.reshape(b, sq, n).permute(0, 2, 1)
    else:
        oc = out_to_canon(out, layout, n)
        lc = lse[..., 0]
    kd = torch.cat([gather_paged(kpool, table, lens, bs), gather_paged(rpool, table, lens, bs)], -1).double()
    vd = gather_paged(vpool, table, lens, bs).double()
    ref, rl = naive.attention(torch.cat([q, qr], -1).double(), kd, vd, scale=scale,
                              kv_windows=[(0, x) for x in lens], sparse_mode=3 if sq > 1 else 0)
    assert_close(oc, ref, dtype)
    assert_lse(lc, rl)


@pytest.mark.case(q_s=1)
def test_mla_nz_value_is_key():
    """MLA callers pass the latent cache as both key and value (one NZ tensor): the same result as the ND call with
    one tensor, and as the float64 formulation with V = K[..., :D]."""
    dtype = BF16
    g = gen(seed_of("nz-mla-shared"))
    d, dr, bs, n = 512, 64, 128, 16
    lens = [300, 3, 129]
    b = len(lens)
    table, nb = block_table(lens, bs, g, spare=2, extra_cols=1)
    kpool = paged_pool(table, lens, bs, nb, 1, d, g, dtype)
    rpool = paged_pool(table, lens, bs, nb, 1, dr, g, dtype)
    q, qr = randn((b, n, 1, d), g, dtype), randn((b, n, 1, dr), g, dtype)
    scale = 1 / math.sqrt(d + dr)
    kw = dict(num_heads=n, num_key_value_heads=1, input_layout="BSND", scale=scale, block_table=table,
              block_size=bs, actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    knz = to_nz(kpool, 16)
    knd = nd_cache(kpool, "BSND")
    out, lse = run_both(to_layout(q, "BSND"), knz, knz, knd, knd, nz_rope=to_nz(rpool, 16),
                        nd_rope=nd_cache(rpool, "BSND"), query_rope=to_layout(qr, "BSND"), **kw)
    kd = torch.cat([gather_paged(kpool, table, lens, bs), gather_paged(rpool, table, lens, bs)], -1).double()
    vd = gather_paged(kpool, table, lens, bs).double()
    ref, rl = naive.attention(torch.cat([q, qr], -1).double(), kd, vd, scale=scale,
                              kv_windows=[(0, x) for x in lens], sparse_mode=0)
    assert_close(out_to_canon(out, "BSND", n), ref, dtype)
    assert_lse(lse[..., 0], rl)


# --------------------------------------------------------------------------------------------- dispatch / errors
@pytest.mark.backend_independent
def test_decode_selected_for_nz():
    """Automatic selection runs an NZ decode call on the decode fast path (it packs each chunk's fragments into
    rows), and its result is the decode backend's ND result bit for bit."""
    g = gen(811)
    lens, bs, n, kvn, d = [150, 40], 128, 10, 1, 128
    table, nb = block_table(lens, bs, g)
    kpool, vpool = int8_pool(table, lens, bs, nb, kvn, d, g), int8_pool(table, lens, bs, nb, kvn, d, g)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", scale=0.09, block_table=table,
              block_size=bs, actual_seq_lengths_kv=lens, inner_precise=1,
              key_antiquant_scale=rand_uniform((kvn * d,), g, 0.002, 0.02, BF16),
              value_antiquant_scale=rand_uniform((kvn * d,), g, 0.002, 0.02, BF16))
    q = randn((2, 1, n * d), g, BF16)
    rep = fia.explain(q, to_nz(kpool, 32), to_nz(vpool, 32), **kw)
    assert rep.selected == "decode", str(rep)
    out = fia.npu_fused_infer_attention_score(q, to_nz(kpool, 32), to_nz(vpool, 32), **kw)[0]
    with fia.use_backend("decode"), fia.validation_mode("portable"):
        ref = fia.npu_fused_infer_attention_score(q, nd_cache(kpool, "BSH"), nd_cache(vpool, "BSH"), **kw)[0]
    assert torch.equal(out, ref)


@pytest.mark.backend_independent
@pytest.mark.parametrize("what", ["d0", "kv_n", "mixed", "fp32", "rope_nd"])
def test_nz_shape_errors(what):
    """SPEC 8b.1 / 8b.2 d: wrong fragment size, KV_N, NZ mixed with ND, float32 NZ: input errors."""
    g = gen(seed_of("nz-err", what))
    lens, bs, d = [40], 128, 512
    table, nb = block_table(lens, bs, g)
    pool = paged_pool(table, lens, bs, nb, 1, d, g, BF16)
    rpool = paged_pool(table, lens, bs, nb, 1, 64, g, BF16)
    k, v, kr = to_nz(pool, 16), to_nz(pool, 16), to_nz(rpool, 16)
    if what == "d0":
        k = v = to_nz(pool, 32)
    elif what == "kv_n":
        k = v = to_nz(pool.expand(nb, 2, bs, d).contiguous(), 16)
    elif what == "mixed":
        v = pool_as_cache(pool, "3d")
    elif what == "fp32":
        k = v = to_nz(pool.float(), 16)
    elif what == "rope_nd":
        kr = pool_as_cache(rpool, "3d")
    q, qr = randn((1, 1, 8, d), g, BF16), randn((1, 1, 8, 64), g, BF16)
    with fia.validation_mode("portable"), pytest.raises(fia.FiaInputError):
        fia.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, num_heads=8, num_key_value_heads=1,
                                            input_layout="BSND", scale=0.04, block_table=table, block_size=bs,
                                            actual_seq_lengths_kv=lens)
