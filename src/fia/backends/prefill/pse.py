"""pse_shift without a mask: skip key tiles whose contribution is provably below float32 resolution.

For row i of head n, key j (kv head h = n // G): S_ij = scale · q_i·k_j + pse_ij. Bounds, all exact:
* upper, per key tile t:  S_ij <= |scale| · ||q_i|| · max_{j in t} ||k_j|| + max_{j in t} pse_ij  (Cauchy-Schwarz)
* lower, per row:         m_i = max_j S_ij >= S_ij*  for j* = the row's largest pse entry (computed exactly).
If UB(i, t) < S_ij* - THRESH, every term of tile t in the softmax denominator is below
exp(-THRESH) · exp(m_i - m_i) = exp(-THRESH) relative to the row's largest term, so dropping the tile changes
the row's output and lse by at most S2 · exp(-THRESH) relative (THRESH = 50: < 1e-16 for S2 <= 2^20), far below
float32 rounding. Tile j* itself is never dropped (its bound exceeds S_ij*), so the kernel's row maximum is
at least S_ij*. ALiBi-like biases (large negative far from the diagonal) lose most tiles of the steep heads.

Heads of one kv head (GQA group) share one kernel call, so a tile is dropped for the group only when it is
negligible for every row of every head of the group; a group keeps the contiguous tile range between its
first and last needed tile. Reading pse for the bounds is one pass over the rows' bias (2 bytes per score,
against ~4·D flops per score of the attention itself).
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

THRESH = 50.0


def key_tile_norms(k, tile: int):
    """max ||k_j|| per key tile: [KV_N, nt] float32 (once per batch)."""
    kv_n, s2, _ = k.shape
    nt = -(-s2 // tile)
    kn = k.to(torch.float32).norm(dim=-1)                                 # [KV_N, S2]
    if nt * tile > s2:
        kn = torch.nn.functional.pad(kn, (0, nt * tile - s2))
    return kn.view(kv_n, nt, tile).amax(dim=-1)


def bias_stats(pse, tile: int):
    """Per-row tile maxima pm [N, r, nt] (float32), first row argmax jstar [N, r] and its value pstar [N, r]
    (float32) of pse [N, r, S2]. One Numba pass on CPU (pse_kernels.py), torch ops elsewhere."""
    if pse.device.type == "cpu" and pse.dtype in _KINDS and pse.stride(-1) == 1 and pse.numel() and _numba():
        return _bias_stats_numba(pse, tile)
    return _bias_stats_torch(pse, tile)


def _bias_stats_torch(pse, tile: int):
    n, r, s2 = pse.shape
    nt = -(-s2 // tile)
    full = s2 // tile
    parts = []
    if full:
        parts.append(pse[:, :, :full * tile].unflatten(-1, (full, tile)).amax(dim=-1))
    if full < nt:
        parts.append(pse[:, :, full * tile:].amax(dim=-1, keepdim=True))
    pm = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(torch.float32)   # [N, r, nt]
    # j*: the largest bias entry of the row (inside its best tile)
    tbest = pm.argmax(dim=-1)                                             # [N, r]
    cols = (tbest * tile).unsqueeze(-1) + torch.arange(tile, device=pse.device)   # [N, r, tile]
    cols = cols.clamp_(max=s2 - 1)
    within = torch.gather(pse, 2, cols).argmax(dim=-1, keepdim=True)      # [N, r, 1]
    jstar = torch.gather(cols, 2, within).squeeze(-1)                     # [N, r]
    pstar = torch.gather(pse, 2, jstar.unsqueeze(-1)).squeeze(-1).to(torch.float32)
    return pm, jstar, pstar


# bits of +inf of the half-precision dtypes the Numba pass reads (as int16 bit patterns)
_KINDS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _numba() -> bool:
    try:
        from . import pse_kernels as prefill_pse_kernels  # noqa: F401
        return True
    except ImportError:  # pragma: no cover - numba missing: torch path
        return False


def _bias_stats_numba(pse, tile: int):
    from . import pse_kernels as K
    from ...cpu.threads import pool
    n, r, s2 = pse.shape
    nt = -(-s2 // tile)
    inf_bits, mag = _KINDS[pse.dtype], 0x7FFF
    bits = pse.view(torch.int16)                                      # [N, r, S2] bit patterns (a view, no copy)
    sn, sr, _ = bits.stride()
    span = (n - 1) * sn + (r - 1) * sr + s2
    a = bits.as_strided((span,), (1,)).numpy()                 # the storage span, 1-D contiguous
    pmk = np.empty((n, r, nt), a.dtype)
    pbk = np.empty((n, r), a.dtype)
    jstar = np.empty((n, r), np.int64)
    nan = np.empty((n, r), np.uint8)
    rows = n * r
    threads = max(1, min(torch.get_num_threads(), rows * s2 // (1 << 20)))   # >= 1M scores per thread
    cuts = [rows * i // threads for i in range(threads + 1)]
    args, outs = (a, sn, sr, r, s2, inf_bits, tile), (pmk, pbk, jstar, nan)
    futs = [pool(threads - 1).submit(K.row_stats, *args, cuts[i], cuts[i + 1], *outs)
            for i in range(1, threads)]
    K.row_stats(*args, cuts[0], cuts[1], *outs)
    for f in futs:
        f.result()

    def value(keys):                                           # key -> float32 (the key is an involution)
        k = torch.from_numpy(keys)
        sh = k.element_size() * 8 - 1
        return (k ^ ((k >> sh) & mag)).view(pse.dtype).to(torch.float32)

    pstar = value(pbk)
    pstar[torch.from_numpy(nan).bool()] = float("nan")
    return value(pmk), torch.from_numpy(jstar), pstar


def needed_ranges(q, k, pse, scale: float, G: int, tile: int, kmax=None) -> List[Tuple[int, int]]:
    """Key range [c0, c1) each kv head group needs for these rows.

    q [N, r, E] (kd), k [KV_N, S2, E] (kd), pse [N, r, S2] (view), kmax = key_tile_norms(k, tile).
    Returns KV_N ranges (c0 < c1)."""
    n, r, _ = q.shape
    kv_n, s2, _ = k.shape
    nt = -(-s2 // tile)
    pm, jstar, pstar = bias_stats(pse, tile)                             # [N, r, nt], [N, r], [N, r]
    head_kv = (torch.arange(n, device=q.device) // G).unsqueeze(-1)       # [N, 1]
    kstar = k[head_kv, jstar].to(torch.float32)                           # [N, r, E]
    qf = q.to(torch.float32)
    lb = scale * (qf * kstar).sum(-1) + pstar                             # [N, r]  lower bound of m_i
    qn = qf.norm(dim=-1)                                                  # [N, r]
    if kmax is None:
        kmax = key_tile_norms(k, tile)                                    # [KV_N, nt]
    ub = abs(scale) * qn.unsqueeze(-1) * kmax.repeat_interleave(G, dim=0).unsqueeze(1) + pm   # [N, r, nt]
    drop = ub < (lb - THRESH).unsqueeze(-1)                                # NaN anywhere -> kept
    need = (~drop).view(kv_n, G * r, nt).any(dim=1)                       # [KV_N, nt]
    idx = torch.arange(nt, device=q.device)
    first = torch.where(need, idx, nt).amin(dim=-1)
    last = torch.where(need, idx, -1).amax(dim=-1)
    out = []
    for f, l in zip(first.tolist(), last.tolist()):
        if l < f:                       # cannot happen (j*'s tile is always needed); keep everything
            f, l = 0, nt - 1
        out.append((f * tile, min(s2, (l + 1) * tile)))
    return out
