"""Paged KV cache: block_table + block_size (SPEC 8)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import numpy as np
import torch

from ..problem.layout import Layout
from ..problem.attention import PagedKV, cache_dim
from .context import Ctx, dtype_name
from .tensors import QueryDims

MAX_BLOCK_SIZE = 512
MAX_3D_H = 65535
NZ_D0 = {torch.float16: 16, torch.bfloat16: 16, torch.int8: 32}    # SPEC 8b.1: 32-byte fragments


def cache_view(t: torch.Tensor, kv_n: int) -> torch.Tensor:
    """A validated 3-D (blocknum, block_size, KV_N*D) or 4-D (blocknum, KV_N, block_size, D) cache as its
    canonical [NB, KV_N, bs, D] view."""
    if t.dim() == 3:
        return t.unflatten(2, (kv_n, t.shape[2] // kv_n)).permute(0, 2, 1, 3)
    if t.dim() == 5:                                   # NZ (blocknum, KV_N, D/D0, bs, D0) -> [NB, KV_N, bs, D/D0, D0]
        return t.permute(0, 1, 3, 2, 4)
    return t


def bad_block(host: np.ndarray, blocks_used: np.ndarray, nb: int) -> Optional[Tuple[int, int]]:
    """The first [b, j] of the host block table [B, MB] whose block id is outside [0, nb) among the columns
    j < blocks_used[b] in use, or None. (NumPy: this runs on every paged call; torch ops cost ~15 us more.)"""
    used = np.arange(host.shape[1])[None, :] < blocks_used[:, None]                # [B, MB]
    bad = used & ((host < 0) | (host >= nb))
    if not bad.any():
        return None
    return tuple(int(x[0]) for x in np.nonzero(bad))


def table_host(host: np.ndarray) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(r) for r in host.tolist())


def reread_table(ctx: Ctx, kv: PagedKV) -> PagedKV:
    """kv with its block table read again from the tensor (a deferred execution reads the table as it is then,
    as the NPU reads device memory when the kernel runs), range-checked again: every backend then uses that
    one snapshot, and an id rewritten out of range is an error instead of a wild read."""
    host = kv.block_table.to("cpu", copy=True).numpy()                            # [B, MB] int32 / int64
    nb = kv.key.shape[0]
    bad = bad_block(host, np.asarray(kv.blocks_used, dtype=np.int64), nb)
    if bad is not None:
        i, j = bad
        raise ctx.err("block_table", f"block ids in [0, {nb}) for every used entry (blocknum = {nb}) when the "
                      "call executes", f"{int(host[i, j])} at [{i}, {j}] (the table changed after it was checked)",
                      "FIA range-checks block ids instead of reading out of bounds")
    # the checked copy is the table of this execution (a rewrite while the kernels run cannot reach them)
    return replace(kv, block_table=torch.from_numpy(host).to(kv.block_table.device), table_host=table_host(host))


def _cache(ctx: Ctx, name: str, t: torch.Tensor, layout: Layout, kv_n: int, dim: Optional[int]):
    """A cache tensor -> canonical [NB, KV_N, bs, D] view. dim: the required D (None = any)."""
    if t.dim() == 3:                                   # (blocknum, block_size, KV_N * D)
        h = t.shape[2]
        if h % kv_n:
            raise ctx.err(name, f"a (blocknum, block_size, KV_N*D) cache with H divisible by KV_N = {kv_n}", t)
        d = h // kv_n
        if ctx.strict and h > MAX_3D_H:
            raise ctx.hw(name, f"H = KV_N*D <= {MAX_3D_H} for the (blocknum, block_size, H) cache", f"H = {h}",
                         "use the (blocknum, KV_N, block_size, D) cache or fewer KV heads")
        view = cache_view(t, kv_n)
    elif t.dim() == 4:                                 # (blocknum, KV_N, block_size, D)
        if layout.inp not in ("BNSD", "TND"):
            raise ctx.err(name, f"a 3-D (blocknum, block_size, H) cache for input_layout {layout.name} "
                          "(the 4-D cache needs BNSD or TND)", t)
        if t.shape[1] != kv_n:
            raise ctx.err(name, f"KV_N = {kv_n} heads on axis 1 of the (blocknum, KV_N, block_size, D) cache", t)
        d = t.shape[3]
        view = t
    elif t.dim() == 5:                                 # NZ (blocknum, KV_N, D/D0, block_size, D0) (SPEC 8b.1)
        d0 = NZ_D0.get(t.dtype)
        if d0 is None:
            raise ctx.err(name, "a 3-D or 4-D cache for dtype " + dtype_name(t.dtype) + " (5-D NZ caches are "
                          "float16, bfloat16 or int8 only, SPEC 8b.2 d)", t)
        if t.shape[1] != kv_n or t.shape[4] != d0:
            raise ctx.err(name, f"an NZ cache (blocknum, KV_N, D/{d0}, block_size, {d0}) with KV_N = {kv_n} for "
                          f"{dtype_name(t.dtype)} (D0 = 32 bytes / element size, SPEC 8b.1)", t)
        d = t.shape[2] * d0
        view = cache_view(t, kv_n)
    else:
        raise ctx.err(name, "a 3-D (blocknum, block_size, H), 4-D (blocknum, KV_N, block_size, D) or 5-D NZ "
                      "(blocknum, KV_N, D/D0, block_size, D0) cache", t)
    if dim is not None and d != dim:
        raise ctx.err(name, f"head dim {dim}", f"D = {d} ({tuple(t.shape)})")
    return view


def paged_kv(ctx: Ctx, layout: Layout, qd: QueryDims, b: int, key, value, key_rope, block_table, block_size,
             kv_lens: Tuple[int, ...], *, decode: bool, kv_dtype: torch.dtype, pack: int = 1,
             allow_dv_differs: bool = False):
    """Validate the paged cache; return (PagedKV, Dv, max_blocks * block_size)."""
    if isinstance(key, tuple) or isinstance(value, tuple):
        raise ctx.err("block_table", "None with tensor-list key/value (paged KV does not take tensor lists)",
                      block_table)
    bt = ctx.tensor("block_table", block_table)
    bs = ctx.integer("block_size", block_size)
    if bt.dim() != 2:
        raise ctx.err("block_table", "a 2-D [B, max_blocks] tensor", bt)
    if bt.dtype not in (torch.int32, torch.int64) or (ctx.strict and bt.dtype != torch.int32):
        raise ctx.err("block_table", "dtype int32" + ("" if ctx.strict else " or int64"), f"dtype {dtype_name(bt.dtype)}")
    if bt.shape[0] != b:
        raise ctx.err("block_table", f"B = {b} rows", bt)
    if bs <= 0:
        raise ctx.err("block_size", "a positive block size with block_table", bs)
    if ctx.strict:
        if bs > MAX_BLOCK_SIZE and not (bs == 1024 and layout.packed and qd.D != 512):   # SPEC 14b.4 T14 (1421)
            raise ctx.hw("block_size", f"at most {MAX_BLOCK_SIZE}", bs)
        align = (32 if kv_dtype == torch.int8 else 16) if decode else 128
        if bs % align:
            raise ctx.hw("block_size", f"a multiple of {align}" + (" for decode with " + dtype_name(kv_dtype)
                                                                  + " KV" if decode else " for Q_S > 1"), bs)
    kc = _cache(ctx, "key", key, layout, qd.KV_N, qd.D // pack)
    vc = _cache(ctx, "value", value, layout, qd.KV_N, None if allow_dv_differs else qd.D // pack)
    if vc.shape[0] != kc.shape[0] or vc.shape[2] != kc.shape[2] or key.dim() != value.dim():
        raise ctx.err("value", f"a cache shaped like key {tuple(key.shape)} (except D)", value)
    if kc.shape[2] != bs:
        raise ctx.err("block_size", f"the cache's block axis = {kc.shape[2]}", bs)
    krc = None
    if key_rope is not None:
        krc = _cache(ctx, "key_rope", key_rope, layout, qd.KV_N, None)
        if krc.shape[:3] != kc.shape[:3] or key_rope.dim() != key.dim():
            raise ctx.err("key_rope", f"a cache shaped like key {tuple(key.shape)} except D", key_rope)
    nb, mb = kc.shape[0], bt.shape[1]
    need = max(((n + bs - 1) // bs for n in kv_lens), default=0)
    if mb < need:
        raise ctx.err("block_table", f"at least {need} columns (ceil(max actual_seq_lengths_kv / block_size))",
                      bt)
    host = ctx.host("block_table", bt).to("cpu").numpy()                         # [B, MB] int32 / int64
    used = tuple((n + bs - 1) // bs for n in kv_lens)                             # [B] columns in use
    bad = bad_block(host, np.array(used, dtype=np.int64), nb)
    if bad is not None:
        i, j = bad
        raise ctx.err("block_table", f"block ids in [0, {nb}) for every used entry (blocknum = {nb})",
                      f"{int(host[i, j])} at [{i}, {j}]", "FIA range-checks block ids instead of reading out of bounds")
    # the table may live on another device than the cache (host-read, see core._HOST_ARGS): backends get it
    # beside the cache
    return (PagedKV(kc, vc, bt.to(kc.device), bs, table_host(host), krc, used), cache_dim(vc) * pack, mb * bs)
