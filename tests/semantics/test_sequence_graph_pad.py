"""Graph-padded requests (SPEC 14b.7): under ACL-graph replay vllm-ascend pads a TND batch to the captured size
with requests whose query length is > 0 and whose KV length is 0, their block-table rows zeros (or whatever the
buffer held). Strict mode accepts them under sparse 3 (and 0), GQA D = 128 and MLA D = 512 (query_rope /
key_rope) alike; such a request computes nothing: output rows 0, lse +inf, its block-table row never read.

Each case runs the padded batch and the same batch without the padded requests on the backend under test: the
real requests' rows must be bitwise equal, the padded requests' rows exactly 0 / +inf. The padded requests'
query rows are NaN, their table rows zeros (block 0 is a NaN-poisoned block no real request uses), 2**31 - 1
or random out-of-range ids, and every pool slot no real request uses is NaN: a read would show.
"""
from __future__ import annotations

import pytest
import torch

import fia
from fia.errors import FiaInputError
from util import block_table, cumsum, gen, ntd_split, paged_pool, pool_as_cache, randn, seed_of, template_mask, \
    tnd_split

BF16 = torch.bfloat16
BS = 128
NAN = float("nan")
SHAPES = {"gqa": dict(n=8, kvn=2, d=128, rope=0), "mla": dict(n=32, kvn=1, d=512, rope=64)}

# id, shape, layout, sparse_mode, real (q, kv) lengths, padded request positions and query lengths, table fill
CASES = [
    ("gqa-mtp-s3-zeros", "gqa", "TND", 3, [(2, 300), (2, 45), (2, 129)], [(3, 2), (4, 2)], "zeros"),
    ("gqa-mixed-s3-intmax", "gqa", "TND", 3, [(3, 300), (1, 45), (4, 129)], [(1, 2), (4, 2), (5, 3)], "int_max"),
    ("gqa-mixed-s0-garbage", "gqa", "TND", 0, [(3, 300), (1, 45), (4, 129)], [(3, 4)], "garbage"),
    ("gqa-decode-s0-zeros", "gqa", "TND", 0, [(1, 300), (1, 45), (1, 129)], [(3, 1), (4, 1)], "zeros"),
    ("gqa-decode-s3-intmax", "gqa", "TND", 3, [(1, 300), (1, 45), (1, 129)], [(0, 1), (4, 1)], "int_max"),
    ("mla-mtp-s3-zeros", "mla", "TND", 3, [(2, 300), (2, 45), (2, 129)], [(3, 2), (4, 2)], "zeros"),
    ("mla-mtp-s3-ntd-intmax", "mla", "TND_NTD", 3, [(2, 300), (2, 45), (2, 129)], [(3, 2), (4, 2)], "int_max"),
    ("mla-mixed-s3-garbage", "mla", "TND", 3, [(3, 300), (1, 45), (4, 129)], [(1, 2), (4, 4)], "garbage"),
    ("mla-decode-s0-zeros", "mla", "TND", 0, [(1, 300), (1, 45), (1, 129)], [(3, 1), (4, 1)], "zeros"),
    ("mla-decode-ntd-s0-intmax", "mla", "TND_NTD", 0, [(1, 300), (1, 45), (1, 129)], [(0, 1)], "int_max"),
]


def _fill(kind: str, cols: int, nb: int, g: torch.Generator) -> torch.Tensor:
    if kind == "zeros":                       # vllm-ascend's attention_v1 builder
        return torch.zeros(cols, dtype=torch.int32)
    if kind == "int_max":
        return torch.full((cols,), 2 ** 31 - 1, dtype=torch.int32)
    return torch.randint(nb, 2 ** 31 - 1, (cols,), generator=g, dtype=torch.int64).to(torch.int32)   # out of range


def _call(sh, layout, sparse, q, q_rope, key, value, key_rope, table, qlens, kvlens):
    kw = dict(num_heads=sh["n"], num_key_value_heads=sh["kvn"], input_layout=layout, scale=sh["d"] ** -0.5,
              actual_seq_lengths=cumsum(qlens), actual_seq_lengths_kv=list(kvlens), block_table=table,
              block_size=BS, sparse_mode=sparse, softmax_lse_flag=True)
    if sparse == 3:
        kw["atten_mask"] = template_mask()
    if q_rope is not None:
        kw.update(query_rope=q_rope, key_rope=key_rope)
    if layout == "TND_NTD":
        out, lse = fia.npu_fused_infer_attention_score(q, key, value, **kw)
        return ntd_split(out, qlens), tnd_split(lse, qlens)
    out, lse = fia.npu_fused_infer_attention_score(q, key, value, **kw)
    return tnd_split(out, qlens), tnd_split(lse, qlens)


def _build(sh, real, seed):
    """Per-request query rows [N, q, D] (and rope), the real requests' table (block 0 never used: the ids are
    shifted by 1) and the NaN-poisoned pools as caches."""
    g = gen(seed)
    n, kvn, d, dr = sh["n"], sh["kvn"], sh["d"], sh["rope"]
    kvlens = [kv for _, kv in real]
    table, nb = block_table(kvlens, BS, g, spare=2)
    table = torch.where(table >= 0, table + 1, table)
    nb += 1
    key = pool_as_cache(paged_pool(table, kvlens, BS, nb, kvn, d, g, BF16), "3d")
    value = key if dr else pool_as_cache(paged_pool(table, kvlens, BS, nb, kvn, d, g, BF16), "3d")
    key_rope = pool_as_cache(paged_pool(table, kvlens, BS, nb, kvn, dr, g, BF16), "3d") if dr else None
    qs = [randn((n, q, d), g, BF16) for q, _ in real]
    qrs = [randn((n, q, dr), g, BF16) for q, _ in real] if dr else None
    return g, qs, qrs, key, value, key_rope, table, nb


def _pack(xs):
    return torch.cat([x.permute(1, 0, 2) for x in xs], dim=0).contiguous()       # [T, N, D]


@pytest.mark.case(q_s=lambda p: max(max(q for q, _ in p["real"]), max(q for _, q in p["pads"])),
                  decode=lambda p: all(q == 1 for q, _ in p["real"]) and all(q == 1 for _, q in p["pads"]))
@pytest.mark.parametrize("cid,shape,layout,sparse,real,pads,fill", CASES, ids=[c[0] for c in CASES])
def test_graph_padded_requests(cid, shape, layout, sparse, real, pads, fill):
    sh = SHAPES[shape]
    g, qs, qrs, key, value, key_rope, table, nb = _build(sh, real, seed_of("gpad", cid))
    n, d, dr = sh["n"], sh["d"], sh["rope"]

    # the batch without the padded requests
    qlens = [q for q, _ in real]
    kvlens = [kv for _, kv in real]
    ref_o, ref_l = _call(sh, layout, sparse, _pack(qs), _pack(qrs) if dr else None, key, value, key_rope, table,
                         qlens, kvlens)

    # the padded batch: padded requests (query rows NaN, KV length 0, table row filled) inserted at their positions
    order = [("real", i) for i in range(len(real))]
    for pos, _ in pads:
        order.insert(pos, ("pad", None))
    pad_q = iter(q for _, q in pads)
    p_q, p_qr, p_tab, p_ql, p_kvl = [], [], [], [], []
    for kind, i in order:
        if kind == "real":
            p_q.append(qs[i])
            p_qr.append(qrs[i] if dr else None)
            p_tab.append(table[i])
            p_ql.append(real[i][0])
            p_kvl.append(real[i][1])
        else:
            ql = next(pad_q)
            p_q.append(torch.full((n, ql, d), NAN, dtype=BF16))
            p_qr.append(torch.full((n, ql, dr), NAN, dtype=BF16) if dr else None)
            p_tab.append(_fill(fill, table.shape[1], nb, g))
            p_ql.append(ql)
            p_kvl.append(0)
    ptable = torch.stack(p_tab)
    for _ in range(3):                      # repeated calls (replay paths) give the same results
        out, lse = _call(sh, layout, sparse, _pack(p_q), _pack(p_qr) if dr else None, key, value, key_rope,
                         ptable, p_ql, p_kvl)
        reals = iter(range(len(real)))
        for j, (kind, _) in enumerate(order):
            if kind == "pad":
                assert (out[j] == 0).all() and not torch.isnan(out[j]).any(), f"padded request {j}: output not 0"
                assert torch.isposinf(lse[j]).all(), f"padded request {j}: lse not +inf"
            else:
                i = next(reals)
                assert torch.equal(out[j], ref_o[i]), f"request {j} (real {i}): output differs from the unpadded batch"
                assert torch.equal(lse[j], ref_l[i]), f"request {j} (real {i}): lse differs from the unpadded batch"
                assert torch.isfinite(out[j].float()).all() and torch.isfinite(lse[j]).all()


@pytest.mark.backend_independent
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_graph_padded_partial_kv_still_rejected(shape):
    """0 < act_kv < act_q under sparse 3 stays an input error (T13); act_kv 0 is the only exception."""
    sh = SHAPES[shape]
    _, qs, qrs, key, value, key_rope, table, _ = _build(sh, [(3, 300), (3, 2)], seed_of("gpad-rej", shape))
    with pytest.raises(FiaInputError) as e:
        _call(sh, "TND", 3, _pack(qs), _pack(qrs) if sh["rope"] else None, key, value, key_rope, table, [3, 3],
              [300, 2])
    assert e.value.argument == "actual_seq_lengths"
