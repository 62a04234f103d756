"""The AMX-tile micro-kernels of the decode backend (cpu.amx.qk_amx / pv_amx) against float64.

Row counts cover one and several 8-row PV groups and 16-row QK groups (the caller splits larger QK counts),
key counts one and several 16-key blocks and more than one 256-key span, head dims every supported chunk
count. Keys are read through offset tables that are evenly spaced (the tiles load the cache itself), shuffled
(every block copied first) or evenly spaced in runs of 8 (a paged block boundary inside a tile block).
Scores and accumulator columns outside the written range are NaN-poisoned and must stay NaN; weights past
the keys are NaN bits and must not be read; the prefetch arguments point at real rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")
from numba import njit  # noqa: E402

from fia.cpu import amx as A  # noqa: E402

if not A.HAS_AMX:                 # one skip for the module, not one per case
    pytest.skip("the CPU (or the OS) offers no AMX-BF16 tiles", allow_module_level=True)
pytestmark = pytest.mark.backend_independent      # kernel-level: run once, not per backend (conftest)


@njit
def _qk(q, kbuf, offs, n, s, R, D, scale, xbuf, xoffs, xn):
    A.qk_amx(q.ctypes.data, q.shape[1] * 2, kbuf.ctypes.data, offs.ctypes.data, n, s.ctypes.data, s.shape[1],
             R, D, scale, xbuf.ctypes.data, xoffs.ctypes.data, xn, D, 2)


@njit
def _pv(p, vbuf, offs, n, acc, R, Dv, xbuf, xoffs, xn):
    A.pv_amx(p.ctypes.data, p.shape[1] * 2, vbuf.ctypes.data, offs.ctypes.data, n, acc.ctypes.data,
             acc.shape[1], R, Dv, xbuf.ctypes.data, xoffs.ctypes.data, xn, Dv, 2)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _rows(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """Row numbers (of a pool of 3 n + 40 rows) of the n keys."""
    pool = 3 * n + 40
    if kind == "even":                                   # one run: the tile loads read the pool itself
        return torch.arange(n) + 5
    if kind == "shuffled":                               # no two blocks alike: each block is copied first
        return torch.randperm(pool, generator=g)[:n]
    starts = torch.randperm(pool // 8 - 1, generator=g)[: (n + 7) // 8] * 8 + 3   # runs of 8 rows
    return (starts[:, None] + torch.arange(8)).reshape(-1)[:n]


@pytest.mark.parametrize("rows", ["even", "shuffled", "runs8"])
@pytest.mark.parametrize("R", [1, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("n", [16, 48, 272])
@pytest.mark.parametrize("D", [32, 64, 96, 128])
def test_qk_amx(rows, R, n, D):
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + D + len(rows))
    q = torch.randn(R, D, generator=g).bfloat16()
    pool = torch.randn(3 * n + 40, D, generator=g).bfloat16()
    idx = _rows(rows, n, g)
    offs = (idx * D).numpy().astype(np.int64)
    s = np.full((R + 1, n + 9), np.nan, np.float32)      # a poisoned row and poisoned columns past the keys
    _qk(_bits(q), _bits(pool).reshape(-1), offs, n, s, R, D, np.float32(0.3), _bits(pool).reshape(-1), offs, n)
    ref = 0.3 * (q.double() @ pool[idx].double().T).numpy()
    np.testing.assert_allclose(s[:R, :n], ref, rtol=1e-5, atol=1e-4)
    assert np.isnan(s[:R, n:]).all() and np.isnan(s[R]).all()


@pytest.mark.parametrize("rows", ["even", "shuffled", "runs8"])
@pytest.mark.parametrize("R", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("n", [16, 48, 272])
@pytest.mark.parametrize("Dv", [32, 64, 160, 256, 512])
def test_pv_amx(rows, R, n, Dv):
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + Dv + 7 + len(rows))
    p = torch.rand(R, n, generator=g).bfloat16()
    pool = torch.randn(3 * n + 40, Dv, generator=g).bfloat16()
    idx = _rows(rows, n, g)
    offs = (idx * Dv).numpy().astype(np.int64)
    pb = np.full((R, n + 6), 0x7FC0, np.uint16)          # bf16 NaN bits past the keys: never read
    pb[:, :n] = _bits(p)
    acc0 = torch.randn(R, Dv, generator=g).numpy()
    acc = np.full((R, Dv + 16), np.nan, np.float32)       # accumulates; columns past Dv stay NaN
    acc[:, :Dv] = acc0
    _pv(pb, _bits(pool).reshape(-1), offs, n, acc, R, Dv, _bits(pool).reshape(-1), offs, n)
    ref = acc0.astype(np.float64) + (p.double() @ pool[idx].double()).numpy()
    np.testing.assert_allclose(acc[:, :Dv], ref, rtol=1e-5, atol=1e-4)
    assert np.isnan(acc[:, Dv:]).all()


def test_amx_prefetch_arguments_change_nothing():
    """No prefetch (xn = 0) and prefetching other real rows give the same scores and sums."""
    g = torch.Generator().manual_seed(5)
    R, n, D = 4, 64, 128
    q = torch.randn(R, D, generator=g).bfloat16()
    pool = _bits(torch.randn(2 * n, D, generator=g).bfloat16()).reshape(-1)
    other = _bits(torch.randn(n, D, generator=g).bfloat16()).reshape(-1)
    offs = (np.arange(n) * D).astype(np.int64)
    outs = []
    for xbuf, xn in ((pool, 0), (other, n)):
        s = np.zeros((R, n), np.float32)
        _qk(_bits(q), pool, offs, n, s, R, D, np.float32(1.0), xbuf, offs, xn)
        acc = np.zeros((R, D), np.float32)
        _pv(_bits(torch.rand(R, n, generator=torch.Generator().manual_seed(9)).bfloat16()), pool, offs, n, acc, R,
            D, xbuf, offs, xn)
        outs.append((s, acc))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
