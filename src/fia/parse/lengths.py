"""actual_seq_lengths / actual_seq_lengths_kv -> per-batch windows (SPEC 2, 4)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .context import Ctx

MAX_TND_BATCH = 4096
MAX_T = 1048576


def per_batch(ctx: Ctx, name: str, lens: Optional[Tuple[int, ...]], b: int,
              limits: Sequence[int], limit_is: str = "the sequence length of batch {i}") -> Tuple[int, ...]:
    """Right-padded lengths: None -> the physical lengths; size 1 -> every batch; size >= B -> first B.
    limit_is says in the error what bounds the values ({i}: the batch index)."""
    if lens is None:
        return tuple(limits)
    got = broadcast(lens, b)
    if got is None:
        raise ctx.err(name, "at least 1 entry (B = 1)" if b == 1 else f"1 or at least B = {b} entries", f"{len(lens)} entries")
    for i, (v, lim) in enumerate(zip(got, limits)):
        if v < 0 or v > lim:
            raise ctx.err(name, f"values in [0, {lim}] ({limit_is.format(i=i)})", f"{v} at index {i}")
    return got


def broadcast(lens: Sequence, b: int) -> Optional[Tuple]:
    """The per-batch values of a lengths list of 1 (every batch) or >= b entries (the first b), else None."""
    if len(lens) == 1:
        return tuple(lens) * b
    if len(lens) >= b:
        return tuple(lens[:b])
    return None


def cumulative(ctx: Ctx, name: str, lens: Optional[Tuple[int, ...]], total: int) -> Tuple[int, ...]:
    """TND family: cumulative lengths (prefix sums; last entry = T). Returns offsets (B + 1 entries)."""
    if lens is None:
        raise ctx.err(name, "cumulative lengths (required for TND layouts)", "None")
    if len(lens) == 0:
        raise ctx.err(name, "at least one entry", "an empty list")
    if ctx.strict and len(lens) > MAX_TND_BATCH:
        raise ctx.hw(name, f"at most {MAX_TND_BATCH} entries for TND layouts", f"{len(lens)} entries")
    prev = 0
    for i, v in enumerate(lens):
        if v < prev:
            raise ctx.err(name, "non-decreasing cumulative lengths starting at >= 0 (TND layouts)",
                          f"{v} at index {i} after {prev}")
        prev = v
    if lens[-1] != total:
        raise ctx.err(name, f"last cumulative entry = {total} (the T axis)", lens[-1])
    return (0,) + tuple(lens)
