"""One batch group of SPEC 3 in key chunks.

Two schedules, same rules:
* rows: the group's whole score rows fit the budget (decode, small prefill): K chunks fill one score buffer,
  one softmax over it, V chunks accumulate P·V -- few torch ops per chunk;
* online: key chunks outside, query row blocks inside, online softmax (running max / sum / output); memory
  is one chunk's K / V, one tile's scores and the accumulators (the size of the output), never [S1, S2].
Scores accumulate in the compute dtype (float32, float64 for float64 input), like the reference. Padding keys
(past a batch's window) score -inf: they are not keys. Masked keys take the finite fill (SPEC 3), so a fully
masked row averages its keys exactly as the reference does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...problem.attention import MASK_FILL, AttentionProblem
from . import gather
from .plan import NONE, OUT, PARTIAL, Group, chunk_sizes

_NEG_INF = float("-inf")


@dataclass
class Tiling:
    kv_elems: int       # one chunk's K (or V) elements in the compute dtype
    score_elems: int    # one tile's scores (online schedule)
    rows_elems: int     # the whole group's scores at most this many elements: the rows schedule
    max_chunk: int      # keys per chunk at most (online: smaller chunks skip more band tiles)


def _qk(p: AttentionProblem, qb: torch.Tensor, k: torch.Tensor, int8: bool, scaled: bool = True,
        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q·Kᵀ [Bg, KV_N, G*R, C] (times scale unless not `scaled`), into `out` when given. int8: exact int32(Q·Kᵀ)
    in float64, then (· dequant_scale1) · scale in float32 (SPEC 11)."""
    if int8:
        s = (torch.matmul(qb, k.transpose(-1, -2)).to(torch.float32) * p.full_quant.dequant_scale1) * p.scale
        return s if out is None else out.copy_(s)
    s = torch.matmul(qb, k.transpose(-1, -2), out=out) if out is not None else torch.matmul(qb, k.transpose(-1, -2))
    return s.mul_(p.scale) if scaled else s


def _post(p: AttentionProblem, grp: Group, s: torch.Tensor, r0: int, r1: int, c0: int, c1: int, states: List[int]):
    """Bias, masks and padding of one tile's scaled scores s [Bg, N, R, C] in place: whether it has padding
    keys, and its hidden mask [Bg or 1, 1, R, C] (masked or padding) or None."""
    bias = gather.pse(p, grp, r0, r1, c0, c1, s.dtype)
    if bias is not None:
        s.add_(bias)
    masked = None
    if any(st in (PARTIAL, OUT) for st in states):
        masked = gather.band_mask(grp, r0, r1, c0, c1)
    um = gather.user_mask(p, grp, r0, r1, c0, c1)
    if um is not None:
        masked = um if masked is None else masked | um
    if masked is not None:
        s.masked_fill_(masked, MASK_FILL)
    pad = None
    if c1 > grp.s2_min:
        pad = (torch.arange(c0, c1, device=grp.device)[None, :] >= grp.s2_t[:, None])[:, None, None]  # [Bg, 1, 1, C]
        s.masked_fill_(pad, _NEG_INF)
    hidden = masked if pad is None else (pad if masked is None else masked | pad)
    return pad is not None, hidden


def _scores(p: AttentionProblem, grp: Group, qb: torch.Tensor, k: torch.Tensor, r0: int, r1: int, c0: int,
            c1: int, states: List[int], int8: bool):
    """Scaled, biased, masked scores [Bg, N, R, C] of one tile, whether it has padding keys, its hidden mask."""
    s = _qk(p, qb, k, int8).view(grp.Bg, p.N, r1 - r0, c1 - c0)
    pad, hidden = _post(p, grp, s, r0, r1, c0, c1, states)
    return s, pad, hidden


def _grouped(x: torch.Tensor, kv_n: int) -> torch.Tensor:
    """[Bg, N, R, D] -> [Bg, KV_N, G*R, D] (heads n = h*G + i), explicit sizes: D may be 0."""
    bg, n, r, d = x.shape
    return x.reshape(bg, kv_n, (n // kv_n) * r, d)


def _live(hidden: Optional[torch.Tensor], bg: int, R: int, dev) -> torch.Tensor:
    """[Bg, R] rows of a tile with a key neither masked nor padding."""
    if hidden is None:
        return torch.ones(bg, R, dtype=torch.bool, device=dev)
    return (~hidden).any(dim=-1)[:, 0].expand(bg, R)


class _Row:
    """Online state of one query row block: m, l [Bg, N, R]; acc [Bg, N, R, Dv] (normalized: the weighted mean of
    the values so far, so it never overflows where the values do not); alive [Bg, R]."""
    __slots__ = ("m", "l", "acc", "alive")

    def __init__(self):
        self.m = self.l = self.acc = self.alive = None


def _fold(row: _Row, s: torch.Tensor, v: Optional[torch.Tensor], pad: bool, kv_n: int) -> None:
    """Fold one tile into the row block's running max / sum / output (v None: statistics only)."""
    bg, n, R, C = s.shape
    mc = s.amax(dim=-1)                                                   # [Bg, N, R]
    m_new = mc if row.m is None else torch.maximum(row.m, mc)
    ms = m_new.masked_fill(m_new == _NEG_INF, 0.0) if pad else m_new      # rows with only padding so far
    s.sub_(ms[..., None]).exp_()
    ls = s.sum(dim=-1)
    pv = None
    if v is not None:                                                     # the tile's weighted mean of V
        s.div_(torch.where(ls > 0, ls, 1.0)[..., None])
        pv = torch.matmul(s.view(bg, kv_n, -1, C), v).view(bg, n, R, v.shape[-1])
    if row.m is None:
        row.l, row.acc = ls, pv
    else:
        alpha = torch.exp(row.m - ms)                                     # 0 where the old max was -inf
        old = row.l.mul_(alpha)
        row.l = old + ls
        if pv is not None:                                                # means merged by their weights (<= 1)
            tot = torch.where(row.l > 0, row.l, 1.0)
            row.acc = row.acc.mul_((old / tot)[..., None]).add_(pv.mul_((ls / tot)[..., None]))
    row.m = m_new


def _tiles(grp: Group, C: int, R: int, skip_ok: bool):
    """(c0, c1, [(row block index, r0, r1, states)]) for every key chunk with work."""
    for c0 in range(0, grp.S2, C):
        c1 = min(c0 + C, grp.S2)
        work = []
        for rb, r0 in enumerate(range(0, grp.S1, R)):
            r1 = min(r0 + R, grp.S1)
            st = grp.tile_states(r0, r1, c0, c1)
            if all(x == NONE or (x == OUT and skip_ok) for x in st):
                continue
            work.append((rb, r0, r1, st))
        if work:
            yield c0, c1, work


def _online(p: AttentionProblem, grp: Group, q: torch.Tensor, reader, tiling: Tiling, mm, skip_ok: bool,
            track_alive: bool):
    """The online schedule: (acc, l, m, alive) for the group's rows, acc in mm, the rest in the compute dtype."""
    int8 = p.full_quant is not None
    cd, dev = p.compute_dtype, grp.device
    bg, n, kv_n, S1, dq = grp.Bg, p.N, p.KV_N, grp.S1, q.shape[-1]
    block = p.kv.block_size if p.kv.kind == "paged" else 0
    C, R = chunk_sizes(grp, n, kv_n, dq, p.Dv, block, tiling.kv_elems, tiling.score_elems, tiling.max_chunk)
    qbs = [_grouped(q[:, :, r0:r0 + R], kv_n).to(mm) for r0 in range(0, S1, R)]   # [Bg, KV_N, G*R, Dq]
    rows = [_Row() for _ in qbs]
    for c0, c1, work in _tiles(grp, C, R, skip_ok):
        k = reader.read("key", c0, c1)                                    # [Bg, KV_N, C, Dq]
        v = None if int8 else reader.read("value", c0, c1)                # [Bg, KV_N, C, Dv]
        for rb, r0, r1, st in work:
            s, pad, hidden = _scores(p, grp, qbs[rb], k, r0, r1, c0, c1, st, int8)
            row = rows[rb]
            if track_alive:
                live = _live(hidden, bg, r1 - r0, dev)
                row.alive = live.clone() if row.alive is None else row.alive | live
            _fold(row, s, v, pad, kv_n)
    if int8:                                                              # second pass: P quantized (SPEC 11)
        for c0, c1, work in _tiles(grp, C, R, skip_ok):
            k, v = reader.read("key", c0, c1), reader.read("value", c0, c1)
            for rb, r0, r1, st in work:
                row = rows[rb]
                s, pad, _ = _scores(p, grp, qbs[rb], k, r0, r1, c0, c1, st, True)
                ms = row.m.masked_fill(row.m == _NEG_INF, 0.0) if pad else row.m
                pv = _pv_int8(p, s.sub_(ms[..., None]).exp_(), v, kv_n)
                row.acc = pv if row.acc is None else row.acc.add_(pv)
    out = []
    for rb, row in enumerate(rows):
        r = qbs[rb].shape[2] // p.G
        if row.m is None:                                                 # every tile skipped: dead rows
            row.m = torch.full((bg, n, r), _NEG_INF, dtype=cd, device=dev)
            row.l = torch.zeros((bg, n, r), dtype=cd, device=dev)
        if row.acc is None:
            row.acc = torch.zeros((bg, n, r, p.Dv), dtype=mm, device=dev)
        if track_alive and row.alive is None:
            row.alive = torch.zeros(bg, r, dtype=torch.bool, device=dev)
        out.append(row)
    cat = (lambda xs: xs[0]) if len(out) == 1 else (lambda xs: torch.cat(xs, dim=2))
    alive = None if not track_alive else (out[0].alive if len(out) == 1 else torch.cat([r.alive for r in out], 1))
    return cat([r.acc for r in out]), cat([r.l for r in out]), cat([r.m for r in out]), alive


def _pv_int8(p: AttentionProblem, e: torch.Tensor, v: torch.Tensor, kv_n: int) -> torch.Tensor:
    """int32(P8·V) exact in float64 [Bg, N, R, Dv]: P8 = sat_int8(round_half_even(e * quant_scale1)), e the
    unnormalized exponentials exp(S - rowmax) (SPEC 11: the row sum divides after the product)."""
    bg, n, R, C = e.shape
    p8 = torch.round(e.mul_(p.full_quant.quant_scale1)).clamp_(-128, 127).to(torch.float64)
    return torch.matmul(p8.view(bg, kv_n, -1, C), v).view(bg, n, R, v.shape[-1])


def _rows(p: AttentionProblem, grp: Group, q: torch.Tensor, reader, tiling: Tiling, mm, skip_ok: bool,
          track_alive: bool):
    """The rows schedule (whole score rows in one buffer): (acc, l, m, alive) like _online."""
    int8 = p.full_quant is not None
    cd, dev = p.compute_dtype, grp.device
    bg, n, kv_n, S1, S2, dq = grp.Bg, p.N, p.KV_N, grp.S1, grp.S2, q.shape[-1]
    C = max(16, min(S2, tiling.kv_elems // max(1, bg * kv_n * max(dq, p.Dv))))
    chunks = [(c0, min(c0 + C, S2)) for c0 in range(0, S2, C)]
    qb = _grouped(q, kv_n).to(mm)                                         # [Bg, KV_N, G*S1, Dq]
    gr = qb.shape[2]
    buf = torch.empty((len(chunks), bg, kv_n, gr, C), dtype=cd, device=dev)   # scores, chunk-major
    states = [grp.tile_states(0, S1, c0, c1) for c0, c1 in chunks]
    # the band hides a chunk entirely: its keys get weight 0 (exp(fill - max) underflows), never read
    skip = [skip_ok and all(x in (NONE, OUT) for x in st) for st in states]
    for i, (c0, c1) in enumerate(chunks):                                 # Q·Kᵀ only: few ops per chunk
        if skip[i]:
            continue
        k = reader.read("key", c0, c1)                                    # [Bg, KV_N, c, Dq]
        if c1 - c0 == C and not int8:
            _qk(p, qb, k, False, scaled=False, out=buf[i])
        else:
            buf[i][..., :c1 - c0] = _qk(p, qb, k, int8, scaled=False)
    if not int8:
        buf.mul_(p.scale)                                                 # one pass: S = Q·Kᵀ · scale
    sv = buf.view(len(chunks), bg, n, S1, C)
    alive = None
    for i, (c0, c1) in enumerate(chunks):                                 # then bias, masks, padding, in order
        if skip[i]:
            sv[i].fill_(_NEG_INF)
            continue
        if c1 - c0 < C:
            sv[i][..., c1 - c0:] = _NEG_INF
        _, hidden = _post(p, grp, sv[i][..., :c1 - c0], 0, S1, c0, c1, states[i])
        if track_alive:
            live = _live(hidden, bg, S1, dev)
            alive = live.clone() if alive is None else alive | live
    m = sv.amax(dim=(0, 4))                                               # [Bg, N, S1]
    if track_alive and alive is None:
        alive = torch.zeros(bg, S1, dtype=torch.bool, device=dev)
    if p.sink is not None and not int8:                                   # one extra column, no value (SPEC 1.1b)
        m = torch.maximum(m, p.sink.to(cd)[None, :, None])
    ms = m.masked_fill(m == _NEG_INF, 0.0)                                # rows the band left no key
    sv.sub_(ms[None, ..., None]).exp_()
    l = sv.sum(dim=(0, 4))                                                # [Bg, N, S1]
    if p.sink is not None and not int8:
        l = l + torch.exp(p.sink.to(cd)[None, :, None] - ms)
    if not int8:                                                          # probabilities before P·V, as the
        sv.div_(l[None, ..., None])                                       # reference: no overflow of sum(e·v)
    acc = torch.zeros((bg, kv_n, gr, p.Dv), dtype=mm, device=dev)
    for i, (c0, c1) in enumerate(chunks):
        if skip[i]:
            continue
        v = reader.read("value", c0, c1)                                  # [Bg, KV_N, c, Dv]
        e = buf[i][..., :c1 - c0]                                         # [Bg, KV_N, G*S1, c]
        if int8:
            acc.add_(_pv_int8(p, e.view(bg, n, S1, c1 - c0), v, kv_n).view(bg, kv_n, gr, p.Dv))
        else:
            acc.view(bg * kv_n, gr, p.Dv).baddbmm_(e.reshape(bg * kv_n, gr, c1 - c0),
                                                   v.reshape(bg * kv_n, c1 - c0, p.Dv))
    return acc.view(bg, n, S1, p.Dv), l, m, alive


def run_group(p: AttentionProblem, grp: Group, tiling: Tiling) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [Bg, N, S1, Dv], lse [Bg, N, S1] in the compute dtype; rows past a batch's S1 and dead rows are
    0 / +inf (SPEC 6)."""
    cd, dev = p.compute_dtype, grp.device
    int8 = p.full_quant is not None
    mm = torch.float64 if int8 else cd                                    # int8 products exact in float64
    q = gather.query(p, grp, cd)                                          # [Bg, N, S1, Dq]
    reader = gather.KVReader(p, grp, mm)
    # tiles the band hides entirely are skipped unless a user mask or pse could leave a row no other key
    skip_ok = p.mask.user_mask is None and p.pse is None
    track_alive = p.row_invalid_fix and p.sink is None and p.mask.user_mask is not None
    rows = grp.Bg * p.N * grp.S1 * grp.S2 <= tiling.rows_elems
    acc, l, m, alive = (_rows if rows else _online)(p, grp, q, reader, tiling, mm, skip_ok, track_alive)
    if int8:    # SPEC 11: the row sum of E divides last (l = 0 only in rows without keys, dropped below)
        out = (acc.to(torch.float32) * p.full_quant.dequant_scale2) / torch.where(l > 0, l, 1.0)[..., None]
    else:                                                                 # acc: already the weighted mean
        if p.sink is not None and not rows:                               # one extra column, no value (SPEC 1.1b)
            sk = p.sink.to(cd)[None, :, None]                             # [1, N, 1]
            mf = torch.maximum(m, sk)
            a = torch.exp(m - mf)
            kept = l * a
            l = kept + torch.exp(sk - mf)
            acc = acc * (kept / l)[..., None]
            m = mf
        out = acc if acc.dtype == cd else acc.to(cd)
    lse = m + torch.log(l)

    drop = grp.band_dead()                                                # [Bg, S1] or None
    if track_alive:
        drop = ~alive if drop is None else drop | ~alive
    if any(s1 < grp.S1 for s1 in grp.s1):
        short = torch.arange(grp.S1, device=dev)[None, :] >= grp.s1_t[:, None]
        drop = short if drop is None else drop | short
    if drop is not None:
        out = out.masked_fill(drop[:, None, :, None], 0.0)
        lse = lse.masked_fill(drop[:, None, :], float("inf"))
    return out, lse
