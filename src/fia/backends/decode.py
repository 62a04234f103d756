"""The decode backend: Q_S <= 16 on the CPU, Numba kernels (decode_kernels.py).

Design (issue 7):
* grouped heads: one work item owns one KV head and all its G * Q_S query rows, so every K/V row is
  read once per item and used by the whole group (no repeat of K/V, no per-head re-reads);
* split-KV: work items are (batch, KV head, key range); long sequences are cut into ranges so that
  every core gets work, and the partials are merged through their LSEs (the math of merge.py's
  merge_partials, done inside the `merge` kernel);
* KV in place: dense / packed / tensor-list / paged caches are read where they are. Key position p
  of batch b lives at element `table[b, p // bs] * stride_block + h * stride_head + (p % bs) *
  stride_slot` of the cache's storage (paged: the block table; dense: table = batch index, bs = inf);
* fused dequantization: int8 / int4 K and V are widened per row inside the loop; per-channel,
  per-tensor and per-head factors are folded into the query (key) and the epilogue (value),
  per-token factors are applied per key;
* shared prefix: a separate pass reads the prefix once for a group of batches (all of them while
  G * Q_S * batches <= PREFIX_ROWS), and its partials are merged like one more split;
* masks, pse_shift, band geometry (Q_S > 1), left padding, lengths, learnable sink, row-invalid
  correction: applied in the kernels with the reference's rules (MASK_FILL, dead rows);
* output quantization, dtype and layout: the shared epilogue (finalize.py).

Host-side work per call is small on purpose (the small-call target): a handful of int64 arrays
describe the problem, the query is read in place by the kernel (converted, scaled and dequantized per
item), and the planning (splits) is a compiled function.

Not supported (declared in not_supported_reasons, so dispatch falls back): Q_S > 16, full int8
quantization (prefill only anyway), float64 compute, non-CPU tensors, K/V/rope/prefix whose last
dimension is not contiguous.
"""
from __future__ import annotations

import os
import threading
from typing import List, Optional

import numpy as np
import torch

from ..spec.problem import AttentionProblem
from .base import Backend, BackendResult
from .prefill import PrefillBackend

MAX_Q_S = 16
PREFIX_ROWS = 64            # rows of one prefix work group: the prefix is read once per group of batches
MIN_SPLIT = 512             # fewest keys of a split (smaller splits cost more in merging than they gain)
ITEMS_PER_THREAD = 4        # split long sequences until there are about this many items per thread
CHUNK_FLOATS = 32768        # keys per chunk = CHUNK_FLOATS // head dim (256 for D = 128), measured best
PARALLEL_MIN_WORK = 16384   # keys x rows below which one thread does everything (no pool hand-off)
PREFILL_ROWS = 32           # Q_S > 1 with more rows per KV head than this: prefer the prefill backend
PREFILL_PRIORITY = PrefillBackend.priority
_BIG = 1 << 40              # "infinite" block size of unpaged storage

_K = None                   # the kernel module, imported lazily (numba import + cache load)


def _kernels():
    global _K
    if _K is None:
        from . import decode_kernels
        _K = decode_kernels
    return _K


def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
        return True
    except Exception:  # pragma: no cover - numba is a dependency of this backend only
        return False


# ---------------------------------------------------------------------------------------------- buffers
_DUMMY = {}


def _dummy(dt, ndim: int = 1) -> np.ndarray:
    key = (dt, ndim)
    a = _DUMMY.get(key)
    if a is None:
        a = _DUMMY[key] = np.zeros((1,) * ndim, dtype=dt)
    return a


_DUMMY_BUF = np.zeros(16, np.uint8)          # stands for absent buffers (never read)
_DUMMY_ADDR = (_DUMMY_BUF.ctypes.data, _DUMMY_BUF.nbytes)


def _addr(t: Optional[torch.Tensor]):
    """(address, bytes) of the storage span of t, starting at t's first element: how query, K, V,
    rope, scales, pse and mask reach the kernels (read in place; the element kind travels separately,
    see _kind), so one compiled kernel serves every dtype. t stays alive for the call (p holds it)."""
    if t is None:
        return _DUMMY_ADDR
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if s == 0:
            return _DUMMY_ADDR
        n += (s - 1) * st
    return t.data_ptr(), n * t.element_size()


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.int32: 4}
_FUSED_KIND = {1: True, 2: True, 3: True}                  # bf16, fp16, int8: fused QK / PV kernels


def _kind(t: torch.Tensor) -> int:
    return _KINDS[t.dtype]


def _inner_contiguous(t: Optional[torch.Tensor]) -> bool:
    return t is None or t.shape[-1] <= 1 or t.stride(-1) == 1


# ---------------------------------------------------------------------------------------------- backend
class DecodeBackend(Backend):
    """Fast CPU decode: Q_S <= 16, grouped heads, split-KV, fused dequant, paged KV in place."""
    name = "decode"
    priority = 60            # above prefill (50): Q_S <= 16 comes here
    devices = ("cpu",)       # Numba CPU kernels

    def not_supported_reasons(self, p: AttentionProblem) -> List[str]:
        r = super().not_supported_reasons(p)
        if not _numba_available():
            r.append("numba is not installed")
        if p.Q_S > MAX_Q_S:
            r.append(f"Q_S = {p.Q_S} > {MAX_Q_S} (decode backend: Q_S <= {MAX_Q_S})")
        if p.full_quant is not None:
            r.append("full int8 quantization (int8 query, key and value)")
        if p.compute_dtype != torch.float32:
            r.append(f"compute dtype {p.compute_dtype} (float32 only)")
        kv = p.kv
        if kv.kind == "list":
            ts = list(kv.keys) + list(kv.values) + list(kv.key_ropes or ())
        else:
            ts = [kv.key, kv.value, kv.key_rope]
        if p.prefix is not None:
            ts += [p.prefix.key, p.prefix.value]
        if not all(_inner_contiguous(t) for t in ts):
            r.append("key/value (or rope/prefix) with a non-contiguous last dimension")
        for t in ts + [p.query, p.query_rope, p.pse]:
            if t is not None and t.dtype not in _KINDS:
                r.append(f"dtype {t.dtype}")
                break
        if p.prefix is not None and any(g.kv_lo != 0 for g in p.geometry):
            r.append("shared prefix with a KV window not starting at 0")
        return r

    def preference(self, p: AttentionProblem) -> int:
        """Q_S > 1 with more than PREFILL_ROWS query rows per KV head: rank below the prefill backend, which
        is faster there (measured, docs/PERF_DECODE.md iteration 11); it still runs when forced."""
        if p.Q_S > 1 and p.G * p.Q_S > PREFILL_ROWS:
            return PREFILL_PRIORITY - 1
        return self.priority

    def run(self, p: AttentionProblem) -> BackendResult:
        return _run(p, _kernels())


# ---------------------------------------------------------------------------------------------- the run
def _run(p: AttentionProblem, K) -> BackendResult:
    B, N, H, G, QS, Dv = p.B, p.N, p.KV_N, p.G, p.Q_S, p.Dv
    if B == 0 or N == 0 or Dv == 0 or QS == 0 or (p.packed and p.T == 0):
        out = torch.zeros(p.out_shape(), dtype=torch.float32)
        lse = torch.full(p.lse_shape(), float("inf"), dtype=torch.float32)
        return BackendResult(out, lse if p.want_lse else None)
    R0 = G * QS
    threads = max(1, torch.get_num_threads())
    geom = p.geometry
    P = 0 if p.prefix is None else p.prefix.length

    # ---- query: read in place by the kernel (last dim contiguous)
    q, qr = p.query, p.query_rope
    if q.stride(-1) != 1:
        q = q.contiguous()
    if qr is not None and qr.stride(-1) != 1:
        qr = qr.contiguous()
    D = q.shape[-1]
    Dr = 0 if qr is None else qr.shape[-1]

    # ---- per-batch geometry: query window, effective keys, band, column offset, query row base
    has_band = p.mask.kind == "band"
    if p.packed:                                  # [N, T, D]: batch b starts at row q_offset
        qst, qrst = q.stride(), (qr.stride() if qr is not None else (0, 0, 0))
        q_sn, q_ss, qr_sn, qr_ss = qst[0], qst[1], qrst[0], qrst[1]
        qb = [g.q_offset * q_ss for g in geom]
        qrb = [g.q_offset * qr_ss for g in geom]
    else:                                         # [B, N, Q_S, D]
        qst, qrst = q.stride(), (qr.stride() if qr is not None else (0, 0, 0, 0))
        q_sn, q_ss, qr_sn, qr_ss = qst[1], qst[2], qrst[1], qrst[2]
        qb = [b * qst[0] for b in range(B)]
        qrb = [b * qrst[0] for b in range(B)]
    bands = [p.mask.band_for(g.s1, g.s2) for g in geom] if has_band else [(0, 0)] * B
    geo = np.array([[g.q_lo for g in geom], [g.q_hi for g in geom], [g.s2 for g in geom],   # GEO_* rows
                    [bd[0] for bd in bands], [bd[1] for bd in bands], [P - g.kv_lo for g in geom], qb, qrb],
                   np.int64)

    ip = [0] * K.IP_LEN
    ip[K.IP_R0], ip[K.IP_BPG], ip[K.IP_R], ip[K.IP_B] = R0, 1, R0, B
    ip[K.IP_G], ip[K.IP_QS], ip[K.IP_H] = G, QS, H
    ip[K.IP_D], ip[K.IP_DR], ip[K.IP_DV] = D, Dr, Dv
    C = _chunk(D + Dr, Dv, R0 if P == 0 else max(R0, min(B, PREFIX_ROWS // R0) * R0))
    ip[K.IP_C] = C
    bufs = [_DUMMY_ADDR] * K.BUF_LEN
    ip[K.IP_Q_KIND], ip[K.IP_Q_SN], ip[K.IP_Q_SS] = _kind(q), q_sn, q_ss
    bufs[K.BUF_Q] = _addr(q)
    if qr is not None:
        ip[K.IP_QR_KIND], ip[K.IP_QR_SN], ip[K.IP_QR_SS] = _kind(qr), qr_sn, qr_ss
        bufs[K.BUF_QR] = _addr(qr)
    if p.query_dequant is not None:               # (B, N, Q_S) float32, indexed by the batch's own row
        t = p.query_dequant.scale
        st = t.stride()
        ip[K.IP_QD], ip[K.IP_QD_SB], ip[K.IP_QD_SN], ip[K.IP_QD_SS] = 1, st[0], st[1], st[2]
        bufs[K.BUF_QDS] = _addr(t)
    fp = np.array([p.scale], np.float64)

    # ---- KV dequant factors of the tensor / channel / head kinds: key folded into q, value in merge
    aq = p.antiquant
    kchan = _dummy(np.float32, 3)
    vcs = vco = _dummy(np.float32, 2)
    v_chan = 0
    if aq is not None and not aq.key.per_token:
        cs = _chan(aq.key.scale, aq.key.granularity, H, D)
        if aq.key.offset is not None:
            kchan = torch.stack([cs, _chan(aq.key.offset, aq.key.granularity, H, D)]).contiguous().numpy()
            ip[K.IP_KC_MODE] = 2
        else:
            kchan = cs[None].contiguous().numpy()
            ip[K.IP_KC_MODE] = 1
    if aq is not None and not aq.value.per_token:
        vcs = _chan(aq.value.scale, aq.value.granularity, H, Dv).contiguous().numpy()
        v_chan = 1
        if aq.value.offset is not None:
            vco = _chan(aq.value.offset, aq.value.granularity, H, Dv).contiguous().numpy()
            v_chan = 2

    # ---- pse / mask, physical coordinates
    ip[K.IP_PSE_KIND] = -1
    if p.pse is not None:
        st = p.pse.stride()
        ip[K.IP_PSE_KIND] = _kind(p.pse)
        ip[K.IP_PSE_B] = st[0] if p.pse.shape[0] > 1 else 0
        ip[K.IP_PSE_N], ip[K.IP_PSE_S], ip[K.IP_PSE_K] = st[1], st[2], st[3]
        bufs[K.BUF_PSE] = _addr(p.pse)
    um = p.mask.user_mask
    if um is not None:
        if um.dtype not in (torch.bool, torch.int8, torch.uint8):
            um = (um != 0).to(torch.uint8)          # legacy float16 masks: nonzero = masked
        st = um.stride()
        ip[K.IP_MASK], ip[K.IP_M_B], ip[K.IP_M_S], ip[K.IP_M_K] = 1, (st[0] if um.shape[0] > 1 else 0), st[1], st[2]
        bufs[K.BUF_MASK] = _addr(um)
    ip[K.IP_BAND] = int(has_band)
    want_any = int(p.row_invalid_fix and (um is not None or has_band) and p.sink is None)
    ip[K.IP_WANT_ANY] = want_any

    # ---- own keys: work entries (batch, key range) x KV heads
    lens_l = [(g.kv_hi - g.kv_lo) if g.s1 > 0 else 0 for g in geom]
    lens_total = sum(lens_l)
    lens = np.array(lens_l, np.int64)
    kv_lo = np.array([g.kv_lo for g in geom], np.int64)
    work, wrange = K.split_work(lens, kv_lo, H, threads, C, MIN_SPLIT, ITEMS_PER_THREAD)
    W = work.shape[1]
    Wa = max(W, 1)
    po = np.empty((Wa, H, R0, Dv), np.float32)
    pm = np.empty((Wa, H, R0), np.float32)
    pl = np.zeros((Wa, H, R0), np.float32)
    pany = np.zeros((Wa, H, R0), np.uint8)
    ip[K.IP_COL_BASE] = P
    if W:
        for src in _sources(p, B):
            w0, w1 = src.entries(work, wrange)
            if w1 <= w0:
                continue
            wk = work if (w0, w1) == (0, W) else np.ascontiguousarray(work[:, w0:w1])
            src.fill(ip, bufs, K)
            keys = lens_total if src.batch is None else int(lens[src.batch])
            _launch(K.attend_items, wk, H, R0, threads, keys,
                    (np.array(ip, np.int64), fp, geo, wk, src.tbl, _bufs(bufs), kchan,
                     src.kt_tbl, src.vt_tbl, po[w0:w1], pm[w0:w1], pl[w0:w1], pany[w0:w1], src.generic()))

    # ---- shared prefix: batches grouped, the prefix read once per group (SPEC 7)
    has_prefix, bpg = 0, 1
    ppo, ppm, ppl, ppany, pwrange = po[:1], pm[:1], pl[:1], pany[:1], wrange[:, :1]
    if P > 0:
        has_prefix = 1
        bpg = max(1, min(B, PREFIX_ROWS // R0))
        ng = -(-B // bpg)
        Rp = bpg * R0
        pwork, pwrange = K.split_work(np.full(ng, P, np.int64), np.zeros(ng, np.int64), H, threads, C,
                                      MIN_SPLIT, ITEMS_PER_THREAD)
        Wp = pwork.shape[1]
        ppo = np.empty((Wp, H, Rp, Dv), np.float32)
        ppm = np.empty((Wp, H, Rp), np.float32)
        ppl = np.zeros((Wp, H, Rp), np.float32)
        ppany = np.zeros((Wp, H, Rp), np.uint8)
        src = _Source(p, p.prefix.key, p.prefix.value, None, np.zeros((ng, 1), np.int64), _BIG, None, 0, 1)
        ipp, pbufs = list(ip), list(bufs)
        src.fill(ipp, pbufs, K)
        ipp[K.IP_BPG], ipp[K.IP_R] = bpg, Rp
        ipp[K.IP_COL_BASE], ipp[K.IP_PREFIX_PASS] = 0, 1
        ipp[K.IP_KT_MODE] = ipp[K.IP_VT_MODE] = 0      # per-token dequant never comes with a prefix
        _launch(K.attend_items, pwork, H, Rp, threads, ng * P,
                (np.array(ipp, np.int64), fp, geo, pwork, src.tbl, _bufs(pbufs), kchan,
                 src.kt_tbl, src.vt_tbl, ppo, ppm, ppl, ppany, src.generic()))

    # ---- merge: splits + prefix + sink, normalization, value dequant, special rows; the output is
    # written in its final layout and dtype, so the shared epilogue has nothing to copy
    sink = _dummy(np.float32)
    if p.sink is not None:
        sink = p.sink.to(torch.float32).contiguous().numpy()
    out_t, lse_t, obase, ost, lst = _outputs(p)
    okind = 0 if out_t.dtype == torch.float32 else _kind(out_t)
    mp = np.array([B, G, QS, H, has_prefix, int(p.sink is not None), v_chan, want_any, bpg, int(has_band),
                   ost[0], ost[1], lst[0], lst[1], okind], np.int64)
    obufs = np.array([[out_t.data_ptr(), lse_t.data_ptr()],
                      [out_t.numel() * out_t.element_size(), lse_t.numel() * 4]], np.int64)
    K.merge(mp, geo, po, pm, pl, pany, wrange, ppo, ppm, ppl, ppany, pwrange, sink, vcs, vco, obase, obufs)
    return BackendResult(out_t, lse_t if p.want_lse else None)


def _outputs(p: AttentionProblem):
    """Output and lse tensors, allocated in the output layout (canonical views returned), with the
    per-batch row bases / existing rows [3, B] and the (head, row) strides of out and lse."""
    B, N, QS, Dv, geom = p.B, p.N, p.Q_S, p.Dv, p.geometry
    dt = torch.float32 if p.out_quant is not None else p.out_dtype      # int8 output: the epilogue quantizes
    lay = p.layout.out
    if p.packed:
        T = p.T
        if lay == "TND":
            out = torch.empty((T, N, Dv), dtype=dt).permute(1, 0, 2)        # canonical [N, T, Dv]
        else:
            out = torch.empty((N, T, Dv), dtype=dt)
        lse = torch.empty((N, T), dtype=torch.float32)
        st = out.stride()
        obase = np.array([[g.q_offset * st[1] for g in geom], [g.q_offset for g in geom],
                          [g.q_rows for g in geom]], np.int64)
        return out, lse, obase, (st[0], st[1]), (T, 1)
    if lay in ("BSH", "BSND"):
        out = torch.empty((B, QS, N, Dv), dtype=dt).permute(0, 2, 1, 3)
    elif lay == "NBSD":
        out = torch.empty((N, B, QS, Dv), dtype=dt).permute(1, 0, 2, 3)
    else:
        out = torch.empty((B, N, QS, Dv), dtype=dt)
    lse = torch.empty((B, N, QS), dtype=torch.float32)
    st = out.stride()
    obase = np.array([[b * st[0] for b in range(B)], [b * N * QS for b in range(B)], [QS] * B], np.int64)
    return out, lse, obase, (st[1], st[2]), (QS, 1)

def _bufs(bufs: list) -> np.ndarray:
    """[(address, bytes)] -> int64 [2, BUF_LEN]."""
    return np.array([[a for a, _ in bufs], [n for _, n in bufs]], np.int64)


def _chan(t: torch.Tensor, gran: str, H: int, D: int) -> torch.Tensor:
    """A tensor / channel / head dequant factor as float32 [H, D]."""
    t = t.to(torch.float32)
    if gran == "tensor":
        return t.reshape(1, 1).expand(H, D)
    if gran == "channel":
        return t.reshape(H, D)
    if gran == "head":
        return t.reshape(H, 1).expand(H, D)
    raise AssertionError(gran)


def _chunk(dq: int, dv: int, rows: int) -> int:
    """Keys per chunk: CHUNK_FLOATS // head dim, at most 16384 // rows (the [rows, C] score block stays
    in L2), a multiple of 4 in [8, 256]."""
    c = min(CHUNK_FLOATS // max(dq, dv, 1), 16384 // max(rows, 1))
    return int(max(8, min(256, c - c % 4)))


# ---------------------------------------------------------------------------------------------- threads
_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool on demand."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool(n: int):
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            from concurrent.futures import ThreadPoolExecutor
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fia-decode")
            _POOL_SIZE = n
        return _POOL


def _launch(fn, work: np.ndarray, H: int, R: int, threads: int, keys_total: int, args: tuple) -> None:
    """Run fn(items, counter, *args) over every item (w * H + h) on up to `threads` threads.

    Items are queued longest first and the threads take them one at a time through a shared atomic
    counter (dynamic scheduling: on a shared machine a thread may lose its core for a while, e.g. to
    torch's OpenMP workers spinning after the previous op). fn releases the GIL; the calling thread
    works too. Small work (keys_total x H x R < PARALLEL_MIN_WORK) stays on the calling thread."""
    n = work.shape[1] * H
    if n == 0:
        return
    counter = np.zeros(1, np.int64)
    t = min(threads, n)
    if t <= 1 or keys_total * H * R < PARALLEL_MIN_WORK:
        fn(np.arange(n, dtype=np.int64), counter, *args)
        return
    keys = np.repeat(work[2] - work[1], H)                                    # [n] cost of each item
    order = np.argsort(-keys, kind="stable").astype(np.int64)
    pool = _pool(t - 1)
    futs = [pool.submit(fn, order, counter, *args) for _ in range(1, t)]
    try:
        fn(order, counter, *args)
    finally:
        for f in futs:
            f.result()


# ---------------------------------------------------------------------------------------------- sources
def _tok_params(spec, B: int, block_size: int, paged_tbl):
    """(mode, tbl, bs, blk, h, s, scale, offset) of a per-token dequant spec (mode 0: none)."""
    if spec is None or not spec.per_token:
        return 0, _dummy(np.int64, 2), _BIG, 0, 0, 0, None, None
    sc, off = spec.scale, spec.offset
    if off is not None and off.stride() != sc.stride():
        sc, off = sc.contiguous(), off.contiguous()
    st = sc.stride()
    g = spec.granularity
    if g in ("token", "token_head"):              # [Bs, S] / [Bs, KV_N, S]: logical position p
        bsel = np.arange(B, dtype=np.int64) if sc.shape[0] > 1 else np.zeros(B, np.int64)
        tbl, bs = bsel[:, None].copy(), _BIG
    else:                                         # [NB, bs] / [NB, KV_N, bs]: by paged block
        tbl, bs = paged_tbl, block_size
    hs = st[1] if g in ("token_head", "block_token_head") else 0
    mode = 2 if off is not None else 1
    return mode, tbl, bs, st[0], hs, st[-1], sc, off


class _Source:
    """One KV storage the kernel reads in place: buffers, block table, strides, per-token scales.

    Key position p of query group i is element tbl[i, p // bs] * s_blk + h * s_h + (p % bs) * s_s."""

    def __init__(self, p: AttentionProblem, key, value, rope, tbl, bs, blk_axis: Optional[int], h_axis: int,
                 s_axis: int, batch: Optional[int] = None):
        self.tbl, self.bs, self.batch = tbl, bs, batch
        self.key, self.value, self.rope = key, value, rope
        self.kkind, self.vkind = _kind(key), _kind(value)

        def strides(t):
            st = t.stride()
            return (st[blk_axis] if blk_axis is not None else 0, st[h_axis], st[s_axis])
        self.kst, self.vst = strides(key), strides(value)
        if rope is not None:
            self.rkind, self.rst = _kind(rope), strides(rope)
        else:
            self.rkind, self.rst = 0, (0, 0, 0)
        aq = p.antiquant
        ptbl = tbl if p.kv.kind == "paged" else None
        (self.kt_mode, self.kt_tbl, self.kt_bs, self.kt_blk, self.kt_h, self.kt_s, self.kts,
         self.kto) = _tok_params(aq.key if aq else None, p.B, bs, ptbl)
        (self.vt_mode, self.vt_tbl, self.vt_bs, self.vt_blk, self.vt_h, self.vt_s, self.vts,
         self.vto) = _tok_params(aq.value if aq else None, p.B, bs, ptbl)

    def generic(self):
        """None when the fused kernels cover this source (bf16 / fp16 / int8 K and V, no rope): the
        kernel build without the generic paths (see attend_items); else a marker array."""
        fused = (_FUSED_KIND.get(self.kkind) and _FUSED_KIND.get(self.vkind) and self.rope is None)
        return None if fused else _dummy(np.uint8)

    def entries(self, work, wrange):
        """The work entries [w0, w1) this source serves (all, or one batch's for tensor lists)."""
        if self.batch is None:
            return 0, work.shape[1]
        return int(wrange[0, self.batch]), int(wrange[1, self.batch])

    def fill(self, ip: list, bufs: list, K) -> None:
        bufs[K.BUF_K] = _addr(self.key)
        bufs[K.BUF_V] = _addr(self.value)
        if self.rope is not None:
            bufs[K.BUF_R] = _addr(self.rope)
        if self.kt_mode:
            bufs[K.BUF_KTS], bufs[K.BUF_KTO] = _addr(self.kts), _addr(self.kto)
        if self.vt_mode:
            bufs[K.BUF_VTS], bufs[K.BUF_VTO] = _addr(self.vts), _addr(self.vto)
        ip[K.IP_BS] = self.bs
        ip[K.IP_K_BLK], ip[K.IP_K_H], ip[K.IP_K_S] = self.kst
        ip[K.IP_K_KIND] = self.kkind
        ip[K.IP_R_BLK], ip[K.IP_R_H], ip[K.IP_R_S] = self.rst
        ip[K.IP_R_KIND] = self.rkind
        ip[K.IP_V_BLK], ip[K.IP_V_H], ip[K.IP_V_S] = self.vst
        ip[K.IP_V_KIND] = self.vkind
        ip[K.IP_KT_MODE], ip[K.IP_KT_BS], ip[K.IP_KT_BLK], ip[K.IP_KT_H], ip[K.IP_KT_S] = (
            self.kt_mode, self.kt_bs, self.kt_blk, self.kt_h, self.kt_s)
        ip[K.IP_VT_MODE], ip[K.IP_VT_BS], ip[K.IP_VT_BLK], ip[K.IP_VT_H], ip[K.IP_VT_S] = (
            self.vt_mode, self.vt_bs, self.vt_blk, self.vt_h, self.vt_s)


def _sources(p: AttentionProblem, B: int):
    kv = p.kv
    if kv.kind == "dense":                          # [B, H, S, D]
        tbl = np.arange(B, dtype=np.int64)[:, None].copy()
        yield _Source(p, kv.key, kv.value, kv.key_rope, tbl, _BIG, 0, 1, 2)
    elif kv.kind == "packed":                       # [H, T, D]; batch b starts at kv_offset
        tbl = np.array([g.kv_offset for g in p.geometry], np.int64).reshape(B, 1)
        yield _Source(p, kv.key, kv.value, kv.key_rope, tbl, _BIG, 1, 0, 1)
    elif kv.kind == "paged":                        # [NB, H, bs, D] + block table, read in place
        tbl = kv.block_table.to(torch.int64).contiguous().numpy()
        yield _Source(p, kv.key, kv.value, kv.key_rope, tbl, kv.block_size, 0, 1, 2)
    elif kv.kind == "list":                         # per batch [H, S_b, D]
        tbl = np.zeros((B, 1), np.int64)
        for b in range(B):
            kr = None if kv.key_ropes is None else kv.key_ropes[b]
            yield _Source(p, kv.keys[b], kv.values[b], kr, tbl, _BIG, None, 0, 1, batch=b)
    else:  # pragma: no cover
        raise AssertionError(kv.kind)
