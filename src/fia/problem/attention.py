"""AttentionProblem: one normalized, immutable description of a call (SPEC 2-9).

Parse builds it once; backends only read it. Coordinates:
* physical: positions inside the tensors the user passed (row r of the query, key position p);
* window-local: i = r - q_lo, j = column inside the batch's effective keys (prefix first, then the
  batch's own valid keys). Band geometry (SPEC 5) is window-local; user masks and pse_shift are
  indexed physically: row r, column kv_lo + j (prefix columns first, so own key p sits at P + p).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

from .layout import Layout
from .quant import AntiQuant, FullQuant, OutputQuant, QueryDequant

MASK_FILL = -1e12          # SPEC 3: masked scores take a finite fill, so fully masked rows stay finite
PRE_NEXT_CLAMP = 214748647  # SPEC 5: larger pre/next tokens are clamped to this


@dataclass(frozen=True)
class BatchGeometry:
    """Per-batch extents. Physical windows: query rows [q_lo, q_hi), own keys [kv_lo, kv_hi)."""
    q_rows: int       # physical query rows of this batch (Q_S, or its packed length)
    q_lo: int
    q_hi: int
    kv_rows: int      # physical key positions of this batch's own keys
    kv_lo: int
    kv_hi: int
    prefix: int = 0   # shared-prefix keys placed before this batch's own keys
    q_offset: int = 0   # packed layouts: first row of this batch in T
    kv_offset: int = 0  # packed layouts: first key of this batch in T_kv

    @property
    def s1(self) -> int:
        """Valid query rows."""
        return self.q_hi - self.q_lo

    @property
    def s2(self) -> int:
        """Effective keys: prefix + own valid keys."""
        return self.prefix + self.kv_hi - self.kv_lo


@dataclass(frozen=True)
class MaskSpec:
    """What is masked (SPEC 5), after the decode / ignore rules of parse.

    kind: "none"  nothing but lengths;   "user" the user mask only (mode 1, decode, left padding);
          "band"  band geometry (+ user mask if given): modes 0-with-mask, 2, 3, 4.
    user_mask: [Bm, Qm, Km] (Bm in {1, B}), physical coordinates, nonzero = masked, or None.
    """
    kind: str = "none"
    sparse_mode: int = 0
    pre: int = PRE_NEXT_CLAMP
    next: int = PRE_NEXT_CLAMP
    user_mask: Optional[torch.Tensor] = None

    def band_for(self, s1: int, s2: int) -> Optional[Tuple[int, int]]:
        """Window-local (pre, next) of the band for a batch with S1 rows and S2 keys, or None.

        Key j is outside the band of row i when j > i + next or j < i - pre.
        """
        if self.kind != "band":
            return None
        m = self.sparse_mode
        if m == 0:
            return self.pre, self.next
        if m == 2:                      # left-up causal
            return PRE_NEXT_CLAMP + s1, 0
        if m == 3:                      # right-down causal
            return PRE_NEXT_CLAMP + s1, s2 - s1
        if m == 4:                      # band on the bottom-right diagonal
            return self.pre - s2 + s1, self.next + s2 - s1
        raise AssertionError(m)


def _cut(t: Optional[torch.Tensor], lo: int, hi: int):
    return None if t is None else t[:, lo:hi]


@dataclass(frozen=True)
class DenseKV:
    """key [B, KV_N, KV_S, D], value [B, KV_N, KV_S, Dv], key_rope [B, KV_N, KV_S, Dr] (canonical views)."""
    key: torch.Tensor
    value: torch.Tensor
    key_rope: Optional[torch.Tensor] = None
    kind: str = field(default="dense", init=False)

    def rows(self, b: int, g: BatchGeometry, lo: int, hi: int):
        """Own keys [lo, hi) of batch b: key [KV_N, n, D], value [KV_N, n, Dv], key_rope [KV_N, n, Dr] | None."""
        kr = None if self.key_rope is None else self.key_rope[b]
        return self.key[b, :, lo:hi], self.value[b, :, lo:hi], _cut(kr, lo, hi)


@dataclass(frozen=True)
class PackedKV:
    """TND family: key [KV_N, T_kv, D], value [KV_N, T_kv, Dv]; batch b starts at its kv_offset."""
    key: torch.Tensor
    value: torch.Tensor
    key_rope: Optional[torch.Tensor] = None
    kind: str = field(default="packed", init=False)

    def rows(self, b: int, g: BatchGeometry, lo: int, hi: int):
        o = g.kv_offset
        return self.key[:, o + lo:o + hi], self.value[:, o + lo:o + hi], _cut(self.key_rope, o + lo, o + hi)


@dataclass(frozen=True)
class ListKV:
    """Tensor-list KV: per batch key [KV_N, S_b, D], value [KV_N, S_b, Dv] (batch axis dropped)."""
    keys: Tuple[torch.Tensor, ...]
    values: Tuple[torch.Tensor, ...]
    key_ropes: Optional[Tuple[torch.Tensor, ...]] = None
    kind: str = field(default="list", init=False)

    def rows(self, b: int, g: BatchGeometry, lo: int, hi: int):
        kr = None if self.key_ropes is None else self.key_ropes[b]
        return self.keys[b][:, lo:hi], self.values[b][:, lo:hi], _cut(kr, lo, hi)


@dataclass(frozen=True)
class PagedKV:
    """Paged cache: key [NB, KV_N, bs, D], value [NB, KV_N, bs, Dv] (canonical views of either cache
    layout; NZ caches: [NB, KV_N, bs, D/D0, D0], see `nz`); block_table [B, MB] (int); token p of batch b lives in block
    table[b, p // bs], slot p % bs.
    table_host: the same table as Python ints (planning never syncs with a device)."""
    key: torch.Tensor
    value: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    table_host: Tuple[Tuple[int, ...], ...]
    key_rope: Optional[torch.Tensor] = None
    blocks_used: Tuple[int, ...] = ()   # table columns in use per batch (range-checked; parse/paged.py)
    kind: str = field(default="paged", init=False)

    @property
    def nz(self) -> bool:
        """5-D NZ caches (SPEC 8b): key / value / key_rope are [NB, KV_N, bs, D/D0, D0] views (no copy) of the
        (blocknum, KV_N, D/D0, block_size, D0) tensors; a token's D values are D/D0 fragments of D0."""
        return self.key.dim() == 5

    def rows(self, b: int, g: BatchGeometry, lo: int, hi: int):
        """Gathers only the blocks holding positions [lo, hi) of batch b (never the whole pool)."""
        bs = self.block_size
        if hi <= lo:
            e = self.key.new_empty
            kr = None if self.key_rope is None else self.key_rope.new_empty(
                (self.key_rope.shape[1], 0, cache_dim(self.key_rope)))
            return (e((self.key.shape[1], 0, cache_dim(self.key))),
                    self.value.new_empty((self.value.shape[1], 0, cache_dim(self.value))), kr)
        first, last = lo // bs, (hi - 1) // bs
        ids = torch.tensor(self.table_host[b][first:last + 1], dtype=torch.long, device=self.key.device)
        off = lo - first * bs

        def gather(cache):  # [NB, KV_N, bs, D] (NZ: [NB, KV_N, bs, D/D0, D0]) -> [KV_N, hi - lo, D]
            if cache.dim() == 5:   # NZ: whole blocks of the stored (NB, KV_N, D/D0, bs, D0) tensor
                blocks = cache.permute(0, 1, 3, 2, 4).index_select(0, ids).permute(0, 1, 3, 2, 4)
            else:
                blocks = cache.index_select(0, ids)                      # [nb, KV_N, bs, D]
            flat = blocks.permute(1, 0, 2, *range(3, blocks.dim())).reshape(cache.shape[1], -1, cache_dim(cache))
            return flat[:, off:off + hi - lo]

        kr = None if self.key_rope is None else gather(self.key_rope)
        return gather(self.key), gather(self.value), kr


def cache_dim(t: torch.Tensor) -> int:
    """Head dim of a paged cache view: [NB, KV_N, bs, D], or NZ [NB, KV_N, bs, D/D0, D0] (SPEC 8b)."""
    return t.shape[3] * t.shape[4] if t.dim() == 5 else t.shape[3]


KVStorage = Union[DenseKV, PackedKV, ListKV, PagedKV]


@dataclass(frozen=True)
class SharedPrefix:
    """System-prompt KV shared by every batch: key [KV_N, P, D], value [KV_N, P, Dv] (already cut to P)."""
    key: torch.Tensor
    value: torch.Tensor

    @property
    def length(self) -> int:
        return self.key.shape[1]


@dataclass(frozen=True)
class AttentionProblem:
    api: str                    # entry point that built it (for messages)
    layout: Layout
    B: int
    N: int                      # query heads
    KV_N: int
    Q_S: int                    # padded query length (packed: longest batch)
    KV_S: int                   # longest physical KV length of any batch (paged: max_blocks * block_size)
    D: int
    Dv: int
    T: int                      # packed layouts: total query rows (0 otherwise)
    dtype: torch.dtype          # query dtype
    out_dtype: torch.dtype
    compute_dtype: torch.dtype  # float32, or float64 for float64 input (portable)
    query: torch.Tensor         # [B, N, Q_S, D] or packed [N, T, D]
    kv: KVStorage
    geometry: Tuple[BatchGeometry, ...]
    mask: MaskSpec
    pse: Optional[torch.Tensor]  # [Bp, N, Qp, Kp] (Bp in {1, B}), physical coordinates
    scale: float
    row_invalid_fix: bool       # inner_precise bit 1
    high_precision: bool        # inner_precise bit 0 == 0 (never changes semantics)
    want_lse: bool
    is_decode: bool
    strict: bool
    query_rope: Optional[torch.Tensor] = None   # like query with D -> Dr
    prefix: Optional[SharedPrefix] = None
    antiquant: Optional[AntiQuant] = None       # int8/int4 K/V with a float query (SPEC 10)
    full_quant: Optional[FullQuant] = None      # int8 Q, K, V (SPEC 11)
    query_dequant: Optional[QueryDequant] = None  # int8 query, query_quant_mode 3 (SPEC 11)
    out_quant: Optional[OutputQuant] = None     # int8 output (SPEC 12)
    sink: Optional[torch.Tensor] = None         # learnable_sink [N] float (SPEC 1.1b)
    # shared by every problem the parse memo built from the same metadata (parse/memo.py); None: not memoized.
    # Backends may key metadata-only work on it (everything but the tensors' data is equal)
    memo_key: Optional[int] = field(default=None, compare=False, repr=False)

    @property
    def G(self) -> int:
        return self.N // self.KV_N

    def evolve(self, **fields) -> "AttentionProblem":
        """A copy with `fields` replaced. No __init__ (dataclasses.replace re-runs it: ~10 us of the small call)."""
        p = object.__new__(AttentionProblem)
        p.__dict__.update(self.__dict__)
        p.__dict__.update(fields)
        return p

    @property
    def packed(self) -> bool:
        return self.layout.packed

    @property
    def device(self) -> torch.device:
        return self.query.device

    def query_rows(self, b: int, lo: int, hi: int):
        """Physical query rows [lo, hi) of batch b: q [N, hi - lo, D], q_rope [N, hi - lo, Dr] | None."""
        if self.packed:
            o = self.geometry[b].q_offset
            return self.query[:, o + lo:o + hi], _cut(self.query_rope, o + lo, o + hi)
        qr = None if self.query_rope is None else self.query_rope[b]
        return self.query[b, :, lo:hi], _cut(qr, lo, hi)

    def out_shape(self) -> tuple:
        """Canonical output shape: [B, N, Q_S, Dv] or packed [N, T, Dv]."""
        return (self.N, self.T, self.Dv) if self.packed else (self.B, self.N, self.Q_S, self.Dv)

    def lse_shape(self) -> tuple:
        """Canonical lse shape: [B, N, Q_S] or packed [N, T]."""
        return (self.N, self.T) if self.packed else (self.B, self.N, self.Q_S)
