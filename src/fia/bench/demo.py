"""The README's main job: a decode loop over a paged KV cache.

Each step appends one token's K/V per sequence into a shared pool of blocks (a new block is taken from
the free list when a sequence crosses a block boundary), then runs one decode step with
npu_fused_infer_attention_score(block_table=..., block_size=..., actual_seq_lengths_kv=..., BNSD) and
prints a line: lengths, blocks in use, FIA's time and its difference from torch SDPA on the same keys.
If paged KV is not available (FiaUnsupportedError), the same loop runs on a dense cache with
actual_seq_lengths_kv.

    python -m fia.bench.demo          # or: fia-bench --demo
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


class PagedKVCache:
    """A pool of blocks [num_blocks, KV_N, block_size, D] for K and V, and a block table per sequence."""

    def __init__(self, batch: int, num_blocks: int, max_blocks: int, kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype):
        self.k = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)  # [blocks, KV_N, bs, D]
        self.v = torch.zeros_like(self.k)
        self.block_size = block_size
        self.table = torch.full((batch, max_blocks), -1, dtype=torch.int32)           # [B, max_blocks], -1 = unused
        self.lens = [0] * batch
        g = torch.Generator().manual_seed(1234)
        self.free = torch.randperm(num_blocks, generator=g).tolist()                    # blocks scattered in the pool

    def append_row(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [KV_N, D]: one new token of sequence b (a fresh block when it crosses a block boundary)."""
        slot, off = divmod(self.lens[b], self.block_size)
        if off == 0:
            self.table[b, slot] = self.free.pop()
        blk = int(self.table[b, slot])
        self.k[blk, :, off] = k
        self.v[blk, :, off] = v
        self.lens[b] += 1

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, KV_N, D]: one new token per sequence."""
        for b in range(len(self.lens)):
            self.append_row(b, k[b], v[b])

    def dense(self, b: int):
        """Sequence b's keys and values, gathered: [KV_N, len, D] each."""
        n = -(-self.lens[b] // self.block_size)
        ids = self.table[b, :n].long()
        k = self.k[ids].transpose(0, 1).flatten(1, 2)[:, : self.lens[b]]
        v = self.v[ids].transpose(0, 1).flatten(1, 2)[:, : self.lens[b]]
        return k, v


class DenseKVCache:
    """Fallback: K/V [B, KV_N, max_len, D] with per-sequence lengths."""

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype)  # [B, KV_N, max_len, D]
        self.v = torch.zeros_like(self.k)
        self.lens = [0] * batch

    def append_row(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[b, :, self.lens[b]] = k
        self.v[b, :, self.lens[b]] = v
        self.lens[b] += 1

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for b in range(len(self.lens)):
            self.append_row(b, k[b], v[b])

    def dense(self, b: int):
        return self.k[b, :, : self.lens[b]], self.v[b, :, : self.lens[b]]


def _sdpa_step(q: torch.Tensor, cache, scale: float) -> torch.Tensor:
    """Per-sequence SDPA on the gathered keys: q [B, N, 1, D] -> [B, N, 1, D] (float32)."""
    outs = []
    for b in range(q.shape[0]):
        k, v = cache.dense(b)                                           # [KV_N, len, D]
        outs.append(F.scaled_dot_product_attention(q[b:b + 1].float(), k[None].float(), v[None].float(),
                                                   scale=scale, enable_gqa=True))
    return torch.cat(outs)


def demo(steps: int = 8, batch: int = 2, num_heads: int = 8, kv_heads: int = 2, head_dim: int = 128,
         block_size: int = 16, prompt_lens: Sequence[int] = (29, 14), num_blocks: int = 32,
         dtype: torch.dtype = torch.float16, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Run the paged decode loop; returns {"paged": bool, "lens": [...], "max_err": float}."""
    import fia

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)            # noqa: E731
    scale = 1.0 / math.sqrt(head_dim)
    max_len = max(prompt_lens) + steps
    max_blocks = -(-max_len // block_size)

    def make(paged: bool):
        cache = (PagedKVCache(batch, num_blocks, max_blocks, kv_heads, block_size, head_dim, dtype) if paged
                 else DenseKVCache(batch, max_len, kv_heads, head_dim, dtype))
        for b, n in enumerate(prompt_lens):                             # the prompts' K/V (prefill done)
            for _ in range(n):
                cache.append_row(b, rnd(kv_heads, head_dim), rnd(kv_heads, head_dim))
        return cache

    def step(cache, q, paged: bool) -> torch.Tensor:
        kw = dict(num_heads=num_heads, num_key_value_heads=kv_heads, scale=scale, input_layout="BNSD",
                  actual_seq_lengths_kv=list(cache.lens))
        if paged:
            kw.update(block_table=cache.table, block_size=block_size)
        out, _ = fia.npu_fused_infer_attention_score(q, cache.k, cache.v, **kw)
        return out                                                      # [B, N, 1, D]

    paged = True
    cache = make(True)
    try:
        step(cache, rnd(batch, num_heads, 1, head_dim), True)
    except fia.FiaUnsupportedError as e:
        paged = False
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"paged KV is not available yet ({first}); falling back to a dense cache with actual_seq_lengths_kv")
        cache = make(False)
    kind = f"paged: pool of {num_blocks} blocks x {block_size} tokens" if paged else "dense cache"
    log(f"decode loop, {kind}; B={batch} N={num_heads} KV_N={kv_heads} D={head_dim} {str(dtype)[6:]}")
    worst = 0.0
    for s in range(steps):
        cache.append(rnd(batch, kv_heads, head_dim), rnd(batch, kv_heads, head_dim))
        q = rnd(batch, num_heads, 1, head_dim)                          # [B, N, 1, D]
        t0 = time.perf_counter()
        out = step(cache, q, paged)
        ms = (time.perf_counter() - t0) * 1e3
        err = float((out.float() - _sdpa_step(q, cache, scale)).abs().max())
        worst = max(worst, err)
        blocks = (f", blocks {[-(-n // block_size) for n in cache.lens]} of {num_blocks}, table row 0 "
                  f"{cache.table[0, :-(-cache.lens[0] // block_size)].tolist()}" if paged else "")
        log(f"step {s}: lengths {cache.lens}{blocks}; {ms:.2f} ms; max|FIA - SDPA| = {err:.1e}")
    return {"paged": paged, "lens": list(cache.lens), "max_err": worst}


if __name__ == "__main__":
    demo()
