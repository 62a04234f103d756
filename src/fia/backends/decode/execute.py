"""A decode call's launch: the plan's work items on the thread pool (attend_items: one item owns one KV head group
and all its G * Q_S query rows for a key range, partials per work entry), then one merge (splits + prefix + sink,
normalization, value dequant, special rows) writing the output in its final layout and dtype and the lse."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...cpu.threads import launch as launch_threads
from ...problem.attention import AttentionProblem
from ..base import BackendResult
from .inputs import Inputs, Source
from .plan import Launch, Plan

# [chunks whose QK ran the int16 query kernels, all chunks] x KV heads, summed over every call (atomic adds in the
# kernels): which QK path the data chose (kernels.I8_QK_MAX_ERR), for tests and measurements
QK_STATS = np.zeros(2, np.int64)


def execute(p: AttentionProblem, x: Inputs, plan: Plan, K) -> Optional[BackendResult]:
    """Allocate the partials and outputs, hand every buffer's address to the kernels, run them. None where a
    computed row came out NaN or infinite (merge): the caller answers with the reference's numbers."""
    H, R0, Dv = p.KV_N, p.G * p.Q_S, p.Dv
    po, pm, pl, pany = partials(plan.W, H, R0, Dv)
    qbufs = x.addresses(K)
    for src, launch in zip(x.sources, plan.own):
        if launch is not None:
            _attend(K, plan, launch, src, qbufs, x.kchan, po, pm, pl, pany)
    ppo, ppm, ppl, ppany = po, pm, pl, pany                  # (read only with a prefix)
    if plan.prefix is not None:
        ppo, ppm, ppl, ppany = partials(plan.prefix.work.shape[1], H, plan.prefix_rows, Dv)
        _attend(K, plan, plan.prefix, x.prefix, qbufs, x.kchan, ppo, ppm, ppl, ppany)
    out = torch.empty_strided(plan.out_size, plan.out_stride, dtype=plan.out_dtype)
    lse, lse_addr = lse_target(p.lse_shape(), p.want_lse)
    if merge(K, plan, (x.sink, x.vcs, x.vco), out, lse_addr, (po, pm, pl, pany), (ppo, ppm, ppl, ppany)):
        return None
    return BackendResult(out, lse if p.want_lse else None)


def lse_target(shape: tuple, want: bool):
    """(buffer, its (address, bytes)) merge writes the lse to: a float32 tensor when wanted, else numpy
    scratch (merge writes the lse anyway; a torch.empty costs ~3 us more per small call). The caller keeps
    the buffer alive until merge has run."""
    if want:
        lse = torch.empty(*shape, dtype=torch.float32)
        return lse, (lse.data_ptr(), lse.numel() * 4)
    scratch = np.empty(shape, np.float32)
    return scratch, (scratch.ctypes.data, scratch.size * 4)


def merge(K, plan: Plan, factors: tuple, out: torch.Tensor, lse_addr: tuple, parts: tuple, pparts: tuple) -> int:
    """Merge the partials (own, prefix) into `out` (the plan's output, allocated) and the lse at lse_addr;
    factors: Inputs' (sink, vcs, vco). Returns the kernel's non-finite flag."""
    obufs = np.array([[out.data_ptr(), lse_addr[0]], [plan.out_bytes, lse_addr[1]]], np.int64)
    return K.merge(plan.mp, plan.geo, *parts, plan.wrange, *pparts, plan.pwrange, *factors, plan.obase, obufs)


def launch_array(K, parts: dict) -> np.ndarray:
    """attend_merge's launch array L: {LA_* index: int64 array (1-D or 2-D)} laid out as the kernels read it (a head
    of (offset, rows, columns) per part, then the parts' elements, row-major)."""
    arrs = [np.ascontiguousarray(parts[i], np.int64) for i in range(K.LA_PARTS)]
    head = 3 * K.LA_PARTS
    L = np.empty(head + sum(a.size for a in arrs), np.int64)
    o = head
    for i, a in enumerate(arrs):
        rows, cols = (a.shape[0], a.shape[1]) if a.ndim == 2 else (a.size, 1)
        L[3 * i:3 * i + 3] = o, rows, cols
        L[o:o + a.size] = a.ravel()
        o += a.size
    return L


def partials(W: int, H: int, R: int, Dv: int):
    """Unnormalized partial results of W work entries: acc, running max, sum, 'saw a key' flags."""
    W = max(W, 1)
    return (np.empty((W, H, R, Dv), np.float32), np.empty((W, H, R), np.float32), np.zeros((W, H, R), np.float32),
            np.zeros((W, H, R), np.uint8))


def _attend(K, plan: Plan, launch: Launch, src: Source, qbufs: np.ndarray, kchan, po, pm, pl, pany) -> None:
    bufs = qbufs.copy()
    src.addresses(bufs, K)
    w0, w1 = launch.w0, launch.w1
    launch_threads(K.attend_items, launch.items, launch.threads,
            (launch.ip, plan.fp, plan.geo, launch.work, src.tbl, bufs, kchan, src.ktok.tbl, src.vtok.tbl,
             po[w0:w1], pm[w0:w1], pl[w0:w1], pany[w0:w1], launch.generic, QK_STATS))

