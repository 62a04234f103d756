"""Gathering a group's tensors: query rows, key / value chunks (any storage, dequantized), mask and pse tiles.

Positions past a batch's window are clamped to its last valid one (never read out of range); the caller masks
them. Slices (no copy) where the group's offsets are uniform, index gathers otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...problem.attention import AttentionProblem
from ...problem.quant import KVDequant, dequant_fp4, unpack_int4
from .plan import Group


def _ar(lo: int, hi: int, dev) -> torch.Tensor:
    return torch.arange(lo, hi, device=dev)


def _has_rope(p: AttentionProblem) -> bool:
    return (p.kv.key_ropes if p.kv.kind == "list" else p.kv.key_rope) is not None


def query(p: AttentionProblem, grp: Group, dtype) -> torch.Tensor:
    """[Bg, N, S1, D (+ Dr)] the group's valid query rows (row i of batch b: physical q_lo + i) in dtype,
    dequantized per token (query_quant_mode 3), [q | q_rope] with MLA rope (SPEC 9, 11)."""
    S1, dev = grp.S1, grp.device
    loc = grp.q_lo_t[:, None] + _ar(0, S1, dev)                                   # [Bg, S1] row within batch

    def rows(t):
        if t is None:
            return None
        if p.packed:                                                              # [N, T, D]
            off = torch.tensor([p.geometry[b].q_offset for b in grp.bidx], dtype=torch.long, device=dev)
            idx = (off[:, None] + loc).clamp_(max=t.shape[1] - 1)
            return t[:, idx].permute(1, 0, 2, 3)                                  # [Bg, N, S1, D]
        if grp.uniform_q and grp.bslice is not None:
            lo = grp.q_lo[0]
            return t[grp.bslice, :, lo:lo + S1]
        idx = loc.clamp(max=t.shape[2] - 1)
        return t[grp.b_t[:, None], :, idx].permute(0, 2, 1, 3)                    # [Bg, S1, N, D] -> [Bg, N, S1, D]

    q = rows(p.query).to(dtype)
    if p.query_dequant is not None:
        sc = p.query_dequant.scale                                                # [B, N, Q_S]
        s = sc[grp.b_t[:, None], :, loc.clamp(max=sc.shape[2] - 1)]               # [Bg, S1, N]
        q = q * s.permute(0, 2, 1)[..., None].to(dtype)
    qr = rows(p.query_rope)
    return q if qr is None else torch.cat([q, qr.to(dtype)], dim=-1)


class KVReader:
    """Key / value chunks of a group in effective coordinates (prefix keys first, then own keys)."""

    def __init__(self, p: AttentionProblem, grp: Group, dtype):
        self.p, self.grp, self.dtype = p, grp, dtype
        kv = p.kv
        self.bs = kv.block_size if kv.kind == "paged" else 0
        if self.bs:                                                               # [Bg, MB] the group's table rows
            self.table = kv.block_table.to(device=grp.device, dtype=torch.long).index_select(0, grp.b_t)
        if kv.kind == "packed":
            self.off_t = torch.tensor([p.geometry[b].kv_offset for b in grp.bidx], dtype=torch.long,
                                      device=grp.device)

    # ------------------------------------------------------------------ own keys (positions of the batch)
    def _positions(self, t0: int, t1: int) -> torch.Tensor:
        """[Bg, n] physical positions kv_lo + t, clamped to each batch's last valid one."""
        g = self.grp
        return torch.minimum(g.kv_lo_t[:, None] + _ar(t0, t1, g.device), g.kv_last_t[:, None]).clamp_(min=0)

    def _own(self, which: str, t0: int, t1: int, pos: Optional[torch.Tensor]) -> torch.Tensor:
        """[Bg, KV_N, t1 - t0, X] raw own rows t0..t1 (window-relative) of key / value / key_rope."""
        kv, g = self.p.kv, self.grp
        if kv.kind == "list":                                                     # one batch per group
            t = {"key": kv.keys, "value": kv.values, "key_rope": kv.key_ropes}[which][g.bidx[0]]
            lo = g.kv_lo[0]
            return t[:, lo + t0:lo + t1][None]
        t = getattr(kv, which)
        if t.dtype == torch.float4_e2m1fn_x2:                                     # FP4: its bytes (torch cannot
            t = t.view(torch.uint8)                                               # index FP4 tensors)
        if kv.kind == "dense":                                                    # [B, KV_N, KV_S, X]
            if g.uniform_kv and g.bslice is not None:
                lo = g.kv_lo[0]
                return t[g.bslice, :, lo + t0:lo + t1]
            return t[g.b_t[:, None], :, pos].permute(0, 2, 1, 3)
        if kv.kind == "packed":                                                   # [KV_N, T_kv, X]
            if g.Bg == 1:
                o = self.p.geometry[g.bidx[0]].kv_offset + g.kv_lo[0]
                return t[:, o + t0:o + t1][None]
            return t[:, self.off_t[:, None] + pos].permute(1, 0, 2, 3)
        # paged [NB, KV_N, bs, X] (never left-padded: kv_lo = 0): whole blocks by index_select, then the slots
        bs = self.bs
        k0, k1 = t0 // bs, -(-t1 // bs)
        cols = torch.minimum(_ar(k0, k1, g.device)[None, :], (g.kv_last_t.clamp(min=0) // bs)[:, None])  # [Bg, nb]
        ids = self.table.gather(1, cols).reshape(-1)
        if t.dim() == 5:      # NZ view [.., bs, X/X0, X0] (SPEC 8b): whole blocks of the stored tensor, then rows
            blocks = t.permute(0, 1, 3, 2, 4).index_select(0, ids).permute(0, 1, 3, 2, 4).flatten(3)
        else:
            blocks = t.index_select(0, ids)                                       # [Bg * nb, KV_N, bs, X]
        kvn, x = t.shape[1], blocks.shape[3]
        flat = blocks.view(g.Bg, k1 - k0, kvn, bs, x).transpose(1, 2).reshape(g.Bg, kvn, (k1 - k0) * bs, x)
        return flat[:, :, t0 - k0 * bs:t1 - k0 * bs]

    def _factors(self, spec: KVDequant, pos: Optional[torch.Tensor]):
        """(scale, offset) broadcastable to [Bg, KV_N, n, D] for own positions pos [Bg, n] (SPEC 10)."""
        g = self.grp

        def pick(t):
            if t is None:
                return None
            k = spec.granularity
            if k == "tensor":
                return t.view(1, 1, 1, 1)
            if k == "channel":
                return t[None, :, None, :]                                        # [1, KV_N, 1, D]
            if k == "head":
                return t[None, :, None, None]                                     # [1, KV_N, 1, 1]
            if k in ("token", "token_head"):
                bi = g.b_t if t.shape[0] > 1 else torch.zeros_like(g.b_t)
                if k == "token":
                    return t[bi[:, None], pos][:, None, :, None]                  # [Bg, 1, n, 1]
                return t[bi[:, None], :, pos].permute(0, 2, 1)[..., None]         # [Bg, KV_N, n, 1]
            if k == "token_group":                          # [B, KV_N, S, D/32] E8M0 (logical positions when paged)
                return t[g.b_t[:, None], :, pos].permute(0, 2, 1, 3)               # [Bg, KV_N, n, D/32]
            blk = self.table.gather(1, pos // self.bs)                            # [Bg, n]
            slot = pos % self.bs
            if k == "block_token":
                return t[blk, slot][:, None, :, None]
            if k == "block_token_head":
                return t[blk, :, slot].permute(0, 2, 1)[..., None]
            raise AssertionError(k)
        return pick(spec.scale), pick(spec.offset)

    def _dequant(self, spec: KVDequant, x: torch.Tensor, pos) -> torch.Tensor:
        """x = (x_q + offset) * scale in the compute dtype; int4 unpacked first (SPEC 10)."""
        if self.p.antiquant.int4:
            x = unpack_int4(x)
        s, o = self._factors(spec, pos)
        if spec.granularity == "token_group":                   # FP4 codes x per-group E8M0 scales (SPEC 10b.1)
            return dequant_fp4(x, s, self.dtype)
        x = x.to(self.dtype)
        if o is not None:
            x = x + o.to(self.dtype)
        return x * s.to(self.dtype)

    def _prefix(self, which: str, j0: int, j1: int) -> torch.Tensor:
        """[1, KV_N, j1 - j0, X] shared-prefix rows (SPEC 7), dequantized like the cache (no per-token kinds)."""
        pre = self.p.prefix
        x = (pre.key if which == "key" else pre.value)[None, :, j0:j1]
        aq = self.p.antiquant
        if aq is not None:
            return self._dequant(aq.key if which == "key" else aq.value, x, None)
        return x.to(self.dtype)

    def _need_pos(self) -> bool:
        g, p, kind = self.grp, self.p, self.p.kv.kind
        aq = p.antiquant
        return (kind == "dense" and not (g.uniform_kv and g.bslice is not None)) or \
            (kind == "packed" and g.Bg > 1) or (aq is not None and (aq.key.per_token or aq.value.per_token))

    def read(self, which: str, c0: int, c1: int) -> torch.Tensor:
        """Effective keys [c0, c1) of the group in the compute dtype: which="key" -> [Bg, KV_N, n, D (+ Dr)];
        "value" -> [Bg, KV_N, n, Dv] with the rows past each batch's window zeroed (they get weight 0, and
        0 x NaN would not be 0)."""
        P, p, g = self.grp.prefix, self.p, self.grp
        parts = []
        if c0 < P:
            parts.append(self._prefix(which, c0, min(c1, P)).expand(g.Bg, -1, -1, -1))
        if c1 > P:
            t0, t1 = max(c0 - P, 0), c1 - P
            pos = self._positions(t0, t1) if self._need_pos() else None
            x = self._own(which, t0, t1, pos)
            if p.antiquant is not None:
                x = self._dequant(p.antiquant.key if which == "key" else p.antiquant.value, x, pos)
            else:
                x = x.to(self.dtype)
            if which == "key" and _has_rope(p):
                x = torch.cat([x, self._own("key_rope", t0, t1, pos).to(self.dtype)], dim=-1)
            parts.append(x)
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        if which == "value" and c1 > g.s2_min:
            x = x.masked_fill((_ar(c0, c1, g.device)[None, :] >= g.s2_t[:, None])[:, None, :, None], 0)
        return x


def _window(t: torch.Tensor, grp: Group, r0: int, r1: int, c0: int, c1: int, lead: int) -> torch.Tensor:
    """t [Bt, *lead dims, Qt, Kt] in physical coordinates -> [Bg or 1, *lead, r1 - r0, c1 - c0]: row q_lo + i,
    column kv_lo + j of each batch (both clamped into t)."""
    dev = grp.device
    if t.shape[0] == 1:
        bt = t
    elif grp.bslice is not None:
        bt = t[grp.bslice]
    else:
        bt = t.index_select(0, grp.b_t)
    qt, kt = t.shape[-2], t.shape[-1]
    if grp.uniform_q and grp.uniform_kv:
        ql, kl = grp.q_lo[0], grp.kv_lo[0]
        if ql + r1 <= qt:
            bt = bt[..., ql + r0:ql + r1, :]
        else:
            bt = bt.index_select(-2, _ar(ql + r0, ql + r1, dev).clamp_(max=qt - 1))
        if kl + c1 <= kt:
            return bt[..., kl + c0:kl + c1]
        return bt.index_select(-1, _ar(kl + c0, kl + c1, dev).clamp_(max=kt - 1))
    rows = (grp.q_lo_t[:, None] + _ar(r0, r1, dev)).clamp_(max=qt - 1)          # [Bg, R]
    cols = (grp.kv_lo_t[:, None] + _ar(c0, c1, dev)).clamp_(max=kt - 1)         # [Bg, C]
    bi = _ar(0, bt.shape[0], dev)[:, None, None] if bt.shape[0] > 1 else torch.zeros(1, 1, 1, dtype=torch.long,
                                                                                      device=dev)
    if lead:                                                                      # [Bg, R, C, N] -> [Bg, N, R, C]
        return bt[bi, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    return bt[bi, rows[:, :, None], cols[:, None, :]]


def user_mask(p: AttentionProblem, grp: Group, r0: int, r1: int, c0: int, c1: int) -> Optional[torch.Tensor]:
    """[Bg or 1, 1, R, C] bool, True = masked by the user mask (physical coordinates), or None."""
    um = p.mask.user_mask
    if um is None:
        return None
    return (_window(um, grp, r0, r1, c0, c1, 0) != 0)[:, None]


def pse(p: AttentionProblem, grp: Group, r0: int, r1: int, c0: int, c1: int, dtype) -> Optional[torch.Tensor]:
    """[Bg or 1, N, R, C] position bias in dtype, indexed like the mask, or None."""
    if p.pse is None:
        return None
    return _window(p.pse, grp, r0, r1, c0, c1, 1).to(dtype)


def band_mask(grp: Group, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """[Bg or 1, 1, R, C] bool, True where the band excludes key j from row i (window-local)."""
    dev = grp.device
    i = _ar(r0, r1, dev)[:, None]                                                 # [R, 1]
    j = _ar(c0, c1, dev)[None, :]                                                 # [1, C]
    if grp.uniform_band:
        pre, nxt = grp.bands[0]
        return ((j > i + nxt) | (j < i - pre))[None, None]
    pre, nxt = grp.pre_t[:, None, None], grp.next_t[:, None, None]               # [Bg, 1, 1]
    return ((j > i + nxt) | (j < i - pre))[:, None]
