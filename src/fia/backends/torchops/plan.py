"""Batch groups (batches run together, padded to the group's longest window) and tile classification.

All of it is metadata: Python ints from the problem's geometry, never tensor data (no device syncs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...problem.attention import AttentionProblem

# tile states of one batch (rows [r0, r1) x keys [c0, c1))
NONE, FULL, PARTIAL, OUT = 0, 1, 2, 3


@dataclass
class Group:
    """Batches computed as one padded [Bg, N, S1, ...] problem. Lists hold one entry per batch of the group."""
    bidx: List[int]
    s1: List[int]
    s2: List[int]                   # effective keys (prefix + own)
    q_lo: List[int]
    kv_lo: List[int]
    bands: List[Optional[Tuple[int, int]]]   # window-local (pre, next) per batch, or None
    prefix: int
    device: torch.device

    def __post_init__(self):
        dev = self.device
        self.Bg = len(self.bidx)
        self.S1 = max(self.s1)
        self.S2 = max(self.s2)
        self.s2_min = min(self.s2)
        b0 = self.bidx[0]
        self.bslice = slice(b0, b0 + self.Bg) if self.bidx == list(range(b0, b0 + self.Bg)) else None
        self.uniform_q = len(set(self.q_lo)) == 1
        self.uniform_kv = len(set(self.kv_lo)) == 1
        self.b_t = torch.tensor(self.bidx, dtype=torch.long, device=dev)                 # [Bg]
        self.s1_t = torch.tensor(self.s1, dtype=torch.long, device=dev)                  # [Bg]
        self.s2_t = torch.tensor(self.s2, dtype=torch.long, device=dev)                  # [Bg]
        self.q_lo_t = torch.tensor(self.q_lo, dtype=torch.long, device=dev)              # [Bg]
        self.kv_lo_t = torch.tensor(self.kv_lo, dtype=torch.long, device=dev)            # [Bg]
        own_hi = [lo + s - self.prefix for lo, s in zip(self.kv_lo, self.s2)]
        self.kv_last_t = torch.tensor([h - 1 for h in own_hi], dtype=torch.long, device=dev)  # last own position
        self.has_band = any(b is not None for b in self.bands)
        self.uniform_band = len(set(self.bands)) == 1
        if self.has_band:
            self.pre_t = torch.tensor([b[0] for b in self.bands], dtype=torch.long, device=dev)   # [Bg]
            self.next_t = torch.tensor([b[1] for b in self.bands], dtype=torch.long, device=dev)  # [Bg]

    def tile_states(self, r0: int, r1: int, c0: int, c1: int) -> List[int]:
        """Per batch: NONE (no valid row or key in the tile), FULL (no band or every pair inside it),
        OUT (every valid pair outside the band), PARTIAL."""
        st = []
        for s1, s2, band in zip(self.s1, self.s2, self.bands):
            rl, cl = min(r1, s1) - 1, min(c1, s2) - 1       # last valid row / key in the tile
            if r0 > rl or c0 > cl:
                st.append(NONE)
            elif band is None:
                st.append(FULL)
            else:
                pre, nxt = band
                if pre + nxt < 0 or rl + nxt < c0 or r0 - pre > cl:
                    st.append(OUT)
                elif cl <= r0 + nxt and c0 >= rl - pre:
                    st.append(FULL)
                else:
                    st.append(PARTIAL)
        return st

    def band_dead(self) -> Optional[torch.Tensor]:
        """[Bg, S1] bool: rows the band leaves no key (output 0, lse +inf whatever else holds), or None."""
        if not self.has_band:
            return None
        i = torch.arange(self.S1, device=self.device)[None, :]                      # [1, S1]
        pre, nxt = self.pre_t[:, None], self.next_t[:, None]                        # [Bg, 1]
        return (i + nxt < 0) | (i - pre > self.s2_t[:, None] - 1) | (pre + nxt < 0)


def groups(p: AttentionProblem, waste: float = 1.5, min_cost: int = 1 << 16, rows_elems: int = 1 << 22) -> List[Group]:
    """Batches with rows and keys, grouped so a group's padded cost (Bg x S1max x S2max) stays within
    `waste` x its real cost + `min_cost` (one group when lengths are equal), and a group whose scores fit
    rows_elems (N x Bg x S1max x S2max: the rows schedule) is not grown past it. Tensor-list KV: one batch
    per group (its tensors have their own lengths)."""
    live = [b for b, g in enumerate(p.geometry) if g.s1 > 0 and g.s2 > 0]
    if not live:
        return []
    geo = p.geometry
    max_bg = max(1, (1 << 21) // max(1, p.N * 64))      # keeps Bg x N x (1 row) x (64 keys) within a tile budget
    if p.kv.kind == "list":
        parts = [[b] for b in live]
    else:
        order = sorted(live, key=lambda b: (geo[b].s2, geo[b].s1), reverse=True)
        parts, cur, s1m, s2m, real = [], [], 0, 0, 0
        for b in order:
            g = geo[b]
            n1, n2, nr = max(s1m, g.s1), max(s2m, g.s2), real + g.s1 * g.s2
            fits, grown = len(cur) * s1m * s2m * p.N <= rows_elems, (len(cur) + 1) * n1 * n2 * p.N > rows_elems
            if cur and ((len(cur) + 1) * n1 * n2 > waste * nr + min_cost or len(cur) >= max_bg or (fits and grown)):
                parts.append(cur)
                cur, n1, n2, nr = [], g.s1, g.s2, g.s1 * g.s2
            cur.append(b)
            s1m, s2m, real = n1, n2, nr
        parts.append(cur)
    out = []
    for part in parts:
        part = sorted(part)
        gs = [geo[b] for b in part]
        out.append(Group(part, [g.s1 for g in gs], [g.s2 for g in gs], [g.q_lo for g in gs],
                         [g.kv_lo for g in gs], [p.mask.band_for(g.s1, g.s2) for g in gs],
                         gs[0].prefix, p.device))
    return out


def chunk_sizes(grp: Group, n: int, kv_n: int, dk: int, dv: int, block: int, kv_elems: int, score_elems: int,
                max_chunk: int) -> Tuple[int, int]:
    """(keys per chunk C, query rows per block R): one chunk's K / V in the compute dtype within kv_elems,
    one tile's scores (Bg x N x R x C) within score_elems. Paged KV: C a multiple of the block size."""
    c = kv_elems // max(1, grp.Bg * kv_n * (dk + dv))
    c = min(c, max_chunk, score_elems // max(1, grp.Bg * n))
    c = max(16, c)
    if block:
        c = max(block, c // block * block)
    c = min(c, grp.S2) if not block else min(c, -(-grp.S2 // block) * block)
    r = max(1, min(grp.S1, score_elems // max(1, grp.Bg * n * c)))
    return c, r
