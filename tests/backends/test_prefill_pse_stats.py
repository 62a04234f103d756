"""The one-pass bias statistics of the pse tile bounds (prefill.pse.bias_stats): the Numba pass equals the
torch formulation on random biases, including ties, -inf, NaN rows and a partial last tile."""
from __future__ import annotations

import pytest
import torch

from fia.backends.prefill import pse as prefill_pse

from util import gen

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s2,tile", [(300, 128), (256, 128), (97, 32), (5, 8)])
def test_numba_stats_equal_torch(dtype, s2, tile):
    pytest.importorskip("numba")
    g = gen(s2 * 7 + tile)
    full = (torch.randn(2, 3, 11, s2 + 3, generator=g) * 4).round().to(dtype)   # rounding makes ties
    pse = full[1, :, 2:9, 1:s2 + 1]                                              # strided view [N, r, S2]
    pse[0, 0, :] = -float("inf")
    pse[1, 2, s2 // 2] = float("nan")
    pse[2, 3, -1] = float("inf")
    pm_t, j_t, p_t = prefill_pse._bias_stats_torch(pse, tile)
    pm_n, j_n, p_n = prefill_pse._bias_stats_numba(pse, tile)
    nan_row = torch.isnan(p_t)
    assert torch.equal(nan_row, torch.isnan(p_n))
    ok = ~nan_row
    assert torch.equal(p_n[ok], p_t[ok])
    assert torch.equal(pm_n[ok], pm_t[ok])
    # jstar: a first position of the row maximum (-0 and +0 are equal values; either is a valid j*)
    at = torch.gather(pse, 2, j_n.unsqueeze(-1)).squeeze(-1).float()
    assert torch.equal(at[ok], p_t[ok])
    first = (pse.float() == p_t.unsqueeze(-1)).int().argmax(-1)
    assert (j_n[ok] >= first[ok]).all()


def test_float32_bias_uses_the_torch_formulation():
    pse = torch.randn(2, 3, 40, generator=gen(5))
    for a, b in zip(prefill_pse.bias_stats(pse, 16), prefill_pse._bias_stats_torch(pse, 16)):
        assert torch.equal(a, b)
