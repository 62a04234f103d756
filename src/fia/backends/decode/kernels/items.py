"""The decode item driver: one thread claims items (work entry, group of KV heads) and streams each item's keys in
chunks through the stages -- query rows, gather (rows.py), QK (the micro-kernels or generic.py), score terms
(dequant.py's per-token factors, pse, mask, band), softmax (softmax.py), PV, the two-level sums -- into an
unnormalized partial (acc, running max, sum of weights) that merge.py combines.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from ....cpu.amx import QK_MAX_ROWS, pv_amx, qk_amx
from ....cpu.fma import KIND_BF16_EO, pv_fma, qk_fma
from ....cpu.numerics import (FM, addr_ptr, alive, bf16_to_f32, buf_bytes, buf_f32, claim, fetch_add, fp16_to_f32,
    unowned)
from ....cpu.simd import KIND_BF16, KIND_F32, KIND_FP16, KIND_I8, PF_AHEAD, PF_NTA, pv_dp, qk_dp
from ....cpu.vnni import pv_i8, qk_i8
from ....cpu import kernel_cache
from .dequant import (_i8_tokens_ok, exact_key_tokens, exact_value_tokens, exceptional, request_tokens,
                      token_scales)
from .generic import pv_block, pv_fused, qk_block, qk_fused
from .params import (AHEAD_BYTES, BUF_K, BUF_KTO, BUF_KTS, BUF_MASK, BUF_PSE, BUF_Q, BUF_QDS, BUF_QR, BUF_R, BUF_V,
    BUF_VTO, BUF_VTS, EO_GROUP, FP4_SUB, GEO_JOFS, GEO_NEXT, GEO_PRE, GEO_QBASE, GEO_QHI, GEO_QLO, GEO_QRBASE,
    I8_QK_MAX_ERR, IP_B, IP_BAND, IP_BPG, IP_BS, IP_C, IP_COL_BASE, IP_D, IP_DR, IP_DV, IP_G, IP_H, IP_HB, IP_KC_MODE,
    IP_KT_BLK, IP_KT_BS, IP_KT_H, IP_KT_MODE, IP_KT_S, IP_K_BLK, IP_K_FS, IP_K_FW, IP_K_H, IP_K_KIND, IP_K_S, IP_MASK,
    IP_M_B, IP_M_K, IP_M_S, IP_PREFIX_PASS, IP_PSE_B, IP_PSE_K, IP_PSE_KIND, IP_PSE_N, IP_PSE_S, IP_QD, IP_QD_SB,
    IP_QD_SN, IP_QD_SS, IP_QR_KIND, IP_QR_SN, IP_QR_SS, IP_QS, IP_Q_KIND, IP_Q_SN, IP_Q_SS, IP_R, IP_R0, IP_R_BLK,
    IP_R_FS, IP_R_FW, IP_R_H, IP_R_KIND, IP_R_S, IP_VT_BLK, IP_VT_BS, IP_VT_H, IP_VT_MODE, IP_VT_S, IP_V_BLK, IP_V_FS,
    IP_V_FW, IP_V_H, IP_V_KIND, IP_V_S, IP_WANT_ANY, KF_AHEAD_K, KF_AHEAD_V, KF_AMX_PV, KF_AMX_QK, KF_DP_PV, KF_DP_QK,
    KF_EO_PV, KF_EO_QK, KF_FMA_PV, KF_FMA_QK, KF_I8_PV, KF_I8_QK, KF_NTA, KF_PREFETCH, KF_PV_K, KF_TOUCH, KIND_FP4,
    MASK_FILL, kernel_flags)
from .rows import elem_layout, eo_rows, fp4_rows, load_rows, nz_lines, nz_pack, row_offsets, touch_rows, views
from .softmax import drain_block, drain_chunk, quant_i16, softmax_chunk

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


@njit(fastmath=FM, cache=True, inline="always")
def _layout(ip, kf_, kbuf, vbuf, HB, D, Dv, kc_mode):
    """The launch's K / V layout: NZ fragments, bytes per element and row, the other stream's prefetch hints,
    token-factor modes. Scalars only: an array returned by an inline stage is reference-counted in every chunk."""
    # NZ sources: each chunk's rows are packed into kscr / vscr / rscr (nz_pack) and read there; the other stream's
    # prefetch rows are the chunk's fragment runs (nz_lines), the kernels' own rows ahead are off (in scratch)
    k_fs = ip[IP_K_FS]
    v_fs = ip[IP_V_FS]
    r_fs = ip[IP_R_FS]
    # value and key the same NZ cache (MLA callers pass the latent cache as both): V reuses K's packed rows
    kv_same = (kbuf.ctypes.data == vbuf.ctypes.data and k_fs == v_fs and D == Dv and ip[IP_K_KIND] == ip[IP_V_KIND]
               and ip[IP_K_BLK] == ip[IP_V_BLK] and ip[IP_K_H] == ip[IP_V_H] and ip[IP_K_S] == ip[IP_V_S]
               and ip[IP_K_FW] == ip[IP_V_FW])
    k_blk = ip[IP_K_BLK]
    k_h = ip[IP_K_H]
    k_s = ip[IP_K_S]
    k_kind = ip[IP_K_KIND]
    r_blk = ip[IP_R_BLK]
    r_h = ip[IP_R_H]
    r_s = ip[IP_R_S]
    r_kind = ip[IP_R_KIND]
    v_blk = ip[IP_V_BLK]
    v_h = ip[IP_V_H]
    v_s = ip[IP_V_S]
    v_kind = ip[IP_V_KIND]
    k_es, k_row = elem_layout(k_kind, D)              # bytes per element, elements per row (prefetching)
    v_es, v_row = elem_layout(v_kind, Dv)
    k_span = ((HB - 1) * k_h + k_row) * k_es          # bytes of a token's rows of an item's heads (DP_TOUCH)
    v_span = ((HB - 1) * v_h + v_row) * v_es
    k_es_ = k_es
    v_es_ = v_es
    # the other-stream prefetch hints: the K row size and hints travel to PV, the V ones to QK
    if (kf_ & KF_NTA) != 0:                            # prefetchnta instead of t1 (see DP_NTA)
        k_es += PF_NTA
        v_es += PF_NTA
    if (kf_ & KF_AHEAD_K) != 0 and k_fs == 0:                        # QK's own K rows ahead (see DP_AHEAD)
        v_es += PF_AHEAD * min(63, max(1, AHEAD_BYTES // ((k_es & 255) * k_row)))
    if (kf_ & KF_AHEAD_V) != 0 and v_fs == 0:                        # PV's own V rows ahead
        k_es += PF_AHEAD * min(63, max(1, AHEAD_BYTES // ((v_es & 255) * v_row)))
    kt_mode = ip[IP_KT_MODE] if k_kind != KIND_FP4 else 0   # FP4: the KT / VT slots hold the group scales
    vt_mode = ip[IP_VT_MODE] if v_kind != KIND_FP4 else 0   # (applied by fp4_rows, not per token)
    return (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind,
            k_es, v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode)


@njit(fastmath=FM, cache=True, inline="always")
def _reset_item(po, pm, pl, pany, cll, cvx, cacc, w, h0, HB, R, Dv):
    """Zero the partials of the item's heads and the sums of its current block of chunks."""
    for h in range(h0, h0 + HB):
        acc = po[w, h]                                     # [R, Dv]
        m = pm[w, h]                                       # [R]
        ll = pl[w, h]                                      # [R]
        anyu = pany[w, h]                                  # [R]
        for r in range(R):
            m[r] = -np.inf
            ll[r] = 0.0
            anyu[r] = 0
            cll[h - h0, r] = 0.0
            cvx[h - h0, r] = 0.0
            for d in range(Dv):
                acc[r, d] = 0.0
                cacc[h - h0, r, d] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def _query_rows(hh, h0, i, geo, ip, dims, flags, lay, q8, q16, q32, qfl, qrbuf, qds, kchan, tmp, offs, qvh, q2h, qah,
                qsh, rnh, rb, rs, qraw, isch, qerr, i8q, vxh):
    """Head h0 + hh's query rows (scratch hh): r = (batch in group) * R0 + g * Q_S + s, head n = h * G + g.
    q = query * scale (* dequant_scale_query) (* per-channel key scale); rows outside the query window stay 0
    (never computed, merge writes their 0 / +inf). Decides whether the head's int16 query is usable (i8q)."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch = flags
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    h = h0 + hh
    qv = qvh[hh]
    q2 = q2h[hh]
    qa = qah[hh]
    qs = qsh[hh]
    rn = rnh[hh]
    i8_qk = i8_qk_kernels                # (per head: cleared below when its query holds a NaN or an inf)
    for r in range(R):
        bl = r // R0
        b = i * BPG + bl
        rem = r - bl * R0
        g = rem // QS
        si = rem - g * QS
        n = h * G + g
        if b >= B:
            b = B - 1
        rb[r] = b
        rn[r] = n
        rs[r] = si
        qa[r] = 0.0
        qs[r] = 0.0
        if si < geo[GEO_QLO, b] or si >= geo[GEO_QHI, b]:
            for d in range(dq):
                qv[r, d] = 0.0
            if kt_mode != 0:
                for d in range(D):
                    qraw[hh, r, d] = 0.0
            if dp_qk:
                for d in range(D):
                    q2[r, d] = 0
            continue
        offs[0] = geo[GEO_QBASE, b] + n * ip[IP_Q_SN] + si * ip[IP_Q_SS]
        if dp_qk:
            qo = np.uint64(offs[0])
            for d in range(np.uint64(D)):
                q2[r, d] = q16[qo + d]
        load_rows(q8, q16, q32, qfl, offs, 1, ip[IP_Q_KIND], tmp, 0, D)
        if Dr > 0:
            offs[0] = geo[GEO_QRBASE, b] + n * ip[IP_QR_SN] + si * ip[IP_QR_SS]
            qr8, qr16, qr32, qrfl = views(qrbuf)
            load_rows(qr8, qr16, qr32, qrfl, offs, 1, ip[IP_QR_KIND], tmp, D, Dr)
        f = scale
        if ip[IP_QD] != 0:
            f = f * qds[b * ip[IP_QD_SB] + n * ip[IP_QD_SN] + si * ip[IP_QD_SS]]
        for d in range(D):
            qv[r, d] = tmp[0, d] * f
        if kt_mode != 0:                               # (the reference's query, for exact_key_tokens)
            fq = qds[b * ip[IP_QD_SB] + n * ip[IP_QD_SN] + si * ip[IP_QD_SS]] if ip[IP_QD] != 0 else 1.0
            for d in range(D):
                qraw[hh, r, d] = tmp[0, d] * np.float32(fq)
        # the rope part (columns D..D+Dr) is not quantized: dequant_scale_query applies to the int8
        # query only (SPEC 11: Q = Q_q * scale; Q_rope keeps its float16/bfloat16 values)
        for d in range(D, dq):
            qv[r, d] = tmp[0, d] * scale
        if kc_mode != 0:
            for d in range(D):
                qv[r, d] *= kchan[0, h, d]
            if kc_mode == 2:
                t = np.float32(0.0)
                for d in range(D):
                    t += qv[r, d] * kchan[1, h, d]
                qa[r] = t
        t = np.float32(0.0)
        for d in range(D):
            t += qv[r, d]
        qs[r] = t
    if eo_qk:                                      # qk_fma's even / odd bf16 halves (cpu.fma.KIND_BF16_EO)
        eo_rows(qv, R, D, tmp, False, EO_GROUP)
    if i8_qk:
        i8_qk = quant_i16(qv, R, D, q2.view(np.int16), isch[hh, 0])
    if i8_qk:                                      # the int16 query's score error (I8_QK_MAX_ERR)
        st = np.float32(0.0)
        for r in range(R):
            st = max(st, isch[hh, 0, r])
        qerr[hh] = st * np.float32(128.0) * np.float32(np.sqrt(D / 12.0))
        if kt_mode == 0 and not qerr[hh] <= I8_QK_MAX_ERR:
            i8_qk = False
    i8q[hh] = i8_qk
    for r in range(R):
        vxh[hh, r] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def _gather(tbl, i, h, c0, n, ip, dims, flags, lay, kt_tbl, kts, kto, tsk, tok, vt_tbl, vts, vto, tsv, tov, koff,
            voff, roff, kbuf, rbuf, rscr, kscr, vlines, i8_qk, qerr_h):
    """Gather a chunk of head h: its rows' element offsets, NZ fragments packed (rope rows into rscr, K rows into
    kscr, V prefetch runs into vlines), per-token factors. -> (i8_now: QK takes the int16 x int8 kernel, kfs: bytes
    between a key row's 32-byte runs, k_packed: K is read from kscr)."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch = flags
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    row_offsets(tbl, i, c0, n, bs, k_blk, h * k_h, k_s, koff)
    row_offsets(tbl, i, c0, n, bs, v_blk, h * v_h, v_s, voff)
    if Dr > 0:
        row_offsets(tbl, i, c0, n, bs, r_blk, h * r_h, r_s, roff)
    if Dr > 0 and r_fs != 0:
        r_es_, _ = elem_layout(r_kind, Dr)
        nz_pack(rbuf, roff, n, r_es_, Dr, r_fs, ip[IP_R_FW], rscr)
    if v_fs != 0 and pf:                       # the V rows QK requests on the way: NZ, their runs
        for c in range(n):
            vlines[c] = voff[c]
        nz_lines(vlines, n, Dv, ip[IP_V_FW], v_fs)
    if kt_mode != 0:
        token_scales(kt_tbl, i, h, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], ip[IP_KT_H], ip[IP_KT_S],
                     kt_mode, kts, kto, tsk, tok)
    if vt_mode != 0:
        token_scales(vt_tbl, i, h, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], ip[IP_VT_H], ip[IP_VT_S],
                     vt_mode, vts, vto, tsv, tov)
    # int16 x int8 QK for this head and chunk (the NaN / outlier / token-scale checks)
    i8_now = not dp_qk and i8_qk and (kt_mode == 0 or _i8_tokens_ok(qerr_h, tsk, n))
    kfs = 32                                   # bytes between a key row's 32-byte runs (qk_i8)
    k_packed = False
    if k_fs != 0:                              # NZ K: qk_i8 reads it in place, the others packed
        if i8_now and ip[IP_K_FW] * k_es_ == 32:
            kfs = k_fs * k_es_
        else:
            nz_pack(kbuf, koff, n, k_es_, D, k_fs, ip[IP_K_FW], kscr)
            k_packed = True
    return i8_now, kfs, k_packed


@njit(fastmath=FM, cache=True, inline="always")
def _qk_kernels(i8_now, kbu, koff, n, i, c0, ip, h, knext, dims, flags, lay, kt_tbl, kgs, kf16, q2, s, vbuf, vpf,
                isc, kfs, qv):
    """K chunk -> scores s [R, n] by the micro-kernels (the softmax scale is folded into q): bf16 dot products (AMX
    tiles first where they run), int16 x int8, or float32 FMAs. V rows of the same keys are requested on the way.
    Returns 1 when the int16 x int8 kernel ran."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch = flags
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    used_i8 = 0
    if dp_qk:
        # V rows of the same keys are requested on the way. AMX: the whole 16-key blocks, 16 query rows
        # at a time (the first group prefetches), then the rest of the keys as below
        ka = kbu.ctypes.data
        ko = koff
        step = n
        if k_kind == KIND_FP4:                 # bf16 rows first (knext: group scales, then rows),
            row_offsets(kt_tbl, i, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], h * ip[IP_KT_H], ip[IP_KT_S],
                        knext)
            ka = kf16.ctypes.data
            ko = knext
            step = n if amx_qk else FP4_SUB    # FP4_SUB rows at a time (they stay in L1); AMX all
        for c1 in range(0, n, step):
            m1 = min(step, n - c1)
            if k_kind == KIND_FP4:
                fp4_rows(kbu, koff, c1, m1, kgs, knext, kf16, D, knext)
            n0 = 0
            if amx_qk:
                n0 = m1 & ~15
                for r0 in range(0, R, QK_MAX_ROWS):
                    qk_amx(q2.ctypes.data + r0 * q2.shape[1] * 2, q2.shape[1] * 2, ka,
                           ko.ctypes.data + 8 * c1, n0, s.ctypes.data + r0 * s.shape[1] * 4 + 4 * c1,
                           s.shape[1], min(QK_MAX_ROWS, R - r0), D, scale, vbuf.ctypes.data,
                           vpf.ctypes.data + 8 * c1, n0 if pf and r0 == 0 else 0, v_row, v_es)
            if n0 < m1:
                d0 = c1 + n0
                qk_dp(q2.ctypes.data, q2.shape[1] * 2, ka, ko.ctypes.data + 8 * d0, m1 - n0,
                      s.ctypes.data + 4 * d0, s.shape[1], R, D, scale, vbuf.ctypes.data,
                      vpf.ctypes.data + 8 * d0, m1 - n0 if pf else 0, v_row, v_es)
    elif i8_now:
        used_i8 = 1
        qk_i8(q2.ctypes.data, q2.shape[1] * 2, kbu.ctypes.data, koff.ctypes.data, n, s.ctypes.data,
              s.shape[1], R, D, isc.ctypes.data, vbuf.ctypes.data, vpf.ctypes.data, n if pf else 0,
              v_row, v_es, kfs)
    else:
        qk_fma(qv.ctypes.data, qv.shape[1] * 4, kbu.ctypes.data, KIND_BF16_EO if eo_qk else k_kind,
               koff.ctypes.data, n, s.ctypes.data,
               s.shape[1], R, D, vbuf.ctypes.data, vpf.ctypes.data, n if pf else 0, v_row, v_es)
    return used_i8


@njit(fastmath=FM, cache=True, inline="always")
def _qk_loops(qv, kbu, rbu, koff, roff, n, s, kf, i, c0, ip, h, knext, vbuf, vpf, dims, flags, lay, kt_tbl, kgs,
              kf16):
    """K chunk -> scores by the generic build's numba loops (generic.py; FP4 decoded to bf16, then qk_fma)."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch = flags
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    if Dr == 0 and k_kind == KIND_BF16:
        qk_fused(qv, views(kbu)[1], k_kind, koff, n, s, R, D)
    elif Dr == 0 and k_kind == KIND_FP16:
        qk_fused(qv, views(kbu)[1].view(np.int16), k_kind, koff, n, s, R, D)
    elif Dr == 0 and k_kind == KIND_I8:
        qk_fused(qv, views(kbu)[0], k_kind, koff, n, s, R, D)
    elif k_kind == KIND_FP4:     # the chunk as bf16 (knext: group scales, then rows), then qk_fma
        row_offsets(kt_tbl, i, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], h * ip[IP_KT_H], ip[IP_KT_S], knext)
        fp4_rows(kbu, koff, 0, n, kgs, knext, kf16, D, knext)
        qk_fma(qv.ctypes.data, qv.shape[1] * 4, kf16.ctypes.data, KIND_BF16_EO if eo_qk else KIND_BF16,
               knext.ctypes.data, n, s.ctypes.data, s.shape[1], R, D, vbuf.ctypes.data, vpf.ctypes.data,
               n if pf else 0, v_row, v_es)
    else:
        k8, k16, k32, kfl = views(kbu)
        load_rows(k8, k16, k32, kfl, koff, n, k_kind, kf, 0, D)
        if Dr > 0:
            r8, r16, r32, rfl = views(rbu)
            load_rows(r8, r16, r32, rfl, roff, n, r_kind, kf, D, Dr)
        qk_block(qv, kf, s, R, n, dq)


@njit(fastmath=FM, cache=True, inline="always")
def _score_terms(s, n, n_, ip, geo, dims, lay, terms, pse, mask, qs, qa, tsk, tok, kfs, kbuf, kbu, k_packed, koff,
                 kscr, qraw, hh, kf, offs, rb, rn, rs, c0, anyu):
    """The score terms after QK: per-token key factors (exceptional tokens exactly), the per-channel offset term,
    pse, then the mask and band (masked scores MASK_FILL; anyu: a row saw an unmasked key). -> k_packed: K read from
    kscr from here on."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    pse_kind, has_mask, has_band, col_base, want_any, prefix_pass = terms
    if kt_mode != 0:
        for r in range(R):
            qsr = qs[r]
            for c in range(n_):
                s[r, c] = (s[r, c] + tok[c] * qsr) * tsk[c]
        if Dr == 0 and exceptional(tsk, tok, kt_mode, n):
            if kfs != 32:                      # (NZ read in place so far: the rows, packed)
                nz_pack(kbuf, koff, n, k_es_, D, k_fs, ip[IP_K_FW], kscr)
                kbu = kscr
                k_packed = True
            exact_key_tokens(s, R, n, tsk, tok, kt_mode, kbu, k_kind, koff, qraw[hh], D, scale, kf, offs)
    elif kc_mode == 2:
        for r in range(R):
            qar = qa[r]
            for c in range(n_):
                s[r, c] += qar
    if pse_kind >= 0:
        p8, p16, p32, pfl = views(pse)
        sk = np.uint64(ip[IP_PSE_K])
        for r in range(R):
            base = (rb[r] * ip[IP_PSE_B] + rn[r] * ip[IP_PSE_N] + rs[r] * ip[IP_PSE_S]
                    + (col_base + c0) * ip[IP_PSE_K])
            ub = np.uint64(base)
            if pse_kind == KIND_F32:
                for c in range(n_):
                    s[r, c] += pfl[ub + c * sk]
            elif pse_kind == KIND_BF16:
                for c in range(n_):
                    s[r, c] += bf16_to_f32(p16[ub + c * sk])
            else:
                for c in range(n_):
                    s[r, c] += fp16_to_f32(p16[ub + c * sk])
    if has_mask != 0 or has_band != 0:
        mk = np.uint64(ip[IP_M_K])
        for r in range(R):
            b = rb[r]
            il = rs[r] - geo[GEO_QLO, b]
            pre = geo[GEO_PRE, b]
            nxt = geo[GEO_NEXT, b]
            j0 = c0 if prefix_pass != 0 else geo[GEO_JOFS, b] + c0
            mbase = np.uint64(b * ip[IP_M_B] + rs[r] * ip[IP_M_S] + (col_base + c0) * ip[IP_M_K])
            seen = 0
            for c in range(n):
                hide = False
                if has_mask != 0 and mask[mbase + np.uint64(c) * mk] != 0:
                    hide = True
                if has_band != 0:
                    j = j0 + c
                    if j > il + nxt or j < il - pre:
                        hide = True
                if hide:
                    s[r, c] = MASK_FILL
                else:
                    seen = 1
            if want_any != 0 and seen != 0:
                anyu[r] = 1
    return k_packed


@njit(fastmath=FM, cache=True, inline="always")
def _value_tokens(s, R, n, n_, vt_mode, tsv, tov, vbu, v_kind, voff, Dv, tacc, vf, offs, cvx, hh):
    """Per-token value factors on the probabilities (exceptional tokens exactly; mode 2: the offsets' sums)."""
    if vt_mode != 0:
        if exceptional(tsv, tov, vt_mode, n):
            exact_value_tokens(s, R, n, tsv, tov, vt_mode, vbu, v_kind, voff, Dv, tacc, vf, offs)
        for r in range(R):
            for c in range(n_):
                s[r, c] *= tsv[c]
            if vt_mode == 2:
                t = np.float32(0.0)
                for c in range(n_):
                    t += s[r, c] * tov[c]
                cvx[hh, r] += t


@njit(fastmath=FM, cache=True, inline="always")
def _pv_kernels(dp_pv, use_i8, c0, hi, tbl, i, h, knext, ip, vbu, voff, roff, n, p2, tacc, kbuf, isc, s, dims, flags,
                lay, vt_tbl, vgs, vf16):
    """V chunk -> tacc by the micro-kernels (bf16 dot products with AMX tiles first where they run, int16 x int8, or
    float32 FMAs); the next chunk's K rows are requested on the way."""
    R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale = dims
    dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch = flags
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es,
     v_es, k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, kc_mode) = lay
    # the next chunk's K rows are requested on the way
    nn = 0
    if pv_k and c0 + C < hi:
        nn = min(C, hi - c0 - C)
        row_offsets(tbl, i, c0 + C, nn, bs, k_blk, h * k_h, k_s, knext)
        if k_fs != 0:
            nz_lines(knext, nn, D, ip[IP_K_FW], k_fs)
    if dp_pv:
        va = vbu.ctypes.data
        vo = voff
        step = n
        if v_kind == KIND_FP4:             # as K (roff: free, FP4 never has a rope)
            row_offsets(vt_tbl, i, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], h * ip[IP_VT_H],
                        ip[IP_VT_S], roff)
            va = vf16.ctypes.data
            vo = roff
            step = n if amx_pv else FP4_SUB
        for c1 in range(0, n, step):
            m1 = min(step, n - c1)
            if v_kind == KIND_FP4:
                fp4_rows(vbu, voff, c1, m1, vgs, roff, vf16, Dv, roff)
            pk = max(0, min(m1, nn - c1))     # the next chunk's K rows requested with these keys
            n0 = m1 & ~15 if amx_pv else 0       # AMX: the whole 16-key blocks (they prefetch)
            if n0 > 0:
                pv_amx(p2.ctypes.data + 2 * c1, p2.shape[1] * 2, va, vo.ctypes.data + 8 * c1, n0,
                       tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data + 8 * c1, pk,
                       k_row, k_es)
                pk = 0
            if n0 < m1:
                d0 = c1 + n0
                pv_dp(p2.ctypes.data + 2 * d0, p2.shape[1] * 2, va, vo.ctypes.data + 8 * d0, m1 - n0,
                      tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data + 8 * c1, pk,
                      k_row, k_es)
    elif use_i8:
        pv_i8(p2.ctypes.data, p2.shape[1] * 2, vbu.ctypes.data, voff.ctypes.data, n, tacc.ctypes.data,
              Dv, R, Dv, isc.ctypes.data + 4 * R, kbuf.ctypes.data, knext.ctypes.data, nn, k_row, k_es)
    else:
        pv_fma(s.ctypes.data, s.shape[1] * 4, vbu.ctypes.data, KIND_BF16_EO if eo_pv else v_kind,
               voff.ctypes.data, n,
               tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data, nn, k_row, k_es)


@njit(fastmath=FM, cache=True, inline="always")
def _pv_loops(s, vbu, voff, n, v_kind, tacc, R, Dv, vf, vt_tbl, i, c0, ip, h, roff, vgs, vf16, kbuf, knext, k_row,
              k_es, eo_pv):
    """V chunk -> tacc by the generic build's numba loops (FP4 decoded to bf16, then pv_fma)."""
    if v_kind == KIND_BF16:
        pv_fused(s, views(vbu)[1], v_kind, voff, n, tacc, R, Dv)
    elif v_kind == KIND_FP16:
        pv_fused(s, views(vbu)[1].view(np.int16), v_kind, voff, n, tacc, R, Dv)
    elif v_kind == KIND_I8:
        pv_fused(s, views(vbu)[0], v_kind, voff, n, tacc, R, Dv)
    elif v_kind == KIND_FP4:     # as K (roff: unused without rope, which FP4 never has)
        row_offsets(vt_tbl, i, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], h * ip[IP_VT_H], ip[IP_VT_S], roff)
        fp4_rows(vbu, voff, 0, n, vgs, roff, vf16, Dv, roff)
        pv_fma(s.ctypes.data, s.shape[1] * 4, vf16.ctypes.data, KIND_BF16_EO if eo_pv else KIND_BF16,
               roff.ctypes.data, n, tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data, 0, k_row, k_es)
    else:
        v8, v16, v32, vfl = views(vbu)
        load_rows(v8, v16, v32, vfl, voff, n, v_kind, vf, 0, Dv)
        pv_block(s, vf, tacc, R, n, Dv)


@njit(fastmath=FM, cache=True, inline="always")
def _finish_item(po, w, h0, HB, R, Dv, vt_mode, vxh, eo_pv, tmp):
    """The item's partials completed: value-offset sums (mode 2) added, pv_fma's channel groups back in order."""
    for h in range(h0, h0 + HB):
        acc = po[w, h]
        if vt_mode == 2:
            for r in range(R):
                x = vxh[h - h0, r]
                for d in range(Dv):
                    acc[r, d] += x
        if eo_pv:                                      # pv_fma's even / odd channel groups back in order
            eo_rows(acc, R, Dv, tmp, True, EO_GROUP)


@njit(fastmath=FM, cache=True)
def _items(items, counter, ip, fp, geo, work, tbl, qbuf, qrbuf, qds, kchan, kbuf, rbuf, vbuf,
          kt_tbl, kts, kto, vt_tbl, vts, vto, pse, mask, po, pm, pl, pany,
          qvh, qah, qsh, rb, rnh, rs, tmp, offs, kf, vf, s, vxh, koff, voff, roff, tsk, tok, tsv, tov, q2h, p2, knext,
          isch, i8q, sinks, generic, tacc, cacc, cll, cvx, qerr, qraw, stats, kscr, vscr, rscr, vlines):
    """The items of `items` (w * (KV_N / HB) + h / HB) this thread claims through `counter`, one after another: a
    driver over the inline stages above. Numba reference-counts every array argument of a call and every array
    parameter of an inline stage (an atomic add at entry and exit): so the claim loop is here, not in the caller,
    and the arrays come unowned (attend_items), which makes each count a null test.
    An item covers HB = ip[IP_HB] KV heads: their query rows are made first (per-head scratch [HB, ...]), then
    chunk by chunk every head's QK / softmax / PV (the state of head h in po / pm / pl / pany[w, h]).
    Sums over an item's keys run in two levels, so that no float32 sum takes more than ~2 sqrt(chunks) terms (one
    running sum over 2^20 keys drifts by 1e-3 relative): each chunk's PV sums go to tacc [R, Dv], tacc to the block
    of chunks' cacc, every `blk` chunks (~sqrt of the item's) cacc to the partial acc; the same for the sum of
    weights (cll -> ll) and the value extras (cvx -> vx). Plain sums: fastmath's reassociation keeps them."""
    H = ip[IP_H]
    HB = ip[IP_HB]
    NG = H // HB
    # views, constants and flags of the launch, made once (each array view is an allocation and reference counts)
    q8, q16, q32, qfl = views(qbuf)
    kf_ = kernel_flags(ip)
    p2i = p2.view(np.int16)
    R0 = ip[IP_R0]
    BPG = ip[IP_BPG]
    R = ip[IP_R]
    B = ip[IP_B]
    G = ip[IP_G]
    QS = ip[IP_QS]
    D = ip[IP_D]
    Dr = ip[IP_DR]
    Dv = ip[IP_DV]
    dq = D + Dr
    C = ip[IP_C]
    bs = ip[IP_BS]
    scale = np.float32(fp[0])
    kc_mode = ip[IP_KC_MODE]
    dp_qk = (kf_ & KF_DP_QK) != 0
    dp_pv = (kf_ & KF_DP_PV) != 0
    amx_qk = (kf_ & KF_AMX_QK) != 0
    amx_pv = (kf_ & KF_AMX_PV) != 0
    pf = (kf_ & KF_PREFETCH) != 0
    pv_k = (kf_ & KF_PV_K) != 0
    i8_qk_kernels = (kf_ & KF_I8_QK) != 0
    i8_pv = (kf_ & KF_I8_PV) != 0
    fma_qk = (kf_ & KF_FMA_QK) != 0
    fma_pv = (kf_ & KF_FMA_PV) != 0
    eo_qk = (kf_ & KF_EO_QK) != 0
    eo_pv = (kf_ & KF_EO_PV) != 0
    touch = (kf_ & KF_TOUCH) != 0
    lay = _layout(ip, kf_, kbuf, vbuf, HB, D, Dv, kc_mode)
    (k_fs, v_fs, r_fs, kv_same, k_blk, k_h, k_s, k_kind, r_blk, r_h, r_s, r_kind, v_blk, v_h, v_s, v_kind, k_es, v_es,
     k_row, v_row, k_span, v_span, k_es_, v_es_, kt_mode, vt_mode, _) = lay
    kgs = kts.view(np.uint8)
    vgs = vts.view(np.uint8)
    kf16 = kf.reshape(kf.size).view(np.uint16)            # FP4 chunks decoded to bf16 (fp4_rows) for qk_fma / pv_fma
    vf16 = vf.reshape(vf.size).view(np.uint16)
    pse_kind = ip[IP_PSE_KIND]            # -1: no pse
    has_mask = ip[IP_MASK]
    has_band = ip[IP_BAND]
    col_base = ip[IP_COL_BASE]
    want_any = ip[IP_WANT_ANY]
    prefix_pass = ip[IP_PREFIX_PASS]
    sink = np.uint64(0)
    n_i8 = 0                                               # chunks x heads whose QK ran qk_i8, of n_qk (stats)
    n_qk = 0
    # the stages' scalar arguments, grouped (numba cannot inline a call of more than 30 arguments; arrays
    # travel on their own)
    dims = (R, R0, BPG, B, G, QS, D, Dr, dq, Dv, C, bs, scale)
    flags = (dp_qk, dp_pv, amx_qk, amx_pv, pf, pv_k, i8_qk_kernels, i8_pv, fma_qk, fma_pv, eo_qk, eo_pv, touch)
    terms = (pse_kind, has_mask, has_band, col_base, want_any, prefix_pass)
    while True:
        it = claim(items, counter)
        if it < 0:
            break
        w = it // NG
        h0 = (it % NG) * HB
        i = work[0, w]
        lo = work[1, w]
        hi = work[2, w]
        _reset_item(po, pm, pl, pany, cll, cvx, cacc, w, h0, HB, R, Dv)
        if hi <= lo:
            continue
        # weights exp(s - max - ln 2^k) with 2^k >= the item's keys: its sums stay <= 1 x max |V| (softmax_chunk)
        kb = 0
        while (1 << kb) < hi - lo:
            kb += 1
        kshift = np.float32(kb * 0.6931471805599453)
        nch = (hi - lo + C - 1) // C                     # chunks of the item; blocks of blk of them
        blk = 1
        while blk * blk < nch:
            blk += 1
        # (the typed views of K / V / rope / pse are made where a path reads them: an array view checks its
        # size, which numba cannot drop, and 24 of them per item were ~9 % of a small call's kernel time)
        for hh in range(HB):
            _query_rows(hh, h0, i, geo, ip, dims, flags, lay, q8, q16, q32, qfl, qrbuf, qds, kchan, tmp, offs, qvh,
                        q2h, qah, qsh, rnh, rb, rs, qraw, isch, qerr, i8q, vxh)
        for c0 in range(lo, hi, C):
            n = min(C, hi - c0)
            n_ = np.uint64(n)
            ci = (c0 - lo) // C
            flush = (ci + 1) % blk == 0 or c0 + C >= hi  # the block of chunks ends: its sums into the partial
            if touch:                                  # the chunk's rows of every head, front to back (DP_TOUCH)
                row_offsets(tbl, i, c0, n, bs, k_blk, h0 * k_h, k_s, koff)
                sink ^= touch_rows(kbuf, koff, n, k_es_, k_span)
                row_offsets(tbl, i, c0, n, bs, v_blk, h0 * v_h, v_s, voff)
                sink ^= touch_rows(vbuf, voff, n, v_es_, v_span)
            for hh in range(HB):
                h = h0 + hh
                qv = qvh[hh]
                q2 = q2h[hh]
                qa = qah[hh]
                qs = qsh[hh]
                rn = rnh[hh]
                vx = vxh[hh]
                isc = isch[hh]
                i8_qk = i8q[hh]
                acc = po[w, h]
                m = pm[w, h]
                ll = pl[w, h]
                anyu = pany[w, h]
                # ---- gather the chunk's rows
                i8_now, kfs, k_packed = _gather(tbl, i, h, c0, n, ip, dims, flags, lay, kt_tbl, kts, kto, tsk, tok,
                                                vt_tbl, vts, vto, tsv, tov, koff, voff, roff, kbuf, rbuf, rscr, kscr,
                                                vlines, i8_qk, qerr[hh])
                kbu = kscr if k_packed else kbuf
                vpf = vlines if v_fs != 0 and pf else voff
                rbu = rscr if Dr > 0 and r_fs != 0 else rbuf
                vbu = vbuf
                # ---- K chunk -> scores (the softmax scale is folded into q)
                n_qk += 1
                if dp_qk or i8_now or fma_qk or generic is None:
                    # (the build without generic paths: numba prunes the other branch when `generic` is None, which
                    # keeps the first-call compile time down)
                    n_i8 += _qk_kernels(i8_now, kbu, koff, n, i, c0, ip, h, knext, dims, flags, lay, kt_tbl, kgs,
                                        kf16, q2, s, vbuf, vpf, isc, kfs, qv)
                else:
                    _qk_loops(qv, kbu, rbu, koff, roff, n, s, kf, i, c0, ip, h, knext, vbuf, vpf, dims, flags, lay,
                              kt_tbl, kgs, kf16)
                k_packed = _score_terms(s, n, n_, ip, geo, dims, lay, terms, pse, mask, qs, qa, tsk, tok, kfs, kbuf,
                                        kbu, k_packed, koff, kscr, qraw, hh, kf, offs, rb, rn, rs, c0, anyu)
                # ---- online softmax over the chunk (and the bf16 probabilities of pv_dp)
                sm_mode = 1 if dp_pv else (2 if i8_pv and vt_mode == 0 else 0)
                fused = softmax_chunk(s, R, n, m, ll, vx, acc, Dv, p2, sm_mode, isc[1], kshift, cll, cvx, cacc, hh)
                if v_fs != 0 and k_packed and kv_same:     # V is K (MLA's latent cache): its packed rows
                    for c in range(n):
                        voff[c] = koff[c]
                    vbu = kscr
                elif v_fs != 0:                            # (after QK, which requested its fragments)
                    nz_pack(vbuf, voff, n, v_es_, Dv, v_fs, ip[IP_V_FW], vscr)
                    vbu = vscr
                # ---- V chunk -> tacc (zero here), then into the block's sums cacc[hh]
                _value_tokens(s, R, n, n_, vt_mode, tsv, tov, vbu, v_kind, voff, Dv, tacc, vf, offs, cvx, hh)
                use_i8 = i8_pv and ((sm_mode == 2 and fused) or quant_i16(s, R, n, p2i, isc[1]))
                if pf and c0 + C < hi:                     # the next chunk's per-token factors, on the way
                    nn = min(C, hi - c0 - C)
                    if kt_mode != 0:
                        request_tokens(kt_tbl, i, h, c0 + C, nn, ip[IP_KT_BS], ip[IP_KT_BLK], ip[IP_KT_H], ip[IP_KT_S],
                                       kt_mode, kts, kto)
                    if vt_mode != 0:
                        request_tokens(vt_tbl, i, h, c0 + C, nn, ip[IP_VT_BS], ip[IP_VT_BLK], ip[IP_VT_H], ip[IP_VT_S],
                                       vt_mode, vts, vto)
                if dp_pv or use_i8 or fma_pv or generic is None:
                    _pv_kernels(dp_pv, use_i8, c0, hi, tbl, i, h, knext, ip, vbu, voff, roff, n, p2, tacc, kbuf, isc,
                                s, dims, flags, lay, vt_tbl, vgs, vf16)
                else:
                    _pv_loops(s, vbu, voff, n, v_kind, tacc, R, Dv, vf, vt_tbl, i, c0, ip, h, roff, vgs, vf16, kbuf,
                              knext, k_row, k_es, eo_pv)
                drain_chunk(cacc, hh, tacc, R, Dv)
                if flush:
                    drain_block(acc, ll, vx, cacc, cll, cvx, hh, R, Dv)
        _finish_item(po, w, h0, HB, R, Dv, vt_mode, vxh, eo_pv, tmp)
    sinks[0] = sink                                        # (keeps the touch loads)
    fetch_add(stats, 0, n_i8)
    fetch_add(stats, 1, n_qk)


@njit(cache=True, inline="always")
def _offsets(out, sizes, first):
    """out[first + j] = the 64-byte aligned byte offset of the j-th of `sizes` laid end to end; -> their total."""
    pos = 0
    j = first
    for n in sizes:
        out[j] = pos
        pos += (n + 63) & ~63
        j += 1
    return max(pos, 1)


@njit(nogil=True, fastmath=FM, cache=True)
def attend_items(items, counter, ip, fp, geo, work, tbl, bufs, kchan, kt_tbl, vt_tbl, po, pm, pl, pany,
                 generic, stats):
    """Items (w * (KV_N / HB) + h / HB) without the GIL. Every thread running this call takes the next item of
    `items` (longest first) through the shared atomic `counter` until none is left: dynamic
    scheduling, so a thread that loses its core to another process does not hold up the call.
    Buffers come as (address, bytes) in `bufs` (see BUF_*). `generic`: None compiles (and runs) only
    the fused bf16 / fp16 / int8 paths; an array (any) adds float32, int4 and MLA-rope K/V. stats int64 [2]: the
    chunks (x KV heads) whose QK ran the int16 query kernels and all of them are added to it (decode.QK_STATS)."""
    R = ip[IP_R]
    dq = ip[IP_D] + ip[IP_DR]
    Dv = ip[IP_DV]
    C = ip[IP_C]
    qbuf = buf_bytes(bufs, BUF_Q)
    qrbuf = buf_bytes(bufs, BUF_QR)
    qds = buf_f32(bufs, BUF_QDS)
    kbuf = buf_bytes(bufs, BUF_K)
    rbuf = buf_bytes(bufs, BUF_R)
    vbuf = buf_bytes(bufs, BUF_V)
    kts = buf_f32(bufs, BUF_KTS)
    kto = buf_f32(bufs, BUF_KTO)
    vts = buf_f32(bufs, BUF_VTS)
    vto = buf_f32(bufs, BUF_VTO)
    pse = buf_bytes(bufs, BUF_PSE)
    mask = buf_bytes(bufs, BUF_MASK)
    HB = ip[IP_HB]
    D = ip[IP_D]
    Dt = D if ip[IP_KT_MODE] != 0 else 0
    kb = C * D * elem_layout(ip[IP_K_KIND], 1)[0] if ip[IP_K_FS] != 0 else 0         # nz_pack's scratch bytes
    vb = C * Dv * elem_layout(ip[IP_V_KIND], 1)[0] if ip[IP_V_FS] != 0 else 0
    rbb = C * ip[IP_DR] * elem_layout(ip[IP_R_KIND], 1)[0] if ip[IP_R_FS] != 0 else 0
    # scratch, once per call (per thread), unowned arrays carved from two allocations (zeroed / not): one
    # allocation and one reference-counted owner per call, not one per array. Byte offsets first ([HB, ...]: per
    # KV head of an item)
    sz = np.empty(35, np.int64)
    tw = max(dq, 32)                                   # tmp: a query row, or eo_rows' group (<= 32 channels)
    nz = _offsets(sz, (HB * R * dq * 4, HB * R * 4, HB * R * 4, R * 8, HB * R * 8, R * 8, tw * 4, 8, HB * R * 4,
                       C * 8, C * 8, C * 8, C * 4, C * 4, C * 4, C * 4, HB * R * dq * 2, R * (C + 2) * 2,
                       HB * 2 * R * 4, HB, 8, C * 8, R * Dv * 4, HB * R * Dv * 4, HB * R * 4, HB * R * 4, HB * 4,
                       HB * R * Dt * 4, C * 8), 0)
    ne = _offsets(sz, (C * dq * 4, C * Dv * 4, R * C * 4, kb, vb, rbb), 29)
    zblock = np.zeros(nz, np.uint8)
    eblock = np.empty(ne, np.uint8)
    z = zblock.ctypes.data
    e = eblock.ctypes.data
    qv = carray(addr_ptr(z + sz[0]), (HB, R, dq), np.float32)
    qa = carray(addr_ptr(z + sz[1]), (HB, R), np.float32)
    qs = carray(addr_ptr(z + sz[2]), (HB, R), np.float32)
    rb = carray(addr_ptr(z + sz[3]), R, np.int64)
    rn = carray(addr_ptr(z + sz[4]), (HB, R), np.int64)
    rs = carray(addr_ptr(z + sz[5]), R, np.int64)
    tmp = carray(addr_ptr(z + sz[6]), (1, tw), np.float32)
    offs = carray(addr_ptr(z + sz[7]), 1, np.int64)
    vx = carray(addr_ptr(z + sz[8]), (HB, R), np.float32)
    koff = carray(addr_ptr(z + sz[9]), C, np.int64)
    voff = carray(addr_ptr(z + sz[10]), C, np.int64)
    roff = carray(addr_ptr(z + sz[11]), C, np.int64)
    tsk = carray(addr_ptr(z + sz[12]), C, np.float32)
    tok = carray(addr_ptr(z + sz[13]), C, np.float32)
    tsv = carray(addr_ptr(z + sz[14]), C, np.float32)
    tov = carray(addr_ptr(z + sz[15]), C, np.float32)
    tsk[:] = 1.0
    tsv[:] = 1.0
    # q2: the bf16 query bits of the dp kernels; p2: bf16 / int16 probabilities (pv_dp / pv_i8 read pairs: a spare
    # column); isc / i8q: the int16 query / probability scales and whether a head's int16 query is usable
    # (quant_i16); sinks: what touch_rows read; knext: the next chunk's K row offsets (prefetched during PV); tacc:
    # a chunk's PV sums (left 0 after each chunk); cacc / cll / cvx: the current block of chunks' acc, sum of
    # weights and value extras; qerr: the int16 query's score error (I8_QK_MAX_ERR); qraw: exact_key_tokens' query
    q2 = carray(addr_ptr(z + sz[16]), (HB, R, dq), np.uint16)
    p2 = carray(addr_ptr(z + sz[17]), (R, C + 2), np.uint16)
    isc = carray(addr_ptr(z + sz[18]), (HB, 2, R), np.float32)
    i8q = carray(addr_ptr(z + sz[19]), HB, np.bool_)
    sinks = carray(addr_ptr(z + sz[20]), 1, np.uint64)
    knext = carray(addr_ptr(z + sz[21]), C, np.int64)
    tacc = carray(addr_ptr(z + sz[22]), (R, Dv), np.float32)
    cacc = carray(addr_ptr(z + sz[23]), (HB, R, Dv), np.float32)
    cll = carray(addr_ptr(z + sz[24]), (HB, R), np.float32)
    cvx = carray(addr_ptr(z + sz[25]), (HB, R), np.float32)
    qerr = carray(addr_ptr(z + sz[26]), HB, np.float32)
    qraw = carray(addr_ptr(z + sz[27]), (HB, R, Dt), np.float32)
    vlines = carray(addr_ptr(z + sz[28]), C, np.int64)
    kf = carray(addr_ptr(e + sz[29]), (C, dq), np.float32)
    vf = carray(addr_ptr(e + sz[30]), (C, Dv), np.float32)
    s = carray(addr_ptr(e + sz[31]), (R, C), np.float32)
    kscr = carray(addr_ptr(e + sz[32]), kb, np.uint8)                  # nz_pack's rows
    vscr = carray(addr_ptr(e + sz[33]), vb, np.uint8)
    rscr = carray(addr_ptr(e + sz[34]), rbb, np.uint8)
    _items(unowned(items), unowned(counter), unowned(ip), unowned(fp), unowned(geo), unowned(work), unowned(tbl),
           qbuf, qrbuf, qds, unowned(kchan), kbuf, rbuf, vbuf, unowned(kt_tbl), kts, kto, unowned(vt_tbl), vts, vto,
           pse, mask, unowned(po), unowned(pm), unowned(pl), unowned(pany), qv, qa, qs, rb, rn, rs, tmp, offs, kf, vf,
           s, vx, koff, voff, roff, tsk, tok, tsv, tov, q2, p2, knext, isc, i8q, sinks, generic, tacc, cacc, cll, cvx,
           qerr, qraw, unowned(stats), kscr, vscr, rscr, vlines)
    alive((zblock, eblock))
