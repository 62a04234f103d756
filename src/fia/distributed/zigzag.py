"""The zigzag layout of causal ring attention: a sequence cut into 2W equal chunks, rank r holding chunk r
followed by chunk 2W-1-r, so every rank has the same amount of causal work (ring-flash-attention's layout).

Batched layouts split the sequence axis (its length divisible by 2W); TND splits each sequence of the packed
token axis by its cumulative lengths (each length divisible by 2W) and returns the rank's cumulative lengths.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..errors import input_error
from .args import cumulative_to_lengths, lengths_to_cumulative

__all__ = ["zigzag_shard", "zigzag_unshard"]


def _chunks(x: torch.Tensor, world: int, dim: int, name: str) -> List[torch.Tensor]:
    n = x.shape[dim]
    if n % (2 * world):
        raise input_error(name, f"a sequence length divisible by 2 * world = {2 * world}", n)
    return list(x.split(n // (2 * world), dim=dim))


def _check(world: int, rank: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise input_error("rank", f"0 <= rank < world (world = {world})", rank)


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1,
                 cu_seqlens: Optional[Sequence[int]] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, List[int]]]:
    """Rank `rank`'s zigzag slice of a whole sequence: chunk rank then chunk 2*world-1-rank along `dim`
    (1 for BSH / BSND, 2 for BNSD, 0 for TND). With `cu_seqlens` (TND's cumulative lengths) every sequence is
    split on its own and (slice, the rank's cumulative lengths) is returned."""
    _check(world, rank)
    if cu_seqlens is None:
        c = _chunks(x, world, dim, "x")
        return torch.cat([c[rank], c[2 * world - 1 - rank]], dim=dim)
    parts, local, start = [], [], 0
    for n in cumulative_to_lengths("cu_seqlens", list(cu_seqlens)):
        c = _chunks(x.narrow(dim, start, n), world, dim, "cu_seqlens")
        parts += [c[rank], c[2 * world - 1 - rank]]
        local.append(2 * c[rank].shape[dim])
        start += n
    return torch.cat(parts, dim=dim), lengths_to_cumulative(local)


def zigzag_unshard(parts: Sequence[torch.Tensor], dim: int = 1,
                   cu_seqlens: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """The inverse of zigzag_shard: every rank's slice (in rank order) -> the whole sequence. With
    `cu_seqlens`, each rank's cumulative lengths (TND)."""
    world = len(parts)
    if world == 0:
        raise input_error("parts", "one slice per rank", "an empty list")
    if cu_seqlens is None:
        halves = [p.split(p.shape[dim] // 2, dim=dim) for p in parts]
        order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
        return torch.cat(order, dim=dim)
    if len(cu_seqlens) != world:
        raise input_error("cu_seqlens", f"{world} lists of cumulative lengths (one per rank)", len(cu_seqlens))
    lens = [cumulative_to_lengths("cu_seqlens", list(c)) for c in cu_seqlens]
    starts = [0] * world
    out = []
    for b in range(len(lens[0])):
        first, second = [], []
        for r in range(world):
            n = lens[r][b]
            seg = parts[r].narrow(dim, starts[r], n)
            first.append(seg.narrow(dim, 0, n // 2))
            second.append(seg.narrow(dim, n // 2, n - n // 2))
            starts[r] += n
        out += first + second[::-1]
    return torch.cat(out, dim=dim)
