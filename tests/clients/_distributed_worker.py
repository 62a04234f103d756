"""One rank of tests/clients/test_distributed.py: joins a gloo group on 127.0.0.1, runs a suite of cases against
single-process FIA on the whole sequence, and writes one JSON record per case.

    python tests/clients/_distributed_worker.py RANK WORLD PORT SUITE OUT_JSON TIMEOUT_S

Every rank builds the same global inputs from the case's seed, keeps its own slice, and compares its result
with the reference; a case's exception is recorded (class and message), not raised, so error cases can be
checked on every rank.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import fia
from fia import distributed as fd

TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rnd(g, *shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * 0.7 + 0.1).to(dtype)


def diff(a, b):
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    return float(torch.where(same_inf, torch.zeros_like(a), (a - b).abs()).max())


def cuts(g, lens, world, empty_rank0=()):
    """Per batch, W+1 cut points of [0, L]: rank r holds keys [c_r, c_{r+1})."""
    out = []
    for b, n in enumerate(lens):
        inner = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
        c = [0] + inner + [n]
        if b in empty_rank0 and world > 1:
            c[1] = 0
        out.append(c)
    return out


# ---------------------------------------------------------------------------- decode cases
def decode_case(rank, world, *, seed, layout="BNSD", dtype=torch.bfloat16, b=3, n=8, kvn=2, d=64,
                lens=(37, 5, 60), lse=True, storage="dense", quant=None, mask=False, pse=False, portable=False,
                backend="torch"):
    g = torch.Generator().manual_seed(seed)
    lens = list(lens)
    smax = max(lens) + 3
    q = rnd(g, b, n, 1, d, dtype=dtype)                                      # [B, N, 1, D]
    kvdt = torch.int8 if quant else dtype
    if quant:
        k = torch.randint(-100, 100, (b, kvn, smax, d), generator=g, dtype=torch.int8)
        v = torch.randint(-100, 100, (b, kvn, smax, d), generator=g, dtype=torch.int8)
    else:
        k, v = rnd(g, b, kvn, smax, d, dtype=dtype), rnd(g, b, kvn, smax, d, dtype=dtype)   # [B, KV_N, S, D]
    c = cuts(g, lens, world, empty_rank0=(1,))
    common = dict(num_heads=n, num_key_value_heads=kvn, scale=d ** -0.5, input_layout=layout,
                  softmax_lse_flag=lse)
    ref_kw, loc_kw = {}, {}
    if quant == "channel":
        sc = (torch.rand(2, kvn, d, generator=g) * 0.02 + 0.005).to(dtype)
        ref_kw = loc_kw = dict(antiquant_scale=sc, antiquant_mode=0)
    elif quant == "token":
        sc = torch.rand(2, b, smax, generator=g) * 0.02 + 0.005
        ref_kw = dict(antiquant_scale=sc, antiquant_mode=1)
    gmask = (torch.rand(b, smax, generator=g) < 0.3) if mask else None            # [B, S] global keys
    gpse = rnd(g, b, n, 1, smax, dtype=dtype) if pse else None                   # [B, N, 1, S]
    if mask:
        gmask[:, 0] = False
        ref_kw = dict(ref_kw, atten_mask=gmask)
        loc_kw = dict(loc_kw, atten_mask=gmask)
    if pse:
        ref_kw = dict(ref_kw, pse_shift=gpse)
        loc_kw = dict(loc_kw, pse_shift=gpse)

    def to_l(x):                                                                 # [B, N, S, D] -> layout
        if layout == "BSH":
            return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
        return x.transpose(1, 2).contiguous() if layout == "BSND" else x

    loc_len = [c[bb][rank + 1] - c[bb][rank] for bb in range(b)]
    sl = max(max(loc_len), 1) + 2
    if storage == "paged":                                         # per-token scales cover the table's capacity
        bs = 32 if quant else 16
        sl = -(-sl // bs) * bs
    lk = rnd(g, b, kvn, sl, d, dtype=dtype) if not quant else torch.randint(-100, 100, (b, kvn, sl, d), generator=g,
                                                                              dtype=torch.int8)
    lv = lk.clone() if quant else rnd(g, b, kvn, sl, d, dtype=dtype)           # garbage past local lengths
    for bb in range(b):
        lo, hi = c[bb][rank], c[bb][rank + 1]
        lk[bb, :, :hi - lo] = k[bb, :, lo:hi]
        lv[bb, :, :hi - lo] = v[bb, :, lo:hi]
    if quant == "token":
        lsc = torch.rand(2, b, sl, generator=g)
        for bb in range(b):
            lo, hi = c[bb][rank], c[bb][rank + 1]
            lsc[:, bb, :hi - lo] = sc[:, bb, lo:hi]
        loc_kw = dict(antiquant_scale=lsc, antiquant_mode=1)
    key_offset = [c[bb][rank] for bb in range(b)] if (mask or pse) else None
    lk_in, lv_in, extra = to_l(lk), to_l(lv), {}
    if storage == "list":
        lk_in = [to_l(lk[bb:bb + 1, :, :max(loc_len[bb], 1)]) for bb in range(b)]
        lv_in = [to_l(lv[bb:bb + 1, :, :max(loc_len[bb], 1)]) for bb in range(b)]
    elif storage == "paged":
        nbl = -(-sl // bs)
        perm = torch.randperm(b * nbl + 2, generator=g)
        table = perm[:b * nbl].view(b, nbl).to(torch.int32)                    # [B, blocks], scattered ids
        pk = torch.zeros(b * nbl + 2, bs, kvn * d, dtype=kvdt)                  # [NB, bs, H]
        pv = torch.zeros_like(pk)
        pad = nbl * bs - sl
        fk = torch.nn.functional.pad(lk.transpose(1, 2).reshape(b, sl, kvn * d), (0, 0, 0, pad))
        fv = torch.nn.functional.pad(lv.transpose(1, 2).reshape(b, sl, kvn * d), (0, 0, 0, pad))
        for bb in range(b):
            for j in range(nbl):
                pk[table[bb, j]] = fk[bb, j * bs:(j + 1) * bs]
                pv[table[bb, j]] = fv[bb, j * bs:(j + 1) * bs]
        lk_in, lv_in, extra = pk, pv, dict(block_table=table, block_size=bs)
    qin = to_l(q)
    with fia.validation_mode("portable" if portable else "strict"), fia.use_backend(backend):
        ref = fia.npu_fused_infer_attention_score(qin, to_l(k), to_l(v), actual_seq_lengths_kv=lens,
                                                  **common, **ref_kw)
        got = fd.decode_attention(qin, lk_in, lv_in, actual_seq_lengths_kv=loc_len, key_offset=key_offset,
                                  **common, **loc_kw, **extra)
    return {"out": diff(got[0], ref[0]), "lse": diff(got[1], ref[1]), "tol": TOL[dtype],
            "shape_ok": tuple(got[0].shape) == tuple(ref[0].shape) and tuple(got[1].shape) == tuple(ref[1].shape),
            "dtype_ok": got[0].dtype == ref[0].dtype}


# ---------------------------------------------------------------------------- ring cases
def ring_case(rank, world, *, seed, layout="BSH", dtype=torch.bfloat16, b=2, n=4, kvn=2, d=64, s=None,
              causal=True, zigzag=False, lse=True, portable=False, tnd_lens=None, backend="torch"):
    g = torch.Generator().manual_seed(seed)
    common = dict(num_heads=n, num_key_value_heads=kvn, scale=d ** -0.5, input_layout=layout,
                  softmax_lse_flag=lse)
    if causal:
        common.update(sparse_mode=3, atten_mask=TEMPLATE)
    ctx = lambda: fia.validation_mode("portable" if portable else "strict")      # noqa: E731
    if layout == "TND":
        lens = list(tnd_lens)
        t = sum(lens)
        q, k, v = rnd(g, t, n, d, dtype=dtype), rnd(g, t, kvn, d, dtype=dtype), rnd(g, t, kvn, d, dtype=dtype)
        cu = fd.args.lengths_to_cumulative(lens)
        with ctx(), fia.use_backend(backend):
            ref = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths=cu, actual_seq_lengths_kv=cu,
                                                      **common)
        if zigzag:
            ql, lcu = fd.zigzag_shard(q, rank, world, dim=0, cu_seqlens=cu)
            kl, _ = fd.zigzag_shard(k, rank, world, dim=0, cu_seqlens=cu)
            vl, _ = fd.zigzag_shard(v, rank, world, dim=0, cu_seqlens=cu)
            ro, _ = fd.zigzag_shard(ref[0], rank, world, dim=0, cu_seqlens=cu)
            rl = fd.zigzag_shard(ref[1], rank, world, dim=0, cu_seqlens=cu)[0] if lse else ref[1]
        else:
            # uneven contiguous split of each sequence: rank r holds [c_r, c_{r+1})
            c = cuts(g, lens, world)
            idx, loc = [], []
            start = 0
            for bb, nn in enumerate(lens):
                lo, hi = c[bb][rank], c[bb][rank + 1]
                idx.extend(range(start + lo, start + hi))
                loc.append(hi - lo)
                start += nn
            ix = torch.tensor(idx, dtype=torch.long)
            ql, kl, vl, ro = q[ix], k[ix], v[ix], ref[0][ix]
            rl = ref[1][ix] if lse else ref[1]
            lcu = fd.args.lengths_to_cumulative(loc)
        with ctx(), fia.use_backend(backend):
            got = fd.ring_attention(ql, kl, vl, zigzag=zigzag, actual_seq_lengths=lcu, actual_seq_lengths_kv=lcu,
                                    **common)
    else:
        q, k, v = rnd(g, b, n, s, d, dtype=dtype), rnd(g, b, kvn, s, d, dtype=dtype), rnd(g, b, kvn, s, d, dtype=dtype)

        def to_l(x):
            if layout == "BSH":
                return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
            return x.transpose(1, 2).contiguous() if layout == "BSND" else x
        sd = 2 if layout == "BNSD" else 1
        with ctx(), fia.use_backend(backend):
            ref = fia.npu_fused_infer_attention_score(to_l(q), to_l(k), to_l(v), **common)
        if zigzag:
            shard = lambda x, dim: fd.zigzag_shard(x, rank, world, dim=dim)            # noqa: E731
        else:
            shard = lambda x, dim: x.chunk(world, dim=dim)[rank]                        # noqa: E731
        ql, kl, vl = shard(to_l(q), sd), shard(to_l(k), sd), shard(to_l(v), sd)
        ro = shard(ref[0], sd)
        rl = shard(ref[1], 2) if lse else ref[1]
        with ctx(), fia.use_backend(backend):
            got = fd.ring_attention(ql, kl, vl, zigzag=zigzag, **common)
    return {"out": diff(got[0], ro), "lse": diff(got[1], rl), "tol": TOL[dtype],
            "shape_ok": tuple(got[0].shape) == tuple(ro.shape) and tuple(got[1].shape) == tuple(rl.shape),
            "dtype_ok": got[0].dtype == ro.dtype}


# ---------------------------------------------------------------------------- error cases
def _small_decode(seed, b=2, **kw):
    """decode_attention on the torch backend: B b, 8 / 2 heads, 16 local keys, D 64 (kw override)."""
    g = torch.Generator().manual_seed(seed)
    q = rnd(g, b, 8, 1, 64)
    k, v = rnd(g, b, 2, 16, 64), rnd(g, b, 2, 16, 64)
    args = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.1)
    with fia.use_backend("torch"):
        fd.decode_attention(q, k, v, **{**args, **kw})
    return {}


def mismatch_case(rank, world):
    """Rank 1 passes a query with another batch size: every rank must raise."""
    return _small_decode(5, b=3 if rank == 1 else 2)


def local_error_case(rank, world):
    """Rank 1 passes an invalid num_heads: it raises FIA's own error, the others a FiaRuntimeError naming it."""
    return _small_decode(6, num_heads=8 if rank != 1 else 7)


def mask_without_offset_case(rank, world):
    return _small_decode(7, atten_mask=torch.zeros(2, 16, dtype=torch.bool))


def ring_mask_case(rank, world):
    g = torch.Generator().manual_seed(8)
    q, k = rnd(g, 1, 4, 8, 64), rnd(g, 1, 4, 8, 64)
    with fia.use_backend("torch"):
        fd.ring_attention(q, k, k, num_heads=4, input_layout="BNSD", scale=0.1, sparse_mode=2, atten_mask=TEMPLATE)
    return {}


def ring_local_error_case(rank, world):
    """Rank 1's cumulative lengths do not end at its T: FIA rejects its first block; every rank must raise."""
    g = torch.Generator().manual_seed(10)
    q, k = rnd(g, 8, 4, 128), rnd(g, 8, 4, 128)
    cu = [3, 8] if rank != 1 else [3, 7]
    with fia.use_backend("torch"):
        fd.ring_attention(q, k, k, num_heads=4, input_layout="TND", scale=0.1, sparse_mode=3, atten_mask=TEMPLATE,
                          actual_seq_lengths=cu, actual_seq_lengths_kv=cu)
    return {}


def dies_case(rank, world):
    """Rank 1 exits without calling; rank 0's call must end in an error within the group's timeout."""
    if rank == 1:
        sys.stdout.flush()
        os._exit(3)
    g = torch.Generator().manual_seed(9)
    q = rnd(g, 2, 8, 1, 64)
    k, v = rnd(g, 2, 2, 16, 64), rnd(g, 2, 2, 16, 64)
    with fia.use_backend("torch"):
        fd.decode_attention(q, k, v, num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.1)
    return {}


def suite(name, world):
    """(case name, function) pairs; every rank runs the same list in the same order."""
    D = decode_case
    R = ring_case
    cases = []
    if name in ("main", "main4"):
        cases += [
            ("decode-bnsd-bf16-gqa-lse", lambda r, w: D(r, w, seed=1)),
            ("decode-bsh-fp32-nolse", lambda r, w: D(r, w, seed=2, layout="BSH", dtype=torch.float32, lse=False,
                                                      portable=True)),
            ("decode-bsnd-fp16", lambda r, w: D(r, w, seed=3, layout="BSND", dtype=torch.float16)),
            ("decode-paged-bf16", lambda r, w: D(r, w, seed=4, layout="BSH", storage="paged")),
            ("decode-int8-channel", lambda r, w: D(r, w, seed=5, quant="channel")),
            ("decode-int8-token-paged", lambda r, w: D(r, w, seed=6, layout="BSH", quant="token", storage="paged")),
            ("decode-list-fp16", lambda r, w: D(r, w, seed=7, storage="list", dtype=torch.float16)),
            ("decode-mask-pse-offset", lambda r, w: D(r, w, seed=8, dtype=torch.float16, mask=True, pse=True)),
            ("decode-default-backend", lambda r, w: D(r, w, seed=9, layout="BSH", backend=None)),
            ("ring-bsh-full-bf16", lambda r, w: R(r, w, seed=10, causal=False, s=8 * w)),
            ("ring-bsnd-causal-fp32", lambda r, w: R(r, w, seed=11, layout="BSND", dtype=torch.float32, s=8 * w,
                                                     portable=True)),
            ("ring-bnsd-causal-nolse", lambda r, w: R(r, w, seed=12, layout="BNSD", s=6 * w, lse=False)),
            ("ring-bsh-zigzag-fp32", lambda r, w: R(r, w, seed=13, zigzag=True, dtype=torch.float32, s=4 * w,
                                                    portable=True)),
            ("ring-bnsd-zigzag-bf16", lambda r, w: R(r, w, seed=14, layout="BNSD", zigzag=True, s=6 * w)),
            ("ring-tnd-causal", lambda r, w: R(r, w, seed=15, layout="TND", d=128, tnd_lens=[13, 4 * w, 3])),
            ("ring-tnd-full-fp16", lambda r, w: R(r, w, seed=16, layout="TND", dtype=torch.float16, causal=False,
                                                  portable=True, tnd_lens=[9, 3 * w])),
            ("ring-tnd-zigzag", lambda r, w: R(r, w, seed=17, layout="TND", zigzag=True, d=128,
                                               tnd_lens=[4 * w, 2 * w])),
            ("ring-default-backend", lambda r, w: R(r, w, seed=18, layout="BSND", s=4 * w, backend=None)),
        ]
    if name == "main":
        cases += [("err-mismatch", mismatch_case), ("err-local", local_error_case),
                  ("err-mask-no-offset", mask_without_offset_case), ("err-ring-mask", ring_mask_case),
                  ("err-ring-local", ring_local_error_case),
                  ("after-errors", lambda r, w: D(r, w, seed=19))]
    if name == "dies":
        cases += [("dies", dies_case)]
    return cases


def main():
    rank, world, port, name, out, timeout = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout)))
    results = []
    for case, fn in suite(name, world):
        rec = {"case": case}
        try:
            rec.update(fn(rank, world))
        except Exception as e:
            rec["error"] = type(e).__name__
            rec["message"] = str(e)
            rec["argument"] = getattr(e, "argument", None)
            if os.environ.get("FIA_DIST_TEST_TRACE"):
                traceback.print_exc()
        results.append(rec)
        with open(out, "w") as f:                   # written after each case: a hang still leaves evidence
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
