"""The reference backend: the oracle for every other backend. Reads like SPEC 3-6.

Plain, per batch, upcast to float32 (float64 for float64 input), masks materialized for one batch at
a time: it never holds more than one batch's [N, S1, S2] scores.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..problem.attention import MASK_FILL, AttentionProblem, BatchGeometry
from ..problem.quant import FullQuant, round_half_even_saturate_int8, unpack_int4
from .base import PRIORITY_REFERENCE, Backend, BackendResult, non_finite


def band_outside(p: AttentionProblem, g: BatchGeometry, device) -> Optional[torch.Tensor]:
    """[S1, S2] bool, True where the band geometry excludes key j from row i (window-local), or None."""
    band = p.mask.band_for(g.s1, g.s2)
    if band is None:
        return None
    pre, nxt = band
    i = torch.arange(g.s1, device=device).unsqueeze(1)   # [S1, 1]
    j = torch.arange(g.s2, device=device).unsqueeze(0)   # [1, S2]
    return (j > i + nxt) | (j < i - pre)


def user_masked(p: AttentionProblem, b: int, g: BatchGeometry) -> Optional[torch.Tensor]:
    """[S1, S2] bool from the user mask in physical coordinates (row q_lo + i, column kv_lo + j), or None."""
    um = p.mask.user_mask
    if um is None:
        return None
    bm = b if um.shape[0] > 1 else 0
    return um[bm, g.q_lo:g.q_hi, g.kv_lo:g.kv_lo + g.s2] != 0


def pse_block(p: AttentionProblem, b: int, g: BatchGeometry, dtype) -> Optional[torch.Tensor]:
    """[N, S1, S2] position bias, indexed exactly like the mask."""
    if p.pse is None:
        return None
    bp = b if p.pse.shape[0] > 1 else 0
    return p.pse[bp, :, g.q_lo:g.q_hi, g.kv_lo:g.kv_lo + g.s2].to(dtype)


def batch_query(p: AttentionProblem, b: int, g: BatchGeometry, dtype) -> torch.Tensor:
    """The batch's valid query rows [N, S1, D (+ Dr)]: with MLA rope, [q | q_rope] (SPEC 9).

    An int8 query with query_quant_mode 3 is dequantized per token and head: Q = Q_q * scale (SPEC 11).
    """
    q, qr = p.query_rows(b, g.q_lo, g.q_hi)
    q = q.to(dtype)
    if p.query_dequant is not None:
        # scale (B, Q_N, Q_S): indexed by the batch's own row (packed layouts: row within the batch)
        q = q * p.query_dequant.scale[b, :, g.q_lo:g.q_hi, None].to(dtype)
    return q if qr is None else torch.cat([q, qr.to(dtype)], dim=-1)


def _dequant(p: AttentionProblem, which: str, x: torch.Tensor, b: int, lo: int, hi: int, dtype) -> torch.Tensor:
    """SPEC 10: x = (x_q + offset) * scale for own keys [lo, hi) of batch b; int4 is unpacked first."""
    aq = p.antiquant
    if aq.int4:
        x = unpack_int4(x)
    spec = aq.key if which == "key" else aq.value
    table = getattr(p.kv, "table_host", None)
    return spec.apply(x, dtype, b, lo, hi, table, getattr(p.kv, "block_size", 0))


def batch_keys(p: AttentionProblem, b: int, g: BatchGeometry, dtype):
    """The batch's effective keys/values: [KV_N, S2, D (+ Dr)], [KV_N, S2, Dv] in the compute dtype.

    Effective keys = shared prefix (SPEC 7) then the batch's own valid keys; with MLA rope the key is
    [k | k_rope], so one product gives Q·Kᵀ + Q_rope·K_ropeᵀ.
    """
    k, v, kr = p.kv.rows(b, g, g.kv_lo, g.kv_hi)
    pk = pv = None
    if p.prefix is not None:
        pk, pv = p.prefix.key, p.prefix.value
    if p.antiquant is not None:     # dequantize only this batch's keys, never the cache
        k = _dequant(p, "key", k, b, g.kv_lo, g.kv_hi, dtype)
        v = _dequant(p, "value", v, b, g.kv_lo, g.kv_hi, dtype)
        if pk is not None:          # per-tensor / per-channel / per-head only (parse rejects per-token)
            pk = _dequant(p, "key", pk, b, 0, pk.shape[1], dtype)
            pv = _dequant(p, "value", pv, b, 0, pv.shape[1], dtype)
    k, v = k.to(dtype), v.to(dtype)
    if kr is not None:
        k = torch.cat([k, kr.to(dtype)], dim=-1)
    if pk is not None:
        k = torch.cat([pk.to(dtype), k], dim=1)
        v = torch.cat([pv.to(dtype), v], dim=1)
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: Optional[torch.Tensor],
           masked: Optional[torch.Tensor], sink: Optional[torch.Tensor] = None):
    """One batch of SPEC 3. q [N, S1, D], k [KV_N, S2, D], v [KV_N, S2, Dv] -> out [N, S1, Dv], lse [N, S1].

    sink [N]: one extra score column per row that no mask hides and that carries no value (SPEC 1.1b).
    Computed in the inputs' dtype (float32); where that gives a NaN or an infinity, the batch again in float64
    (DECISIONS 52): finite inputs then give the finite answer a float32 intermediate overflowed, and NaN / Inf
    inputs propagate as in float32.
    """
    out, lse = _attend(q, k, v, scale, bias, masked, sink)
    if q.dtype == torch.float32 and not (bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())):
        w = torch.float64
        out, lse = _attend(q.to(w), k.to(w), v.to(w), scale, None if bias is None else bias.to(w), masked,
                           None if sink is None else sink.to(w))
        out, lse = out.to(torch.float32), lse.to(torch.float32)
    return out, lse


def _attend(q, k, v, scale: float, bias, masked, sink):
    """attend in the inputs' dtype."""
    n, s1, d = q.shape
    kv_n, s2, dv = v.shape
    g = n // kv_n
    qg = q.reshape(kv_n, g * s1, d)                                   # [KV_N, G*S1, D]  (heads n = h*G + i)
    s = torch.bmm(qg, k.transpose(1, 2)).reshape(n, s1, s2) * scale   # [N, S1, S2]
    if bias is not None:
        s = s + bias
    if masked is not None:
        s = s.masked_fill(masked, MASK_FILL)
    m = s.amax(dim=-1, keepdim=True)                                  # [N, S1, 1]
    if sink is not None:
        sk = sink.to(s.dtype)[:, None, None]                          # [N, 1, 1]
        m = torch.maximum(m, sk)
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        den = den + torch.exp(sk - m)
    pr = (e / den).reshape(kv_n, g * s1, s2)                          # [KV_N, G*S1, S2]
    out = torch.bmm(pr, v).reshape(n, s1, dv)                         # [N, S1, Dv]
    lse = (m + torch.log(den)).squeeze(-1)                            # [N, S1]
    return out, lse


def attend_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: FullQuant, scale: float,
                bias: Optional[torch.Tensor], masked: Optional[torch.Tensor]):
    """Full int8 quantization (SPEC 11). q [N, S1, D], k [KV_N, S2, D], v [KV_N, S2, Dv] hold int8 values.

    S = (int32(Q Kᵀ) * dequant_scale1) * scale; E = exp(S - rowmax(S)), the flash kernel's unnormalized
    exponentials; P8 = sat_int8(round_half_even(E * quant_scale1)); O = int32(P8 V) * dequant_scale2 / rowsum(E).
    Masked keys take the finite fill (E = 0 unless the whole row is masked: then E = 1 on every key, SPEC 6);
    rowmax and rowsum run over the batch's own keys only; lse is that of the float scores, rowmax + log(rowsum)
    (DECISIONS 43). Integer products are exact in float64.
    """
    n, s1, d = q.shape
    kv_n, s2, dv = v.shape
    g = n // kv_n
    qi = q.to(torch.float64).reshape(kv_n, g * s1, d)
    acc = torch.bmm(qi, k.to(torch.float64).transpose(1, 2)).reshape(n, s1, s2)      # int32(Q·Kᵀ), exact
    s = (acc.to(torch.float32) * fq.dequant_scale1) * scale                          # float32 from here
    if bias is not None:
        s = s + bias
    if masked is not None:
        s = s.masked_fill(masked, MASK_FILL)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)                                                # rowsum(E) >= 1
    p8 = round_half_even_saturate_int8(e * fq.quant_scale1)                          # [N, S1, S2] int8
    o = torch.bmm(p8.to(torch.float64).reshape(kv_n, g * s1, s2), v.to(torch.float64))  # int32(P8·V), exact
    out = (o.reshape(n, s1, dv).to(torch.float32) * fq.dequant_scale2) / den        # the row sum divides last
    return out, (m + torch.log(den)).squeeze(-1)


def unless_non_finite(p: AttentionProblem, res: BackendResult) -> BackendResult:
    """res, or the reference's result where res holds a NaN or an infinity (base.non_finite): the backends'
    folded arithmetic overflows elsewhere than the reference's, so every backend answers such calls with the
    reference's numbers (DECISIONS 52)."""
    return ReferenceBackend().run(p) if non_finite(res) else res


class ReferenceBackend(Backend):
    name = "reference"
    priority = PRIORITY_REFERENCE

    def memory_need(self, p: AttentionProblem):
        """+ one batch's [N, S1, S2] scores, alive about three times over (scores, exponentials, probabilities)."""
        es = torch.finfo(p.compute_dtype).bits // 8
        s1, s2 = max(((g.s1, g.s2) for g in p.geometry), key=lambda x: x[0] * x[1], default=(0, 0))
        return super().memory_need(p) + [(f"the reference's [N, S1, S2] = [{p.N}, {s1}, {s2}] scores of one batch",
                                          3 * p.N * s1 * s2 * es)]

    def run(self, p: AttentionProblem) -> BackendResult:
        cd = p.compute_dtype
        dev = p.device
        out = torch.zeros(p.out_shape(), dtype=cd, device=dev)                  # rows never computed: 0
        lse = torch.full(p.lse_shape(), float("inf"), dtype=cd, device=dev)     # ... and lse +inf (SPEC 6)
        for b, g in enumerate(p.geometry):
            if g.s1 == 0 or g.s2 == 0:
                continue
            q = batch_query(p, b, g, cd)                       # [N, S1, D]
            k, v = batch_keys(p, b, g, cd)                     # [KV_N, S2, D], [KV_N, S2, Dv]
            bias = pse_block(p, b, g, cd)                      # [N, S1, S2] or None
            band = band_outside(p, g, dev)                     # [S1, S2] or None
            user = user_masked(p, b, g)                        # [S1, S2] or None
            masked = band if user is None else (user if band is None else band | user)
            if p.full_quant is not None:
                o, l = attend_int8(q, k, v, p.full_quant, p.scale, bias, masked)
            else:
                o, l = attend(q, k, v, p.scale, bias, masked, p.sink)
            dead = torch.zeros(g.s1, dtype=torch.bool, device=dev)
            if band is not None:
                dead |= band.all(dim=-1)       # the geometry leaves the row no key: 0 / +inf always
            if p.row_invalid_fix and masked is not None and p.sink is None:
                # row-invalid correction (inner_precise bit 1); with a sink such rows put all their
                # weight on the sink instead: output 0, lse = sink (SPEC 1.1b)
                dead |= masked.all(dim=-1)
            if bool(dead.any()):
                o[:, dead] = 0
                l[:, dead] = float("inf")
            if p.packed:
                o0 = g.q_offset + g.q_lo
                out[:, o0:o0 + g.s1] = o
                lse[:, o0:o0 + g.s1] = l
            else:
                out[b, :, g.q_lo:g.q_hi] = o
                lse[b, :, g.q_lo:g.q_hi] = l
        return BackendResult(out, lse if p.want_lse else None)
