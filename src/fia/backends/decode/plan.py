"""The decode plan: everything of a call that follows from its metadata (int parameters, geometry, work split and
item schedule, output layout), built once per parse-memo key (plan_of) and launched per call (execute.py).

The work split: work items are (batch, KV head group, key range); long sequences are cut into ranges so that every
core gets work (split-KV; the partials are merged through their LSEs), short calls stay on the calling thread.
A shared prefix is read once per group of batches (all of them while G * Q_S * batches <= PREFIX_ROWS).
The tuning constants below are read at plan time (tests and benchmarks set them on this module); a memoized plan
is keyed by them (plan_key), so changing one re-plans.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from ... import caches
from ...problem.attention import AttentionProblem
from .inputs import KIND_BYTES, KINDS, Inputs, Source, chan_modes, kind_of

PREFIX_ROWS = 64            # rows of one prefix work group: the prefix is read once per group of batches
MIN_SPLIT = 512             # fewest keys of a split (smaller splits cost more in merging than they gain)
ITEMS_PER_THREAD = 4        # split long sequences until there are about this many items per thread
CHUNK_FLOATS = 32768        # keys per chunk = CHUNK_FLOATS // head dim (256 for D = 128), measured best
PARALLEL_MIN_WORK = 16384   # keys x rows below which one thread does everything (no pool hand-off)
# ... and a launch of at most PARALLEL_MIN_BYTES of K / V below 16 x PARALLEL_MIN_WORK: the pool's hand-off and two
# threads' interference cost more there than the second core gains (docs/performance.md, "Small launches")
PARALLEL_MIN_BYTES = 6 << 20
# The kernels' software prefetches (kernels.PREFETCH_POLICY) bet that K / V come from DRAM. A launch that
# reads at most PREFETCH_MIN_BYTES of K / V runs without them: its data may well be cached (a call repeated), where
# they only cost instructions (docs/performance.md, "Kernel choices: the measurements").
PREFETCH_MIN_BYTES = 1 << 20


def _prefix_groups(p: AttentionProblem):
    """(batches per group, groups) of the shared-prefix pass: the prefix is read once per group."""
    bpg = max(1, min(p.B, PREFIX_ROWS // (p.G * p.Q_S)))
    return bpg, -(-p.B // bpg)


class Launch(NamedTuple):
    """One attend_items call: its int parameters, work entries [w0, w1) and item schedule."""
    ip: np.ndarray
    work: np.ndarray
    w0: int
    w1: int
    items: np.ndarray       # item order (longest first when threaded)
    threads: int
    generic: Optional[np.ndarray]
    key_bytes: float        # bytes of K / V (and rope) per key and KV head (_dp_flags)


class Plan(NamedTuple):
    """Everything of a call that follows from metadata (see the module doc); arrays only read by the kernels."""
    fp: np.ndarray          # [scale] float64
    geo: np.ndarray         # [GEO_LEN, B]
    W: int                  # own-key work entries
    wrange: np.ndarray      # [2, B] work entries of batch b
    own: list               # a Launch (or None: no entries) per KV source of Inputs.sources
    prefix: Optional[Launch]
    prefix_rows: int        # rows of one prefix work item (batches per group x R0)
    pwrange: np.ndarray     # [2, groups] prefix work entries of a group
    mp: np.ndarray          # merge's int parameters
    obase: np.ndarray       # [3, B] output row bases (see merge)
    out_size: tuple         # the canonical view of the output as allocated (in the output layout):
    out_stride: tuple       # its size and strides, for one torch.empty_strided (faster than empty + permute:
    #                         docs/performance.md, "Kernel choices: the measurements")
    out_dtype: torch.dtype
    out_bytes: int


PLANS = caches.BoundedCache("decode.plans", 256)      # plan_key -> Plan


def plan_of(p: AttentionProblem, x: Optional[Inputs], K) -> Plan:
    """The plan of p, memoized per parse-memo key, thread count and tuning constants. x: p's inputs (their
    metadata: views, sources), or None: made from p where the plan must be built."""
    if p.memo_key is None:
        return _plan(p, Inputs(p) if x is None else x, K, max(1, torch.get_num_threads()))
    key = plan_key(p.memo_key, K)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, _plan(p, Inputs(p) if x is None else x, K, key[1]))
    return plan


def plan_key(memo_key: int, K) -> tuple:
    """What a memoized plan depends on besides the problem's metadata: threads and the tuning constants."""
    return (memo_key,) + tuning(K)


def tuning(K) -> tuple:
    return (max(1, torch.get_num_threads()), MIN_SPLIT, ITEMS_PER_THREAD, CHUNK_FLOATS, PARALLEL_MIN_WORK, PREFIX_ROWS,
            PREFETCH_MIN_BYTES, PARALLEL_MIN_BYTES, K.DP_FLAGS)


def _plan(p: AttentionProblem, x: Inputs, K, threads: int) -> Plan:
    B, H, G, QS, Dv = p.B, p.KV_N, p.G, p.Q_S, p.Dv
    R0 = G * QS
    P = 0 if p.prefix is None else p.prefix.length
    q, qr = x.q, x.qr
    D = q.shape[-1]
    Dr = 0 if qr is None else qr.shape[-1]

    # ---- per-batch geometry: query window, effective keys, band, column offset, query row base
    has_band = p.mask.kind == "band"
    qst, qrst = q.stride(), (qr.stride() if qr is not None else (0,) * q.dim())
    if p.packed:                                  # [N, T, D]: batch b starts at row q_offset
        q_sn, q_ss, qr_sn, qr_ss = qst[0], qst[1], qrst[0], qrst[1]
        q_sb, qr_sb = q_ss, qr_ss
    else:                                         # [B, N, Q_S, D]
        q_sn, q_ss, qr_sn, qr_ss = qst[1], qst[2], qrst[1], qrst[2]
        q_sb, qr_sb = qst[0], qrst[0]
    geo, lens, kv_lo, keys_total = _geometry(p, P, q_sb, qr_sb)

    ip = [0] * K.IP_LEN
    ip[K.IP_R0], ip[K.IP_BPG], ip[K.IP_R], ip[K.IP_B] = R0, 1, R0, B
    ip[K.IP_G], ip[K.IP_QS], ip[K.IP_H] = G, QS, H
    ip[K.IP_D], ip[K.IP_DR], ip[K.IP_DV] = D, Dr, Dv
    bpg, ng = _prefix_groups(p) if P > 0 else (1, 0)
    C = _chunk(D + Dr, Dv, max(R0, bpg * R0))
    ip[K.IP_C] = C
    ip[K.IP_DP] = K.DP_FLAGS
    ip[K.IP_Q_KIND], ip[K.IP_Q_SN], ip[K.IP_Q_SS] = kind_of(q), q_sn, q_ss
    if qr is not None:
        ip[K.IP_QR_KIND], ip[K.IP_QR_SN], ip[K.IP_QR_SS] = kind_of(qr), qr_sn, qr_ss
    if x.qds is not None:                         # indexed by the batch's own row
        st = x.qds.stride()
        ip[K.IP_QD], ip[K.IP_QD_SB], ip[K.IP_QD_SN], ip[K.IP_QD_SS] = 1, st[0], st[1], st[2]
    kc_mode, v_chan = (0, 0) if p.antiquant is None else chan_modes(p.antiquant)
    ip[K.IP_KC_MODE] = kc_mode

    # ---- pse / mask, physical coordinates
    ip[K.IP_PSE_KIND] = -1
    if x.pse is not None:
        st = x.pse.stride()
        ip[K.IP_PSE_KIND] = kind_of(x.pse)
        ip[K.IP_PSE_B] = st[0] if x.pse.shape[0] > 1 else 0
        ip[K.IP_PSE_N], ip[K.IP_PSE_S], ip[K.IP_PSE_K] = st[1], st[2], st[3]
    um = x.mask
    if um is not None:
        st = um.stride()
        ip[K.IP_MASK], ip[K.IP_M_B], ip[K.IP_M_S], ip[K.IP_M_K] = 1, (st[0] if um.shape[0] > 1 else 0), st[1], st[2]
    ip[K.IP_BAND] = int(has_band)
    want_any = int(p.row_invalid_fix and (um is not None or has_band) and p.sink is None)
    ip[K.IP_WANT_ANY] = want_any

    # ---- own keys: work entries (batch, key range) x KV heads, HB heads per item
    hb = _heads_per_item(x.sources, H)
    ip[K.IP_HB] = hb
    work, wrange = K.split_work(lens, kv_lo, H // hb, threads, C, MIN_SPLIT, ITEMS_PER_THREAD)
    W = work.shape[1]
    ip[K.IP_COL_BASE] = P
    own = []
    for src in x.sources:
        w0, w1 = src.entries(work, wrange)
        keys = keys_total if src.batch is None else int(lens[src.batch])
        wk = work if (w0, w1) == (0, W) else np.ascontiguousarray(work[:, w0:w1])
        own.append(_launch_plan(src, ip, K, wk, w0, w1, H, R0, threads, keys, _pv_dp(p)) if w1 > w0 else None)

    # ---- shared prefix: batches grouped, the prefix read once per group (SPEC 7)
    prefix, pwrange, Rp = None, np.ascontiguousarray(wrange[:, :1]), R0     # (one kernel layout: C)
    if P > 0:
        Rp = bpg * R0
        phb = _heads_per_item((x.prefix,), H)
        pwork, pwrange = K.split_work(np.full(ng, P, np.int64), np.zeros(ng, np.int64), H // phb, threads, C,
                                      MIN_SPLIT, ITEMS_PER_THREAD)
        ipp = list(ip)                            # (the prefix source sets its own source ints)
        ipp[K.IP_BPG], ipp[K.IP_R], ipp[K.IP_HB] = bpg, Rp, phb
        ipp[K.IP_COL_BASE], ipp[K.IP_PREFIX_PASS] = 0, 1
        prefix = _launch_plan(x.prefix, ipp, K, pwork, 0, pwork.shape[1], H, Rp, threads, ng * P, _pv_dp(p))

    # ---- merge: splits + prefix + sink, normalization, value dequant, special rows; the output is
    # written in its final layout and dtype, so the shared epilogue has nothing to copy
    out_dtype = torch.float32 if p.out_quant is not None else p.out_dtype     # int8 output: the epilogue quantizes
    shape, perm, obase, ost = _out_layout(p)
    okind = 0 if out_dtype == torch.float32 else KINDS[out_dtype]
    lst = (p.T, 1) if p.packed else (QS, 1)
    mp = np.array([B, G, QS, H, int(P > 0), int(p.sink is not None), v_chan, want_any, bpg, int(has_band),
                   ost[0], ost[1], lst[0], lst[1], okind], np.int64)
    out_bytes = math.prod(shape) * out_dtype.itemsize
    size = shape if perm is None else tuple(shape[i] for i in perm)
    return Plan(np.array([p.scale], np.float64), geo, W, wrange, own, prefix, Rp, pwrange, mp, obase, size,
                 tuple(_view_strides(shape, perm)), out_dtype, out_bytes)


def _geometry(p: AttentionProblem, P: int, q_sb: int, qr_sb: int):
    """geo [GEO_LEN, B] (GEO_* rows), own keys [B] and their first position [B], all own keys: one pass
    over the batches. q_sb / qr_sb: elements between batches (packed: between rows, times q_offset)."""
    band = p.mask.band_for if p.mask.kind == "band" else None
    packed = p.packed
    rows = []
    for b, g in enumerate(p.geometry):
        s1, s2 = g.s1, g.s2
        pre, nxt = band(s1, s2) if band is not None else (0, 0)
        r = g.q_offset if packed else b
        rows.append((g.q_lo, g.q_hi, s2, pre, nxt, P - g.kv_lo, r * q_sb, r * qr_sb,
                     (g.kv_hi - g.kv_lo) if s1 > 0 else 0, g.kv_lo))
    a = np.array(rows, np.int64).reshape(-1, 10).T.copy()       # (C-contiguous rows: the kernels' layout)
    return a[:8], a[8], a[9], sum(r[8] for r in rows)


def _heads_per_item(sources, H: int) -> int:
    """KV heads per item (kernels.IP_HB): all H when every source's key and value hold a token's rows
    of all heads side by side (BSH / BSND, the paged [blocks, block_size, H] cache: one head's rows alone are
    D elements every H x D or more, which the CPU does not stream -- kernels.DP_TOUCH), else 1."""
    if H < 2:
        return 1
    for src in sources:
        if src.rope is not None:
            return 1
        for t in (src.key, src.value):
            _, sh, ss = src.strides(t)
            if sh != t.shape[-1] or ss < H * sh:
                return 1
    return H


def _launch_plan(src: Source, ip: list, K, work: np.ndarray, w0: int, w1: int, H: int, R: int, threads: int,
                 keys: int, pv: bool = True) -> Launch:
    """A source's launch: the shared int parameters (in ip) with the source's own; the items w * (H / HB) + h /
    HB in the order the threads take them. Threaded: longest first; small work (keys x H x R <
    PARALLEL_MIN_WORK) stays on the calling thread."""
    src.ints(ip, K)
    key_bytes = _key_bytes(K, ip)
    ip[K.IP_DP] = _dp_flags(K, key_bytes, keys, H, pv)
    items, t = _schedule(K, work, H, R, threads, keys, ip[K.IP_HB], key_bytes)
    return Launch(np.array(ip, np.int64), work, w0, w1, items, t, src.generic(bool(ip[K.IP_DP] & K.DP_F32)),
                  key_bytes)


def _key_bytes(K, ip) -> float:
    """Bytes per key and KV head of a launch's K / V (and rope), from the kinds and head dims in ip."""
    return float(sum(int(ip[d]) * KIND_BYTES[int(ip[kind])]
                     for d, kind in ((K.IP_D, K.IP_K_KIND), (K.IP_DV, K.IP_V_KIND), (K.IP_DR, K.IP_R_KIND))))


def _pv_dp(p: AttentionProblem) -> bool:
    """Whether P.V may take the bf16 dp kernels (P rounded to bf16, DECISIONS 23): not when the output is
    quantized -- int8 codes come from the float32 result (SPEC 12, DECISIONS 44)."""
    return p.out_quant is None


def _dp_flags(K, key_bytes: float, keys: int, H: int, pv: bool = True, small: bool = True) -> int:
    """ip[IP_DP] of a launch over `keys` keys x H KV heads of key_bytes each (_key_bytes): DP_FLAGS (without
    DP_PV unless `pv`), without the prefetch bits when it reads at most PREFETCH_MIN_BYTES of K / V (and `small`)."""
    flags = K.DP_FLAGS if pv else K.DP_FLAGS & ~K.DP_PV
    if small and keys * H * key_bytes <= PREFETCH_MIN_BYTES:
        return flags & ~(K.DP_PREFETCH_BITS | K.DP_TOUCH)
    return flags


def _schedule(K, work: np.ndarray, H: int, R: int, threads: int, keys: int, hb: int = 1, key_bytes: float = 0.0):
    """(items in the order the threads take them, threads) of work entries x H KV heads of R rows, hb heads
    per item, key_bytes of K / V per key and KV head (kernels.schedule). One thread for small work
    (PARALLEL_MIN_WORK, PARALLEL_MIN_BYTES)."""
    return K.schedule(work, H // hb, H, R, threads, keys, float(key_bytes), PARALLEL_MIN_WORK, PARALLEL_MIN_BYTES)


def relength(plan: Plan, p: AttentionProblem, kv_lens: np.ndarray, K, threads: int, ip_set: tuple = ()):
    """plan (p's: one dense KV source serving every work entry, right-padded keys, no shared prefix, no band)
    for other KV lengths kv_lens [B] of the same metadata -- what _plan gives for p with those lengths,
    rebuilding only the parts they shape (kernels.replan, one dispatch): the geometry's key count row (as
    _geometry: s2 = the batch's keys), the own keys, work split, item schedule (tests/interfaces/test_replay.py
    compares the two). ip_set: (index, value) pairs of int parameters to set as well (a growing cache's strides).
    None where no work entry is left (the full path handles it)."""
    launch = plan.own[0]
    ip = launch.ip
    hb = int(ip[K.IP_HB])
    geo, work, wrange, items, t, keys = K.replan(
        plan.geo, kv_lens, p.KV_N // hb, threads, int(ip[K.IP_C]), MIN_SPLIT, ITEMS_PER_THREAD, p.KV_N,
        p.G * p.Q_S, launch.key_bytes, PARALLEL_MIN_WORK, PARALLEL_MIN_BYTES)
    W = work.shape[1]
    if W == 0:
        return None
    flags = _dp_flags(K, launch.key_bytes, keys, p.KV_N, _pv_dp(p))
    if flags != ip[K.IP_DP] or ip_set:            # (the prefetch choice follows the bytes read)
        ip = ip.copy()
        ip[K.IP_DP] = flags
        for i, x in ip_set:
            ip[i] = x
    return plan._replace(geo=geo, W=W, wrange=wrange, pwrange=np.ascontiguousarray(wrange[:, :1]),
                         own=[launch._replace(ip=ip, work=work, w0=0, w1=W, items=items, threads=t)])


def lengths_params(plan: Plan, p: AttentionProblem, K, threads: int) -> np.ndarray:
    """lp int64 [LP_LEN]: what attend_merge reads to re-plan a lengths replay's single-threaded call itself (kernels'
    LP_*), relength's constants -- the lengths it is given make what relength makes of them."""
    launch = plan.own[0]
    lp = np.zeros(K.LP_LEN, np.int64)
    lp[K.LP_NG], lp[K.LP_THREADS] = p.KV_N // int(launch.ip[K.IP_HB]), threads
    lp[K.LP_MIN_SPLIT], lp[K.LP_PER_THREAD], lp[K.LP_H], lp[K.LP_R] = MIN_SPLIT, ITEMS_PER_THREAD, p.KV_N, p.G * p.Q_S
    lp[K.LP_MIN_WORK], lp[K.LP_MIN_BYTES] = PARALLEL_MIN_WORK, PARALLEL_MIN_BYTES
    lp[K.LP_FLAGS] = _dp_flags(K, launch.key_bytes, 0, p.KV_N, _pv_dp(p), small=False)
    lp[K.LP_FLAGS_SMALL] = _dp_flags(K, launch.key_bytes, 0, p.KV_N, _pv_dp(p))
    lp[K.LP_PREFETCH_MIN] = PREFETCH_MIN_BYTES
    return lp


def _out_layout(p: AttentionProblem):
    """The output as allocated (in the output layout) and its canonical view: (shape, permutation to the
    canonical view or None, per-batch row bases / existing rows [3, B], (head, row) strides)."""
    if not p.packed:
        return _padded_out_layout(p.layout.out, p.B, p.N, p.Q_S, p.Dv)
    N, Dv, geom = p.N, p.Dv, p.geometry
    shape, perm = ((p.T, N, Dv), (1, 0, 2)) if p.layout.out == "TND" else ((N, p.T, Dv), None)
    st = _view_strides(shape, perm)
    obase = np.array([[g.q_offset * st[1] for g in geom], [g.q_offset for g in geom],
                      [g.q_rows for g in geom]], np.int64)
    return shape, perm, obase, (st[0], st[1])


@caches.memoize("decode.out_layouts", 256)
def _padded_out_layout(lay: str, B: int, N: int, QS: int, Dv: int):
    """_out_layout of [B, N, Q_S, Dv] outputs (a function of these alone; obase is only read)."""
    if lay in ("BSH", "BSND"):
        shape, perm = (B, QS, N, Dv), (0, 2, 1, 3)
    elif lay == "NBSD":
        shape, perm = (N, B, QS, Dv), (1, 0, 2, 3)
    else:
        shape, perm = (B, N, QS, Dv), None
    st = _view_strides(shape, perm)
    obase = np.array([[b * st[0] for b in range(B)], [b * N * QS for b in range(B)], [QS] * B], np.int64)
    return shape, perm, obase, (st[1], st[2])


def _view_strides(shape: tuple, perm: Optional[tuple]):
    """Strides of a contiguous tensor of `shape`, permuted by perm (None: as is)."""
    st = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        st[i - 1] = st[i] * shape[i]
    return st if perm is None else [st[i] for i in perm]



def _chunk(dq: int, dv: int, rows: int) -> int:
    """Keys per chunk: CHUNK_FLOATS // head dim, at most 16384 // rows (the [rows, C] score block stays
    in L2), a multiple of 4 in [8, 256]."""
    c = min(CHUNK_FLOATS // max(dq, dv, 1), 16384 // max(rows, 1))
    return int(max(8, min(256, c - c % 4)))
