"""Split-KV work and the merge: split_work cuts each group's keys into work entries for the threads; merge combines
the partials of every row through their LSEs (split KV, shared prefix, learnable sink), normalizes, dequantizes
per-channel V and stores the output in its dtype; attend_merge runs a single-threaded call (items then merge) in one
dispatch.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ....cpu.numerics import FM, buf_bytes, buf_f32, f32_as_u32, f32_to_bf16_bits, f32_to_half_bits
from ....cpu.simd import KIND_BF16
from ....cpu import kernel_cache
from .items import attend_items
from .params import (BUF_K, BUF_Q, BUF_V, GEO_NEXT, GEO_PRE, GEO_QHI, GEO_QLO, GEO_S2, IP_C, IP_DP, LA_DIMS,
                     LA_GEO, LA_IP, LA_ITEMS, LA_LP, LA_MP, LA_OBASE, LA_PWRANGE, LA_UNITS, LA_WORK, LA_WRANGE,
                     LP_FLAGS, LP_FLAGS_SMALL, LP_H, LP_MIN_BYTES, LP_MIN_SPLIT, LP_MIN_WORK, LP_NG, LP_PER_THREAD,
                     LP_PREFETCH_MIN, LP_R, LP_THREADS)

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


@njit(nogil=True, cache=True)
def split_work(lens, lo, H, threads, C, min_split, per_thread):
    """Work entries [3, W] (group, lo, hi) covering [lo_i, lo_i + lens_i) of every group i, and
    wrange [2, NI] (first entry, end) per group. Sequences longer than the split length L are cut so
    that there are about `per_thread` items (entries x KV heads) per thread; L is a multiple of C."""
    ni = lens.shape[0]
    total = 0
    for i in range(ni):
        total += lens[i]
    wrange = np.zeros((2, ni), np.int64)
    if total <= 0:
        return np.zeros((3, 0), np.int64), wrange
    L = max(min_split, -(-(H * total) // (threads * per_thread)))
    L = -(-L // C) * C
    W = 0
    for i in range(ni):
        if lens[i] > 0:
            W += -(-lens[i] // L)
    work = np.empty((3, W), np.int64)
    w = 0
    for i in range(ni):
        wrange[0, i] = w
        p = lo[i]
        end = lo[i] + lens[i]
        while p < end:
            work[0, w] = i
            work[1, w] = p
            work[2, w] = min(p + L, end)
            p += L
            w += 1
        wrange[1, i] = w
    return work, wrange


@njit(nogil=True, cache=True)
def schedule(work, ng, H, R, threads, keys, key_bytes, min_work, min_bytes):
    """(items in the order the threads take them, threads) of work entries x ng item groups (KV heads / heads per
    item), H KV heads of R rows, key_bytes of K / V per key and KV head. One thread for small work: keys x H x R
    below min_work, or at most min_bytes of K / V below 16 x min_work; else the longest items first."""
    n = work.shape[1] * ng
    t = min(threads, n)
    rows_work = keys * H * R
    if t <= 1 or rows_work < min_work or (keys * H * key_bytes <= min_bytes and rows_work < 16 * min_work):
        return np.arange(n), 1
    return np.argsort(-np.repeat(work[2] - work[1], ng), kind="mergesort"), t


@njit(nogil=True, cache=True)
def replan(geo0, kv_lens, ng, threads, C, min_split, per_thread, H, R, key_bytes, min_work, min_bytes):
    """A lengths replay's re-plan (plan.relength) in one dispatch: the geometry with kv_lens [B] as the batches'
    keys, and the work split and item schedule they make (split_work, schedule) -> (geo, work, wrange, items,
    threads, keys)."""
    geo = geo0.copy()
    B = kv_lens.shape[0]
    lens = np.zeros(B, np.int64)
    keys = 0
    for b in range(B):
        geo[GEO_S2, b] = kv_lens[b]
        if geo[GEO_QHI, b] > geo[GEO_QLO, b]:                 # batches without query rows: no keys
            lens[b] = kv_lens[b]
            keys += kv_lens[b]
    work, wrange = split_work(lens, np.zeros(B, np.int64), ng, threads, C, min_split, per_thread)
    items, t = schedule(work, ng, H, R, threads, keys, key_bytes, min_work, min_bytes)
    return geo, work, wrange, items, t, keys


@njit(fastmath=FM, cache=True, inline="always")
def _partials_max(pm, pl, w0, w1, h, r, M):
    """max(M, the maxima of the non-empty partials w0 <= w < w1 of row r, head h); NaN wins."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            x = pm[w, h, r]
            if x > M or x != x:
                M = x
    return M


@njit(fastmath=FM, cache=True, inline="always")
def _partials_sum(pm, pl, pany, w0, w1, h, r, M, lk, seen):
    """The sum of weights lk of the partials w0 <= w < w1 of row r, head h, rescaled to the maximum M, and whether
    any of them saw an unmasked key (seen), continued from the given ones."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            lk += lw * np.float32(np.exp(pm[w, h, r] - M))
        if pany[w, h, r] != 0:
            seen = 1
    return lk, seen


@njit(fastmath=FM, cache=True, inline="always")
def _partials_add(po, pm, pl, w0, w1, h, r, M, inv, o, Dv):
    """o[:Dv] += the partials w0 <= w < w1 of row r, head h, rescaled to the maximum M and divided by the total
    sum of weights (times inv = 1 / it): normalized as they are added, a V near float32's maximum does not overflow."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            f = np.float32(np.exp(pm[w, h, r] - M)) * inv
            for d in range(Dv):
                o[d] += po[w, h, r, d] * f


@njit(nogil=True, fastmath=FM, cache=True)
def merge(mp, geo, po, pm, pl, pany, wrange, ppo, ppm, ppl, ppany, pwrange, sink, vcs, vco, obase, obufs):
    """Combine the partials of every row; normalize; dequantize per-channel V; special rows.

    mp: int64 [B, G, Q_S, KV_N, has_prefix, has_sink, v_chan (0 none, 1 scale, 2 scale+offset),
               row_fix (a row whose every key is masked is dead), prefix batches per group, has_band].
    geo: the per-batch geometry (GEO_* rows). po/pm/pl/pany: own-key partials [W, KV_N, R(, Dv)];
    wrange [2, B]: work entries of batch b. ppo/...: prefix partials [Wp, KV_N, Rp(, Dv)], pwrange
    [2, groups]. sink [N] float32. vcs/vco [KV_N, Dv].
    Output written in place, in the output layout and dtype (no epilogue copy): obufs [2, 2] holds
    (address, bytes) of the output tensor (column 0) and the float32 lse (column 1); row s of head n
    of batch b starts at element
    obase[0, b] + n * mp[10] + s * mp[11] of out and obase[1, b] + n * mp[12] + s * mp[13] of lse;
    rows s >= obase[2, b] do not exist (packed layouts); mp[14]: 0 float32, 1 bf16, 2 fp16 output.
    A row is computed when it lies inside the query window, its batch has keys and the band leaves it
    a key; every other row is 0 with lse +inf (SPEC 4, 6).
    Returns 1 when a computed row's output or lse is a NaN or an infinity (the caller then answers with the
    reference's numbers, DECISIONS 52), else 0.
    """
    B = mp[0]
    G = mp[1]
    QS = mp[2]
    H = mp[3]
    has_prefix = mp[4]
    has_sink = mp[5]
    v_chan = mp[6]
    row_fix = mp[7]
    pbpg = mp[8]
    has_band = mp[9]
    R = G * QS
    Dv = po.shape[3]
    o_sn = mp[10]
    o_ss = mp[11]
    l_sn = mp[12]
    l_ss = mp[13]
    okind = mp[14]
    out = buf_bytes(obufs, 0)
    lse = buf_f32(obufs, 1)
    nb = out.shape[0]
    of = out[:nb - nb % 4].view(np.float32)
    oh = out[:nb - nb % 2].view(np.uint16)
    o = np.empty(Dv, np.float32)
    bad = 0
    for it in range(B * H):
        b = it // H
        h = it % H
        for r in range(R):
            g = r // QS
            si = r - g * QS
            n = h * G + g
            if si >= obase[2, b]:
                continue
            ob = obase[0, b] + n * o_sn + si * o_ss
            lb = obase[1, b] + n * l_sn + si * l_ss
            ok = si >= geo[GEO_QLO, b] and si < geo[GEO_QHI, b] and geo[GEO_S2, b] > 0
            if ok and has_band != 0:
                il = si - geo[GEO_QLO, b]
                jlo = max(0, il - geo[GEO_PRE, b])
                jhi = min(geo[GEO_S2, b] - 1, il + geo[GEO_NEXT, b])
                ok = jlo <= jhi
            if not ok:
                for d in range(Dv):
                    o[d] = 0.0
                _store(of, oh, okind, ob, o, Dv)
                lse[lb] = np.inf
                continue
            # the running maximum over every non-empty partial (and the sink)
            M = _partials_max(pm, pl, wrange[0, b], wrange[1, b], h, r, -np.inf)
            gi = 0
            rp = 0
            if has_prefix != 0:
                gi = b // pbpg
                rp = (b - gi * pbpg) * R + r
                M = _partials_max(ppm, ppl, pwrange[0, gi], pwrange[1, gi], h, rp, M)
            sk = np.float32(0.0)
            if has_sink != 0:
                sk = sink[n]
                if sk > M:
                    M = sk
            for d in range(Dv):
                o[d] = 0.0
            lk, seen = _partials_sum(pm, pl, pany, wrange[0, b], wrange[1, b], h, r, M, np.float32(0.0), 0)
            if has_prefix != 0:
                lk, seen = _partials_sum(ppm, ppl, ppany, pwrange[0, gi], pwrange[1, gi], h, rp, M, lk, seen)
            if row_fix != 0 and seen == 0 and has_sink == 0:
                for d in range(Dv):
                    o[d] = 0.0
                _store(of, oh, okind, ob, o, Dv)
                lse[lb] = np.inf
                continue
            lt = lk
            if has_sink != 0:
                lt = lk + np.float32(np.exp(sk - M))
            inv = np.float32(1.0) / lt
            _partials_add(po, pm, pl, wrange[0, b], wrange[1, b], h, r, M, inv, o, Dv)
            if has_prefix != 0:
                _partials_add(ppo, ppm, ppl, pwrange[0, gi], pwrange[1, gi], h, rp, M, inv, o, Dv)
            if v_chan == 1:
                for d in range(Dv):
                    o[d] = o[d] * vcs[h, d]
            elif v_chan == 2:
                lw = lk * inv                                 # (the own and prefix keys' share of the weights)
                for d in range(Dv):
                    o[d] = (o[d] + vco[h, d] * lw) * vcs[h, d]
            _store(of, oh, okind, ob, o, Dv)
            lv = M + np.float32(np.log(lt))
            lse[lb] = lv
            bad |= _non_finite(o, Dv) | _nf(lv)
    return bad


@njit(cache=True, inline="always")
def _nf(x):
    """1 when float32 x is a NaN or an infinity (its exponent bits all set: whatever the fast-math flags)."""
    return int((f32_as_u32(np.float32(x)) & np.uint32(0x7F800000)) == np.uint32(0x7F800000))


@njit(cache=True, inline="always")
def _non_finite(o, Dv):
    """1 when o[:Dv] holds a NaN or an infinity."""
    bad = 0
    for d in range(Dv):
        bad |= _nf(o[d])
    return bad


@njit(fastmath=FM, cache=True, inline="always")
def _store(of, oh, okind, ob, o, Dv):
    """One output row: float32, or rounded to bf16 / fp16 (round to nearest even, like torch)."""
    if okind == 0:
        for d in range(Dv):
            of[ob + d] = o[d]
    elif okind == KIND_BF16:
        for d in range(Dv):
            oh[ob + d] = f32_to_bf16_bits(o[d])
    else:
        for d in range(Dv):
            oh[ob + d] = f32_to_half_bits(o[d])


@njit(nogil=True, cache=True, inline="always")
def _part(L, i):
    """Part i (LA_*) of a launch array, 1-D."""
    o = L[3 * i]
    return L[o:o + L[3 * i + 1] * L[3 * i + 2]]


@njit(nogil=True, cache=True, inline="always")
def _part2(L, i):
    """Part i (LA_*) of a launch array, [rows, columns]."""
    o = L[3 * i]
    return L[o:o + L[3 * i + 1] * L[3 * i + 2]].reshape((L[3 * i + 1], L[3 * i + 2]))


@njit(nogil=True, cache=True)
def attend_merge(L, fp, kv_lens, kv_s, key_bytes, tbl, bufs0, kchan, kt_tbl, vt_tbl, generic, sink, vcs, vco, stats,
                 q_addr, k_addr, v_addr, k_bytes, v_bytes, out_addr, lse_addr):
    """A single-threaded call without a prefix (fia.replay): attend_items on the calling thread, then merge, in
    one dispatch -- the partials [W, KV_N, R(, Dv)] (dims = W, KV_N, R, Dv, output bytes, lse bytes), the
    counter and obufs made here. On a small call each numba dispatch, each argument it unboxes and each numpy
    allocation costs the host microseconds (the benchmark's small call; a layer's call inside a model). L: the
    launch (LA_* parts: items, ip, geo, work, mp, wrange, pwrange, obase, dims, lp, units); bufs0: the buffer
    table but for the query, key and value, whose addresses (and, k_bytes >= 0, K / V spans) each call brings.
    Returns merge's non-finite flag.

    kv_lens [B] (a lengths replay's call; empty: the plan as given): the plan is first re-made for these KV
    lengths as plan.relength makes it (replan; lp: its parameters, LP_*; key_bytes: the launch's; units [n, 2]:
    int parameters set to units x kv_s, a growing cache's strides). Returns -1 without running anything where
    the lengths take a threaded launch or leave no work (the caller's relength path)."""
    items, ip, geo, work = _part(L, LA_ITEMS), _part(L, LA_IP), _part2(L, LA_GEO), _part2(L, LA_WORK)
    mp, wrange, pwrange, obase = _part(L, LA_MP), _part2(L, LA_WRANGE), _part2(L, LA_PWRANGE), _part2(L, LA_OBASE)
    dims = _part(L, LA_DIMS)
    if kv_lens.shape[0] > 0:
        lp = _part(L, LA_LP)
        geo, work, wrange, items, t, keys = replan(
            geo, kv_lens, lp[LP_NG], lp[LP_THREADS], ip[IP_C], lp[LP_MIN_SPLIT], lp[LP_PER_THREAD], lp[LP_H],
            lp[LP_R], key_bytes, lp[LP_MIN_WORK], lp[LP_MIN_BYTES])
        if t != 1 or work.shape[1] == 0:
            return -1
        ip = ip.copy()
        ip[IP_DP] = lp[LP_FLAGS] if keys * lp[LP_H] * key_bytes > lp[LP_PREFETCH_MIN] else lp[LP_FLAGS_SMALL]
        units = _part2(L, LA_UNITS)
        for i in range(units.shape[0]):
            ip[units[i, 0]] = units[i, 1] * kv_s
        pwrange = wrange[:, :1].copy()
        dims = dims.copy()
        dims[0] = work.shape[1]
    bufs = bufs0.copy()
    bufs[0, BUF_Q], bufs[0, BUF_K], bufs[0, BUF_V] = q_addr, k_addr, v_addr
    if k_bytes >= 0:
        bufs[1, BUF_K], bufs[1, BUF_V] = k_bytes, v_bytes
    W = max(dims[0], 1)
    po = np.empty((W, dims[1], dims[2], dims[3]), np.float32)
    pm = np.empty((W, dims[1], dims[2]), np.float32)
    pl = np.zeros((W, dims[1], dims[2]), np.float32)
    pany = np.zeros((W, dims[1], dims[2]), np.uint8)
    counter = np.zeros(1, np.int64)
    attend_items(items, counter, ip, fp, geo, work, tbl, bufs, kchan, kt_tbl, vt_tbl, po, pm, pl, pany, generic,
                 stats)
    obufs = np.empty((2, 2), np.int64)
    obufs[0, 0] = out_addr
    obufs[0, 1] = lse_addr
    obufs[1, 0] = dims[4]
    obufs[1, 1] = dims[5]
    return merge(mp, geo, po, pm, pl, pany, wrange, po, pm, pl, pany, pwrange, sink, vcs, vco, obase, obufs)
