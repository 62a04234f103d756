"""Tiling plan of the prefill backend: which (row block, key segment) rectangles run, and how.

Coordinates are window-local (SPEC 5): row i in [0, S1), key j in [0, S2) (prefix keys first). The band
(pre, next) of MaskSpec.band_for keeps key j for row i iff i - pre <= j <= i + next. A segment is
* FULL    every row of the block keeps every key of the segment: no mask;
* CAUSAL  row i0 + r keeps segment column c iff c <= r (the kernel's top-left is_causal);
* RCAUSAL the same after flipping rows and columns: row i1 - 1 - r keeps column c1 - 1 - c iff c <= r
          (the left edge of a band; run as is_causal on flipped copies of the small q/k/v tiles);
* MASKED  a tile whose mask is built on the fly (band edge and/or user-mask tile), at most `chunk` columns.
Keys the band excludes for every row of a block are never part of a segment (tile skipping); rows the
band leaves without any key belong to no block and keep their initial 0 / +inf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

FULL, CAUSAL, RCAUSAL, MASKED = "full", "causal", "rcausal", "masked"


@dataclass(frozen=True)
class Segment:
    c0: int
    c1: int
    kind: str
    band: bool = False     # MASKED: the band predicate cuts into this tile


@dataclass
class BlockPlan:
    i0: int
    i1: int
    segments: List[Segment] = field(default_factory=list)
    nb: int = 1          # > 1: nb consecutive interior band blocks of bq rows, one batched kernel call;
    bq: int = 0          # block b covers rows i0 + b*bq and keys segments[0] shifted by b*bq


def _chunks(c0: int, c1: int, chunk: int, kind: str, band: bool) -> List[Segment]:
    return [Segment(a, min(c1, a + chunk), kind, band) for a in range(c0, c1, chunk)]


def plan_batch(s1: int, s2: int, band: Optional[Tuple[int, int]], user: bool, block_q: int,
               chunk: int, causal_block: Optional[int] = None, band_split: bool = False,
               band_batched: bool = False, band_block_q: Optional[int] = None) -> List[BlockPlan]:
    """Blocks covering every row that can see a key. causal_block: row block of causal-like plans
    (None = the whole window in one block). band_split: band blocks as RCAUSAL + FULL + CAUSAL (three
    unmasked calls, merged) instead of one MASKED call over the block's key span. band_batched: runs of
    interior band blocks (same tile relative to the block) become one BlockPlan with nb > 1 (one kernel
    call over overlapping strided views of q, k, v: no copies)."""
    if user:
        return _plan_user(s1, s2, band, block_q, chunk)
    if band is None:
        return [BlockPlan(0, s1, [Segment(0, s2, FULL)])]
    pre, nxt = band
    if pre >= s1 - 1:                       # the left edge never cuts: causal-like (or no mask at all)
        if nxt >= s2 - 1:
            return [BlockPlan(0, s1, [Segment(0, s2, FULL)])]
        # next <= 0: one top-left causal call; next > 0: FULL + CAUSAL merged per row block
        return _plan_causal_like(s1, s2, nxt, causal_block or (max(s1, 1) if nxt <= 0 else 2048))
    return _plan_band(s1, s2, pre, nxt, band_block_q or block_q, chunk, band_split, band_batched)


def _plan_causal_like(s1: int, s2: int, d: int, rb: int) -> List[BlockPlan]:
    """Row i keeps keys j <= i + d (d < s2 - 1). Rows with i + d < 0 see nothing."""
    blocks = []
    start = max(0, -d)
    for i0 in range(start, s1, rb):
        i1 = min(s1, i0 + rb)
        c = i0 + d                           # first column row i0 does not fully share with later rows
        segs = []
        if c > 0:
            segs.append(Segment(0, min(c, s2), FULL))
        if c < s2:
            segs.append(Segment(c, min(s2, i1 + d), CAUSAL))
        blocks.append(BlockPlan(i0, i1, segs))
    return blocks


def _plan_band(s1: int, s2: int, pre: int, nxt: int, bq: int, chunk: int, split: bool = False,
               batched: bool = False) -> List[BlockPlan]:
    """A band whose left edge cuts. Per row block [i0, i1): keys [lo, hi) kept by some row; columns
    a = i1 - 1 - pre .. b = i0 + next are kept by every row. Left of a the kept region is a triangle whose
    flip is top-left causal (RCAUSAL, anchored at a); right of b a top-left causal triangle anchored at b."""
    blocks = []
    bq = max(32, min(bq, pre + nxt))      # narrow bands: smaller blocks waste fewer masked keys
    for i0 in range(0, s1, bq):
        i1 = min(s1, i0 + bq)
        lo, hi = max(0, i0 - pre), min(s2, i1 + nxt)      # keys any row of the block keeps
        if hi <= lo:
            continue                                        # the band leaves this block no key
        a, b = i1 - 1 - pre, i0 + nxt
        segs: List[Segment] = []
        if batched and not split and i1 == i0 + bq and i0 - pre >= 0 and i1 + nxt <= s2:
            # interior block: the same band tile relative to the block -> batch consecutive ones
            last = blocks[-1] if blocks else None
            seg0 = last.segments[0] if last is not None and last.segments else None
            if last is not None and last.bq == bq and last.i1 == i0 and seg0.kind == MASKED and \
                    seg0.c0 == last.i0 - pre and seg0.c1 - seg0.c0 == bq + pre + nxt:
                last.i1 = i1
                last.nb += 1
                continue
            blocks.append(BlockPlan(i0, i1, [Segment(i0 - pre, i1 + nxt, MASKED, True)], 1, bq))
            continue
        if split and a < b and b >= 0 and (lo >= a or a < s2):
            full_lo = lo
            if lo < a:
                segs.append(Segment(lo, a + 1, RCAUSAL))
                full_lo = a + 1
            full_hi = hi
            if b + 1 < hi:
                full_hi = b
                segs.append(Segment(b, hi, CAUSAL))
            if full_hi > full_lo:
                segs.append(Segment(full_lo, full_hi, FULL))
        else:
            segs += _chunks(lo, hi, chunk, MASKED, True)
        blocks.append(BlockPlan(i0, i1, segs))
    return blocks


def _plan_user(s1: int, s2: int, band, bq: int, chunk: int) -> List[BlockPlan]:
    """A user mask: every tile reads its mask; band-free rectangles are only cut by the user mask."""
    blocks = []
    for i0 in range(0, s1, bq):
        i1 = min(s1, i0 + bq)
        if band is None:
            lo, hi, fl, fh = 0, s2, 0, s2
        else:
            pre, nxt = band
            lo, hi = max(0, i0 - pre), min(s2, i1 + nxt)
            fl, fh = max(lo, i1 - 1 - pre), min(hi, i0 + nxt + 1)
        if hi <= lo:
            continue
        segs = [Segment(a, min(hi, a + chunk), MASKED, not (a >= fl and min(hi, a + chunk) <= fh))
                for a in range(lo, hi, chunk)]
        blocks.append(BlockPlan(i0, i1, segs))
    return blocks


def band_outside_tile(i0: int, i1: int, c0: int, c1: int, band, device) -> torch.Tensor:
    """[rows, cols] bool, True where the band excludes key j from row i."""
    pre, nxt = band
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(c0, c1, device=device).unsqueeze(0)
    return (j > i + nxt) | (j < i - pre)


def band_dead_rows(i0: int, i1: int, s2: int, band, device) -> torch.Tensor:
    """[rows] bool: rows the band leaves without any key (SPEC 6: output 0, lse +inf)."""
    pre, nxt = band
    i = torch.arange(i0, i1, device=device)
    lo = (i - pre).clamp(min=0)
    hi = (i + nxt).clamp(max=s2 - 1)
    return lo > hi


def dead_row_ranges(i0: int, i1: int, s2: int, band) -> List[Tuple[int, int]]:
    """Block-local row ranges [a, b) that the band leaves without any key (SPEC 6: 0 / +inf).

    Row i keeps a key iff max(0, i - pre) <= min(S2 - 1, i + next), i.e. pre + next >= 0,
    i >= -next and i <= S2 - 1 + pre."""
    pre, nxt = band
    if pre + nxt < 0 or s2 <= 0:
        return [(0, i1 - i0)]
    out = []
    a = min(i1, -nxt)
    if a > i0:
        out.append((0, a - i0))
    c = max(i0, s2 + pre)
    if c < i1:
        out.append((c - i0, i1 - i0))
    return out
