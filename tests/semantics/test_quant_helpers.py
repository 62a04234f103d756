"""Shared builders and independent float64 formulations of the quantization tests (SPEC 10-12).

This module holds no tests (pytest collects it and finds none). Nothing here imports fia.

* KV dequantization (SPEC 10): `factor(...)` turns a scale/offset tensor of one documented granularity into a
  float64 array broadcastable to canonical [B, KV_N, S, D] (paged-block layouts are resolved through the
  block table); `dequant(xq, scale, offset)` = (x_q + offset) * scale in float64.
* Full int8 (SPEC 11): `int8_attention` is a naive float64 formulation (the flash kernel's unnormalized
  exponentials are quantized, the row sum divides last) that also returns, per output element, the largest
  change one P8 rounding-boundary flip can cause (the "ambiguity" tolerance).
* Output quantization (SPEC 12): `out_quant_bounds`.
"""
from __future__ import annotations

import math
import struct
from typing import Optional, Sequence

import torch

import naive

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ---------------------------------------------------------------------------------------------- builders
def rand_int(shape, g: torch.Generator, lo: int = -128, hi: int = 127, dtype=torch.int8) -> torch.Tensor:
    """Uniform integers in [lo, hi] (inclusive)."""
    return torch.randint(lo, hi + 1, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def rand_uniform(shape, g: torch.Generator, lo: float, hi: float, dtype=F32) -> torch.Tensor:
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], last dim D (multiple of 8) -> int32 [..., D/8]; element 8k+i sits in bits
    4i..4i+3 of word k (low nibble first, two's complement), SPEC 10.4. Written independently of fia."""
    x = x.to(torch.int64)
    assert x.shape[-1] % 8 == 0 and int(x.min()) >= -8 and int(x.max()) <= 7
    nib = (x & 0xF).reshape(*x.shape[:-1], x.shape[-1] // 8, 8)
    word = torch.zeros(nib.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= nib[..., i] << (4 * i)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)          # reinterpret as signed 32-bit
    return word.to(torch.int32)


def uint64_form(value: float, high: int = 0) -> torch.Tensor:
    """A (1,) int64 tensor whose low 32 bits are the float32 bit pattern of `value` (SPEC 11 "UINT64")."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return torch.tensor([(high << 32) | bits], dtype=torch.int64)


def f32(value: float) -> float:
    """value rounded to float32 (the scalar the implementation sees)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


# ---------------------------------------------------------------------------------------------- paged pool
def make_paged(xs: Sequence[torch.Tensor], act_kv: Sequence[int], bs: int, g: torch.Generator, *,
               four_d: bool, extra_blocks: int = 2, max_blocks: Optional[int] = None, fill=None):
    """Scatter logical canonical caches into one shuffled block pool (SPEC 8).

    xs: tensors [B, KV_N, S, D] (same B, KV_N, S); token p of batch b goes to block table[b, p // bs],
    offset p % bs. Returns (pools, block_table int32 [B, max_blocks]); pools are (NB, bs, KV_N*D) or, with
    four_d, (NB, KV_N, bs, D). Unused table entries are -1; unused pool slots hold `fill(shape, dtype)`
    (default: random values of the dtype, i.e. garbage)."""
    b, kvn, s, _ = xs[0].shape
    need = [(a + bs - 1) // bs for a in act_kv]
    mb = max_blocks if max_blocks is not None else max(max(need), 1)
    nb = sum(need) + extra_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((b, mb), -1, dtype=torch.int32)
    it = iter(perm)
    for i in range(b):
        for j in range(need[i]):
            table[i, j] = next(it)
    pools = []
    for x in xs:
        d = x.shape[3]
        if fill is not None:
            pool = fill((nb, kvn, bs, d), x.dtype)
        elif x.dtype.is_floating_point:
            pool = torch.randn(nb, kvn, bs, d, generator=g).to(x.dtype)
        else:
            pool = rand_int((nb, kvn, bs, d), g, -8 if x.dtype == torch.int32 else -128, 7 if x.dtype ==
                            torch.int32 else 127, x.dtype)
        for i in range(b):
            for p in range(act_kv[i]):
                pool[int(table[i, p // bs]), :, p % bs] = x[i, :, p]
        if not four_d:
            pool = pool.permute(0, 2, 1, 3).reshape(nb, bs, kvn * d).contiguous()
        pools.append(pool)
    return pools, table


def block_scales(logical: torch.Tensor, table: torch.Tensor, act_kv: Sequence[int], bs: int, nb: int,
                 per_head: bool) -> torch.Tensor:
    """Per-token scales stored by paged block (modes 4/5): logical [B, S] (or [B, KV_N, S] per head) ->
    (NB, bs) / (NB, KV_N, bs) float32; slots no used token maps to hold NaN (they must never be read)."""
    if per_head:
        out = torch.full((nb, logical.shape[1], bs), float("nan"), dtype=logical.dtype)
    else:
        out = torch.full((nb, bs), float("nan"), dtype=logical.dtype)
    for i in range(logical.shape[0]):
        for p in range(act_kv[i]):
            blk = int(table[i, p // bs])
            if per_head:
                out[blk, :, p % bs] = logical[i, :, p]
            else:
                out[blk, p % bs] = logical[i, p]
    return out


# ---------------------------------------------------------------------------------------------- SPEC 10
def factor(gran: str, t: Optional[torch.Tensor], *, b: int, kvn: int, s: int, d: int, table=None, bs: int = 0):
    """A dequantization parameter -> float64 broadcastable to canonical [B, KV_N, S, D] (logical positions).

    gran: "tensor" (any one-element shape), "channel" (data in (KV_N, D) order: (1, KV_N, 1, D), (1, KV_N, D),
    (1, H), (KV_N, D), (KV_N, 1, D), (H,)), "head" (KV_N,), "token" ((1, B|1, S') or (B|1, S')),
    "token_head" (B|1, KV_N, S'), "block_token" (NB, bs), "block_token_head" (NB, KV_N, bs)."""
    if t is None:
        return None
    t = t.double()
    if gran == "tensor":
        assert t.numel() == 1
        return t.reshape(())
    if gran == "channel":
        return t.reshape(kvn, d)[None, :, None, :]
    if gran == "head":
        return t.reshape(kvn)[None, :, None, None]
    if gran == "token":
        tt = t.reshape(-1, t.shape[-1])[:, :s]
        return tt.expand(b, s)[:, None, :, None]
    if gran == "token_head":
        return t[:, :, :s].expand(b, kvn, s)[:, :, :, None]
    if gran in ("block_token", "block_token_head"):
        out = torch.full((b, kvn, s), float("nan"), dtype=torch.float64)
        for i in range(b):
            for p in range(s):
                blk = int(table[i, p // bs]) if p // bs < table.shape[1] else -1
                if blk < 0:
                    continue
                out[i, :, p] = t[blk, p % bs] if gran == "block_token" else t[blk, :, p % bs]
        return out[:, :, :, None]
    raise ValueError(gran)


def dequant(xq: torch.Tensor, scale, offset=None) -> torch.Tensor:
    """SPEC 10: x = (x_q + offset) * scale, float64."""
    x = xq.double()
    if offset is not None:
        x = x + offset
    return x * scale


# ---------------------------------------------------------------------------------------------- SPEC 11
def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """float64 round-half-to-even, written out (floor + tie rule) rather than trusting torch.round."""
    f = torch.floor(x)
    r = x - f
    up = (r > 0.5) | ((r == 0.5) & (torch.remainder(f, 2) == 1))
    return f + up.double()


def sat_int8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-128, 127)


def int8_attention(q8, k8, v8, *, ds1: float, qs1: float, ds2: float, scale: float, q_windows=None,
                   kv_windows=None, mask=None, sparse_mode: int = 0, pre_tokens: int = naive.INT_MAX,
                   next_tokens: int = naive.INT_MAX, pse=None, inner_precise: int = 0, amb_eps: float = 2e-3):
    """Naive float64 SPEC 11 (corrected) for canonical int8 q8 [B, N, Sq, D], k8/v8 [B, KV_N, Skv, D].

    S = (Q·Kᵀ · ds1) · scale (+ pse); masked -> -1e12; E = exp(S - rowmax S) over the window's keys (unnormalized,
    in [0, 1]); P8 = sat(rhe(E · qs1)); O = (P8·V) · ds2 / rowsum(E); lse = rowmax S + log rowsum(E).
    Returns (out [B, N, Sq, Dv], lse [B, N, Sq], amb [B, N, Sq, Dv]): amb bounds |ΔO| caused by P8 entries
    whose E·qs1 lies within amb_eps of a rounding boundary (either neighbour is acceptable there).
    Windows / mask / sparse semantics are those of naive.one_batch (mask bool [B, >=Sq, >=Skv], physical)."""
    b, n, sq, _ = q8.shape
    kvn, skv, dv = v8.shape[1], v8.shape[2], v8.shape[3]
    grp = n // kvn
    out = torch.zeros(b, n, sq, dv, dtype=torch.float64)
    amb = torch.zeros(b, n, sq, dv, dtype=torch.float64)
    lse = torch.full((b, n, sq), math.inf, dtype=torch.float64)
    for i in range(b):
        q_lo, q_hi = q_windows[i] if q_windows is not None else (0, sq)
        kv_lo, kv_hi = kv_windows[i] if kv_windows is not None else (0, skv)
        s1, s2 = q_hi - q_lo, kv_hi - kv_lo
        if s1 <= 0 or s2 <= 0:
            continue
        geo = naive.band_masked(s1, s2, sparse_mode, pre_tokens, next_tokens, mask is not None)
        user = torch.zeros(s1, s2, dtype=torch.bool)
        if mask is not None and sparse_mode in (0, 1):
            user = mask[i][q_lo:q_hi, kv_lo:kv_hi].bool()
        masked = geo | user
        geo_empty = geo.all(dim=1)
        user_empty = masked.all(dim=1) & ~geo_empty
        dead = geo_empty | (user_empty if inner_precise & 2 else torch.zeros_like(geo_empty))
        for h in range(n):
            kh = h // grp
            qs = q8[i, h, q_lo:q_hi].double()
            ks = k8[i, kh, kv_lo:kv_hi].double()
            vs = v8[i, kh, kv_lo:kv_hi].double()
            acc = qs @ ks.T                                        # exact integer products
            s = (acc * ds1) * scale
            if pse is not None:
                s = s + pse[i if pse.shape[0] > 1 else 0, h, q_lo:q_hi, kv_lo:kv_hi].double()
            s = s.masked_fill(masked, naive.FILL)
            m = s.max(dim=1, keepdim=True).values
            e = torch.exp(s - m)                                   # unnormalized: the row max gives 1
            rs = e.sum(dim=1, keepdim=True)                        # rowsum(E) >= 1
            x = e * qs1
            p8 = sat_int8(round_half_even(x))
            frac = x - torch.floor(x)
            near = ((frac - 0.5).abs() < amb_eps) & (x < 127.5 + amb_eps) & (x > -128.5 - amb_eps)
            o = (p8 @ vs) * ds2 / rs                               # the row sum divides last
            a = (near.double() @ vs.abs()) * abs(ds2) / rs
            l = (m + torch.log(rs)).squeeze(1)
            o[dead] = 0.0
            a[dead] = 0.0
            l[dead] = math.inf
            out[i, h, q_lo:q_hi] = o
            amb[i, h, q_lo:q_hi] = a
            lse[i, h, q_lo:q_hi] = l
    return out, lse, amb


# ---------------------------------------------------------------------------------------------- SPEC 12
def out_quant_bounds(y: torch.Tensor, amb: Optional[torch.Tensor], scale, offset=None, slack: int = 1):
    """Expected int8 output interval for float64 reference outputs y (± amb), SPEC 12:
    y8 = sat(rhe(y·scale + offset)). Returns (lo, hi) float64 tensors (inclusive), widened by `slack`."""
    off = 0.0 if offset is None else offset
    a = torch.zeros_like(y) if amb is None else amb
    z1 = (y - a) * scale + off
    z2 = (y + a) * scale + off
    zl, zh = torch.minimum(z1, z2), torch.maximum(z1, z2)
    lo = sat_int8(round_half_even(zl) - slack)
    hi = sat_int8(round_half_even(zh) + slack)
    return lo, hi


def assert_int8_within(out8: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, what: str = "int8 out"):
    assert out8.dtype == torch.int8, out8.dtype
    o = out8.double()
    bad = (o < lo) | (o > hi)
    if bad.any():
        idx = tuple(int(x) for x in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {o.numel()} elements outside the expected interval; "
                             f"first at {idx}: got {o[idx].item()}, expected [{lo[idx].item()}, {hi[idx].item()}]")


def assert_within_amb(out: torch.Tensor, ref: torch.Tensor, amb: torch.Tensor, rel: float, what: str = "out"):
    """|out - ref| <= amb + rel·max|ref| (+ rounding of the output dtype relative to |ref|) elementwise."""
    o = out.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    denom = max(ref.abs().max().item(), 1e-30)
    lim = amb + rel * denom + 2 ** -10 * ref.abs()
    diff = (o - ref).abs()
    bad = diff > lim
    if bad.any():
        idx = tuple(int(x) for x in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off; first at {idx}: got {o[idx].item():.6g}, "
                             f"ref {ref[idx].item():.6g}, allowed ±{lim[idx].item():.3g}; max rel err "
                             f"{(diff.max() / denom).item():.3g}")
