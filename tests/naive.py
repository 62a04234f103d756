"""An independent, deliberately naive float64 formulation of SPEC.md sections 3-6.

Nothing here imports fia. Every batch is handled on its own, with an explicit query window [q_lo, q_hi)
and key window [kv_lo, kv_hi) in physical coordinates (right padding: (0, act)). The result is:

* rows outside the query window, and rows the band geometry leaves with no key: out 0, lse +inf;
* rows whose band keys are all masked by the *user* mask (sparse modes 0/1): without row-invalid
  correction (inner_precise bit 1 clear) the -1e12 fill makes the softmax uniform over all the batch's valid
  keys: out = mean of V over [kv_lo, kv_hi), lse = -1e12 + log(count); with bit 1 set: out 0, lse +inf;
* every other row: ordinary softmax attention over the valid keys that are not masked.

Optional learnable sink (SPEC 1.1b, one float per query head): one extra score column per row that no mask
hides and that carries no value. Rows with no key at all (geometry, lengths) stay 0 / +inf; a row whose
keys are all user-masked puts all its weight on the sink (out 0, lse = sink, whatever inner_precise says).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

INT_MAX = 2147483647
CLAMP = 214748647          # SPEC 5: pre/next above this are clamped to it
FILL = -1e12               # SPEC 3/6: the finite fill of masked scores


def band_masked(s1: int, s2: int, sparse_mode: int, pre: int, nxt: int, has_mask: bool) -> torch.Tensor:
    """[s1, s2] bool, True = excluded by the band geometry (window-local row i, column j). SPEC 5 table."""
    pre, nxt = min(pre, CLAMP), min(nxt, CLAMP)
    i = torch.arange(s1).unsqueeze(1)
    j = torch.arange(s2).unsqueeze(0)

    def outside(p, n):
        return (j > i + n) | (j < i - p)

    if sparse_mode == 0:
        if not has_mask:
            return torch.zeros(s1, s2, dtype=torch.bool)
        return outside(pre, nxt)
    if sparse_mode == 1:
        return torch.zeros(s1, s2, dtype=torch.bool)
    if sparse_mode == 2:
        return j > i
    if sparse_mode == 3:
        return j > i + s2 - s1
    if sparse_mode == 4:
        return outside(pre - s2 + s1, nxt + s2 - s1)
    raise ValueError(f"naive: sparse_mode {sparse_mode}")


def one_batch(q, k, v, *, scale, q_win, kv_win, mask, sparse_mode, pre, nxt, pse, inner_precise, sink=None):
    """q [N, Sq, D], k [KV_N, Skv, D], v [KV_N, Skv, Dv] (float64, physical coordinates);
    mask: None or bool [>=Sq, >=Skv] (physical, True = masked, only used in modes 0/1);
    pse: None or float64 [N, >=Sq, >=Skv] (physical); sink: None or float64 [N].
    Returns out [N, Sq, Dv], lse [N, Sq]."""
    n_q, s_q, _ = q.shape
    kv_n, _, dv = v.shape
    g = n_q // kv_n
    out = torch.zeros(n_q, s_q, dv, dtype=torch.float64)
    lse = torch.full((n_q, s_q), math.inf, dtype=torch.float64)
    q_lo, q_hi = q_win
    kv_lo, kv_hi = kv_win
    s1, s2 = q_hi - q_lo, kv_hi - kv_lo
    if s1 <= 0 or s2 <= 0:
        return out, lse
    geo = band_masked(s1, s2, sparse_mode, pre, nxt, mask is not None)          # [s1, s2]
    user = torch.zeros(s1, s2, dtype=torch.bool)
    if mask is not None and sparse_mode in (0, 1):
        user = mask[q_lo:q_hi, kv_lo:kv_hi].bool()
    masked = geo | user
    geo_empty = geo.all(dim=1)                                  # [s1] band leaves no key
    user_empty = masked.all(dim=1) & ~geo_empty                 # [s1] band keys all user-masked
    for n in range(n_q):
        h = n // g                                              # GQA: contiguous groups
        qs = q[n, q_lo:q_hi]                                    # [s1, D]
        ks = k[h, kv_lo:kv_hi]                                  # [s2, D]
        vs = v[h, kv_lo:kv_hi]                                  # [s2, Dv]
        s = scale * (qs @ ks.T)                                 # scale first ...
        if pse is not None:
            s = s + pse[n, q_lo:q_hi, kv_lo:kv_hi]              # ... then the additive bias
        s = s.masked_fill(masked, FILL)
        m = s.max(dim=1, keepdim=True).values
        if sink is not None:                                    # the sink column takes part in max and sum
            m = torch.clamp(m, min=float(sink[n]))
        e = torch.exp(s - m)
        den = e.sum(dim=1, keepdim=True)
        if sink is not None:
            den = den + torch.exp(float(sink[n]) - m)
        p = e / den
        o = p @ vs
        l = (m + torch.log(den)).squeeze(1)
        # a sink absorbs fully user-masked rows (out ~ 0, lse ~ sink): only geometry-empty rows are dead then
        row_fix = bool(inner_precise & 2) and sink is None
        dead = geo_empty | (user_empty if row_fix else torch.zeros_like(geo_empty))
        o[dead] = 0.0
        l[dead] = math.inf
        out[n, q_lo:q_hi] = o
        lse[n, q_lo:q_hi] = l
    return out, lse


def attention(q, k, v, *, scale: float = 1.0, q_windows: Optional[Sequence] = None,
              kv_windows: Optional[Sequence] = None, mask=None, sparse_mode: int = 0, pre_tokens: int = INT_MAX,
              next_tokens: int = INT_MAX, pse=None, inner_precise: int = 0, stack: bool = True, sink=None):
    """Batched driver. q: [B, N, Sq, D] or a list of B [N, Sq_b, D]; k, v likewise with KV_N heads.
    q_windows / kv_windows: per-batch (lo, hi), default the full length. mask: None, a bool tensor
    [B, Sq, Skv] or a list of per-batch [Sq_b, Skv_b] (physical). pse: None, [B, N, Sq, Skv] or a list.
    Returns (out, lse): stacked [B, N, Sq, Dv] / [B, N, Sq] when `stack` and every batch has the same Sq,
    else lists of per-batch [N, Sq_b, Dv] / [N, Sq_b]."""
    b = len(q)
    outs, lses = [], []
    for i in range(b):
        qi = q[i].double()
        ki, vi = k[i].double(), v[i].double()
        qw = tuple(q_windows[i]) if q_windows is not None else (0, qi.shape[1])
        kw = tuple(kv_windows[i]) if kv_windows is not None else (0, ki.shape[1])
        mi = None if mask is None else mask[i]
        pi = None if pse is None else pse[i].double()
        o, l = one_batch(qi, ki, vi, scale=scale, q_win=qw, kv_win=kw, mask=mi, sparse_mode=sparse_mode,
                         pre=pre_tokens, nxt=next_tokens, pse=pi, inner_precise=inner_precise,
                         sink=None if sink is None else sink.double())
        outs.append(o)
        lses.append(l)
    if stack and b and all(o.shape == outs[0].shape for o in outs):
        return torch.stack(outs), torch.stack(lses)
    return outs, lses
