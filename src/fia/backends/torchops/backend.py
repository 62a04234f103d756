"""The torch backend: every problem the reference runs, in vectorized torch ops on any device.

Batches with similar windows run together (padded, masked by length); keys stream in chunks through an
online softmax, so memory stays O(chunk) (attend.py). Same rules as the reference (SPEC 3-12),
float32 accumulation (float64 for float64 input). The preferred backend off the CPU; on the CPU it ranks
below the Numba decode / prefill backends and above the reference.
"""
from __future__ import annotations

from typing import List

import torch

from ...problem.attention import AttentionProblem
from ..base import PRIORITY_TORCH, Backend, BackendResult, Capabilities
from ..reference import unless_non_finite
from .attend import Tiling, run_group
from .plan import Group, groups


class TorchBackend(Backend):
    name = "torch"
    priority = PRIORITY_TORCH  # CPU: below prefill / decode, above the reference
    device_priority = 100    # any other device: the preferred backend
    capabilities = Capabilities(devices=("*",),        # any device torch computes on (not meta: it holds no data)
                                why={"devices": "device meta (tensors without data)"})

    # tiling (elements of the compute dtype): one chunk's K (or V), one online tile's scores, and the most
    # scores a group may hold whole (the rows schedule: decode, small prefill; 16 MiB in float32)
    kv_elems = 1 << 20       # 4 MiB float32 chunks: converted K / V still in cache when multiplied; fewer
    #                          chunks keep the op count low (each op is a thread barrier on a busy CPU)
    score_elems = 1 << 18    # 1 MiB tiles: the softmax passes stay in cache
    rows_elems = 1 << 22
    max_chunk = 512          # keys per chunk at most: causal prefill skips the tiles above the diagonal
    # batches run together while their padded cost stays within group_waste x real + group_min_cost scores
    group_waste = 1.5
    group_min_cost = 1 << 16
    # off the CPU every torch op is a kernel launch (~10 us of host time each) and memory is plentiful: the budgets
    # above times these factors (H200, bf16, 32/8 heads: decode at 4096 keys 1526 ops a call with the CPU's
    # tiles; causal prefill at 2048 27744)
    device_scale = {"kv_elems": 256, "score_elems": 256, "rows_elems": 16, "max_chunk": 8}

    def preference(self, p: AttentionProblem) -> int:
        return self.priority if p.device.type == "cpu" else self.device_priority

    def describe(self, p: AttentionProblem) -> str:
        gs = self._groups(p)
        rows = sum(g.Bg * p.N * g.S1 * g.S2 <= self._tiling(p.device).rows_elems for g in gs)
        return f"torch ops: {len(gs)} batch group(s): {rows} whole score rows, {len(gs) - rows} online softmax"

    def _tiling(self, dev: torch.device) -> Tiling:
        f = self.device_scale if dev.type != "cpu" else {}
        return Tiling(*(getattr(self, n) * f.get(n, 1) for n in ("kv_elems", "score_elems", "rows_elems",
                                                                "max_chunk")))

    def _groups(self, p: AttentionProblem) -> List[Group]:
        return groups(p, self.group_waste, self.group_min_cost, self._tiling(p.device).rows_elems)

    def run(self, p: AttentionProblem) -> BackendResult:
        cd, dev = p.compute_dtype, p.device
        tiling = self._tiling(dev)
        gs = self._groups(p)
        if len(gs) == 1 and not p.packed and _covers_all(p, gs[0]):
            o, l = run_group(p, gs[0], tiling)                                # the whole output, in order
            return unless_non_finite(p, BackendResult(o, l if p.want_lse else None))
        out = torch.zeros(p.out_shape(), dtype=cd, device=dev)                 # rows never computed: 0
        lse = torch.full(p.lse_shape(), float("inf"), dtype=cd, device=dev)   # ... and lse +inf (SPEC 6)
        for grp in gs:
            o, l = run_group(p, grp, tiling)                                  # [Bg, N, S1, Dv], [Bg, N, S1]
            if p.packed:
                _put_packed(p, grp, o, l, out, lse)
            else:
                _put_dense(p, grp, o, l, out, lse)
        return unless_non_finite(p, BackendResult(out, lse if p.want_lse else None))


def _covers_all(p: AttentionProblem, grp: Group) -> bool:
    """The group is every batch in order with every query row valid from row 0."""
    return grp.Bg == p.B and grp.bslice is not None and grp.S1 == p.Q_S and all(q == 0 for q in grp.q_lo)


def _put_dense(p: AttentionProblem, grp: Group, o, l, out, lse) -> None:
    """Row r of batch b <- group row r - q_lo (rows outside [q_lo, q_lo + S1) stay 0 / +inf)."""
    if grp.uniform_q and grp.bslice is not None:
        lo = grp.q_lo[0]
        out[grp.bslice, :, lo:lo + grp.S1] = o
        lse[grp.bslice, :, lo:lo + grp.S1] = l
        return
    r = torch.arange(p.Q_S, device=grp.device)[None, :] - grp.q_lo_t[:, None]       # [Bg, Q_S] group row
    off = (r < 0) | (r >= grp.S1)
    idx = r.clamp(0, grp.S1 - 1)[:, None, :].expand(-1, p.N, -1)                   # [Bg, N, Q_S]
    og = o.gather(2, idx[..., None].expand(-1, -1, -1, p.Dv)).masked_fill_(off[:, None, :, None], 0.0)
    lg = l.gather(2, idx).masked_fill_(off[:, None, :], float("inf"))
    out.index_copy_(0, grp.b_t, og)
    lse.index_copy_(0, grp.b_t, lg)


def _put_packed(p: AttentionProblem, grp: Group, o, l, out, lse) -> None:
    """Packed rows: row q_offset + q_lo + i of T <- group row i of the batch, for i < its S1."""
    dev = grp.device
    total = sum(grp.s1)
    bi = torch.repeat_interleave(torch.arange(grp.Bg, device=dev), grp.s1_t, output_size=total)   # [rows]
    first = torch.cumsum(grp.s1_t, 0) - grp.s1_t
    i = torch.arange(total, device=dev) - first[bi]                                 # row within the batch
    base = torch.tensor([p.geometry[b].q_offset + p.geometry[b].q_lo for b in grp.bidx], dtype=torch.long,
                        device=dev)
    dest = base[bi] + i
    src = bi * grp.S1 + i
    o = o.permute(1, 0, 2, 3).reshape(p.N, grp.Bg * grp.S1, p.Dv)                  # [N, Bg*S1, Dv]
    out.index_copy_(1, dest, o.index_select(1, src))
    lse.index_copy_(1, dest, l.permute(1, 0, 2).reshape(p.N, -1).index_select(1, src))
