"""Quantization specs and their formulas (SPEC 10-12).

KV dequantization ("antiquant"): x = (x_q + offset) * scale, per key and per value, with one of the
granularities below. Normalized parameter shapes (float tensors, device of the cache):
  tensor            [1]                 one value for the whole tensor
  channel           [KV_N, D]           per head and channel
  head              [KV_N]              per head
  token             [Bs, S]             per physical KV position (Bs in {1, B}); paged: logical position
  token_head        [Bs, KV_N, S]       per position and head
  block_token       [NB, bs]            per token, stored by paged block
  block_token_head  [NB, KV_N, bs]      per token and head, stored by paged block
  token_group       [B, KV_N, S, D/32]  antiquant mode 6 (SPEC 10b.1): FP4 E2M1 codes (torch.float4_e2m1fn_x2,
                                        two per byte, low nibble first) times FLOAT8_E8M0 scales
                                        (torch.float8_e8m0fnu) per token, head and group of 32 channels; no
                                        offset; dense: physical position, paged: logical position
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

TOKEN_GRANULARITIES = ("token", "token_head", "block_token", "block_token_head", "token_group")
FP4_GROUP = 32              # channels per E8M0 scale (SPEC 10b.1, the OCP MX block)
# E2M1 (OCP MX v1.0 5.3.3): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; codes 8-15 negate 0-7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_fp4(x: torch.Tensor, dtype) -> torch.Tensor:
    """FP4 E2M1 [..., D/2] (float4_e2m1fn_x2, or its uint8 bytes) -> dtype [..., D]: element 2k is the low nibble
    of byte k, element 2k + 1 the high one (SPEC 10b.1; torch cannot convert FP4 itself)."""
    b = x.view(torch.uint8) if x.dtype != torch.uint8 else x
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=x.device)[codes.long()]


def dequant_fp4(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """x [..., D/2] FP4 codes, scale [..., D/32] float8_e8m0fnu (2^(bits - 127), 0xFF = NaN) -> dtype [..., D]."""
    v = decode_fp4(x, dtype)
    s = scale.to(dtype)
    return (v.unflatten(-1, (s.shape[-1], FP4_GROUP)) * s[..., None]).flatten(-2)


def unpack_int4(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., D/8] holding eight signed 4-bit values each (low nibble first) -> int8 [..., D] (SPEC 10.4)."""
    shifts = torch.arange(0, 32, 4, device=x.device, dtype=torch.int32)   # [8]
    nib = (x.unsqueeze(-1) >> shifts) & 0xF                                # [..., D/8, 8]
    nib = nib - (nib >= 8).to(nib.dtype) * 16                              # two's complement
    return nib.reshape(*x.shape[:-1], x.shape[-1] * 8).to(torch.int8)


def round_half_even_saturate_int8(y: torch.Tensor) -> torch.Tensor:
    """saturate_int8(round_half_even(y)) (torch.round rounds half to even)."""
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


def saturate_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> FP8 (float8_e4m3fn / float8_e5m2): clamped to the format's largest finite magnitude (inf too; NaN
    stays NaN), then rounded to nearest even by the cast."""
    m = torch.finfo(dtype).max
    return y.clamp(-m, m).to(dtype)


@dataclass(frozen=True)
class KVDequant:
    granularity: str
    scale: torch.Tensor
    offset: Optional[torch.Tensor] = None

    def factors(self, b: int, lo: int, hi: int, table=None, block_size: int = 0):
        """(scale, offset) broadcastable to [KV_N, hi - lo, D] for own keys [lo, hi) of batch b."""
        def pick(t: Optional[torch.Tensor]):
            if t is None:
                return None
            g = self.granularity
            if g == "tensor":
                return t.view(1, 1, 1)
            if g == "channel":
                return t[:, None, :]                                   # [KV_N, 1, D]
            if g == "head":
                return t[:, None, None]                                # [KV_N, 1, 1]
            bi = b if t.shape[0] > 1 else 0
            if g == "token":
                return t[bi, lo:hi][None, :, None]                     # [1, n, 1]
            if g == "token_head":
                return t[bi, :, lo:hi][:, :, None]                     # [KV_N, n, 1]
            if g == "token_group":
                return t[b, :, lo:hi]                                  # [KV_N, n, D/32] (E8M0)
            pos = torch.arange(lo, hi)
            blk = torch.tensor([table[b][p // block_size] for p in range(lo, hi)], dtype=torch.long,
                               device=t.device)
            slot = (pos % block_size).to(t.device)
            if g == "block_token":
                return t[blk, slot][None, :, None]                     # [1, n, 1]
            if g == "block_token_head":
                return t[blk, :, slot].transpose(0, 1)[:, :, None]     # [KV_N, n, 1]
            raise AssertionError(g)
        return pick(self.scale), pick(self.offset)

    def apply(self, x: torch.Tensor, dtype, b: int, lo: int, hi: int, table=None, block_size: int = 0):
        """Dequantize x [KV_N, n, D] (int8; FP4: [KV_N, n, D/2]) holding own keys [lo, hi) of batch b."""
        s, o = self.factors(b, lo, hi, table, block_size)
        if self.granularity == "token_group":                 # FP4 codes x per-group E8M0 scales (SPEC 10b.1)
            return dequant_fp4(x, s, dtype)
        x = x.to(dtype)
        if o is not None:
            x = x + o.to(dtype)
        return x * s.to(dtype)

    @property
    def per_token(self) -> bool:
        return self.granularity in TOKEN_GRANULARITIES


@dataclass(frozen=True)
class AntiQuant:
    """int8 / int4 K and V with a float query (SPEC 10)."""
    key: KVDequant
    value: KVDequant
    int4: bool = False


@dataclass(frozen=True)
class FullQuant:
    """int8 Q, K, V (SPEC 11): per-tensor scales as host floats."""
    dequant_scale1: float
    quant_scale1: float
    dequant_scale2: float


@dataclass(frozen=True)
class QueryDequant:
    """int8 query with query_quant_mode 3: Q = Q_q * scale, scale [B, N, Q_S] float32 (per token and head)."""
    scale: torch.Tensor


@dataclass(frozen=True)
class OutputQuant:
    """Quantized output: y8 = saturate(round_half_even(y * scale + offset)) in int8 (SPEC 12), or in FP8 where v2's
    out_dtype asks for it (DECISIONS 38); scale/offset [1] or [N, Dv]."""
    scale: torch.Tensor
    offset: Optional[torch.Tensor] = None

    def apply(self, out: torch.Tensor, packed: bool, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """out: canonical float [B, N, Q_S, Dv] (packed [N, T, Dv]) -> dtype (int8 or FP8), same shape."""
        s, o = self.scale.to(torch.float32), None if self.offset is None else self.offset.to(torch.float32)
        if s.dim() == 2:                                  # per channel [N, Dv]
            s = s[:, None, :] if packed else s[None, :, None, :]
            o = None if o is None else (o[:, None, :] if packed else o[None, :, None, :])
        y = out.to(torch.float32) * s
        if o is not None:
            y = y + o
        return saturate_fp8(y, dtype) if dtype.is_floating_point else round_half_even_saturate_int8(y)
