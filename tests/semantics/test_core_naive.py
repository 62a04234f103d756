"""Sanity checks of the naive float64 reference itself (no fia): against torch SDPA and hand-made cases."""
import math

import pytest
import torch
import torch.nn.functional as F

import naive
from util import gen, randn

pytestmark = pytest.mark.backend_independent      # no fia: run once, not per backend (conftest)


def test_naive_matches_sdpa_gqa_mask():
    g = gen(1)
    b, n, kvn, sq, skv, d = 2, 6, 3, 5, 9, 8
    q = randn((b, n, sq, d), g, torch.float64)
    k = randn((b, kvn, skv, d), g, torch.float64)
    v = randn((b, kvn, skv, d), g, torch.float64)
    mask = torch.rand(b, sq, skv, generator=g) < 0.3
    mask[:, :, 0] = False                              # no fully masked rows here
    out, lse = naive.attention(q, k, v, scale=0.3, mask=mask, sparse_mode=1)
    kk, vv = k.repeat_interleave(n // kvn, 1), v.repeat_interleave(n // kvn, 1)
    ref = F.scaled_dot_product_attention(q, kk, vv, attn_mask=~mask[:, None], scale=0.3)
    assert (out - ref).abs().max() < 1e-12
    s = 0.3 * q @ kk.transpose(-1, -2)
    s = s.masked_fill(mask[:, None], -math.inf)
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12


def test_naive_geometry():
    m = naive.band_masked(2, 4, 3, 0, 0, True)         # j > i + 2
    assert m.tolist() == [[False, False, False, True], [False, False, False, False]]
    m = naive.band_masked(4, 2, 3, 0, 0, True)         # j > i - 2: rows 0, 1 empty
    assert m.all(1).tolist() == [True, True, False, False]
    m = naive.band_masked(3, 3, 0, 0, 0, False)        # no mask: nothing
    assert not m.any()
    m = naive.band_masked(3, 3, 0, 1, 0, True)         # j > i or j < i - 1
    assert m.tolist() == [[False, True, True], [False, False, True], [True, False, False]]
    m = naive.band_masked(3, 5, 4, 0, 0, True)         # pre' = -2, next' = 2: j in [i + 2, i + 2]
    assert [r.index(False) for r in m.tolist()] == [2, 3, 4] and (~m).sum() == 3


def test_naive_special_rows():
    g = gen(2)
    q = randn((1, 1, 3, 4), g, torch.float64)
    k = randn((1, 1, 5, 4), g, torch.float64)
    v = randn((1, 1, 5, 4), g, torch.float64)
    mask = torch.zeros(1, 3, 5, dtype=torch.bool)
    mask[0, 1] = True                                   # row 1 fully user-masked
    out, lse = naive.attention(q, k, v, mask=mask, sparse_mode=1, q_windows=[(0, 2)], kv_windows=[(0, 4)])
    assert torch.allclose(out[0, 0, 1], v[0, 0, :4].mean(0))
    assert abs(lse[0, 0, 1].item() - (-1e12 + math.log(4))) < 1e-3
    assert (out[0, 0, 2] == 0).all() and math.isinf(lse[0, 0, 2].item())      # outside the query window
    out, lse = naive.attention(q, k, v, mask=mask, sparse_mode=1, inner_precise=2)
    assert (out[0, 0, 1] == 0).all() and lse[0, 0, 1].item() == math.inf
