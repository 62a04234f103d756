"""cpu/kv_append.py, the int8 KV cache's append in one compiled pass, against its definition written as torch ops
(per token and head: scale = max |x| / 127, 1 where not positive; codes = round half to even of x / scale, clamped to
[-127, 127], NaN -> 0): bit-equal codes and scales for bf16 / fp16 / float32 states, strided and narrower value
states, rows of zeros, NaN, infinities, subnormals and exact halves; nothing written outside the positions; the
tensors it does not take left to the caller."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")
from fia.cpu import kv_append as KA

from util import gen, seed_of

pytestmark = pytest.mark.backend_independent      # a kernel of its own: run once (conftest)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
POISON = 77


def reference(x: torch.Tensor):
    """x [B, H, T, D] -> (codes int8 [B, H, T, D], scales float32 [B, H, T]) as the module doc defines them."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0                                 # (a NaN in the row: NaN)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = xf / scale.unsqueeze(-1)
    codes = torch.where(torch.isnan(q), torch.zeros_like(q), q.round().clamp(-127, 127))
    return codes.to(torch.int8), scale


def _states(g, dtype, B, H, T, D, Dv):
    k = (torch.randn(B, H, T, D, generator=g) * 3).to(dtype)
    v = (torch.randn(B, T, H, Dv, generator=g) * 0.1).to(dtype).transpose(1, 2)    # [B, H, T, Dv], strided
    k[0, 0, 0] = 0.0                                                               # all zero: scale 1
    k[0, 1 % H, T - 1, 1] = float("nan")                                           # scale 1, that code 0
    v[0, 0, T - 1, 0] = float("inf")                                               # scale inf: codes 0
    if T > 1:
        halves = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 126.5, -126.5])   # scale 1: exact halves
        k[B - 1, H - 1, 1, :8] = halves.to(dtype)
        k[B - 1, H - 1, 1, 8:] = 0.0
        v[B - 1, 0, 1] = torch.finfo(dtype).tiny / 4                               # subnormal row
    return k, v


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_append_matches_the_definition(dtype, T):
    g = gen(seed_of("kv_append", dtype, T))
    B, H, D, Dv, C, n = 2, 3, 64, 48, 16, 9
    k, v = _states(g, dtype, B, H, T, D, Dv)
    keys, values = (torch.full((B, H, C, d), POISON, dtype=torch.int8) for d in (D, Dv))
    ks, vs = (torch.full((B, H, C), float("nan")) for _ in range(2))
    assert KA.append(k, v, keys, values, ks, vs, n)
    for x, codes, scales in ((k, keys, ks), (v, values, vs)):
        rc, rs = reference(x)
        assert torch.equal(codes[:, :, n:n + T], rc)
        assert torch.equal(scales[:, :, n:n + T], rs)
        outside = torch.ones(C, dtype=torch.bool)
        outside[n:n + T] = False
        assert (codes[:, :, outside] == POISON).all() and scales[:, :, outside].isnan().all()
    assert keys[0, 0, n].eq(0).all() and ks[0, 0, n] == 1.0


def test_tensors_it_does_not_take_are_left_to_the_caller():
    g = gen(seed_of("kv_append_no"))
    B, H, T, D, C = 1, 2, 3, 32, 8
    k, v = _states(g, torch.bfloat16, B, H, T, D, D)

    def buffers():
        return (torch.full((B, H, C, D), POISON, dtype=torch.int8), torch.full((B, H, C, D), POISON, dtype=torch.int8),
                torch.ones(B, H, C), torch.ones(B, H, C))

    cases = {
        "positions past the buffers": lambda b: (k, v, *b, C - T + 1),
        "float64 states": lambda b: (k.double(), v.double(), *b, 0),
        "key and value dtypes differ": lambda b: (k, v.half(), *b, 0),
        "another head count": lambda b: (k[:, :1], v[:, :1], *b, 0),
        "another head dim": lambda b: (k[..., :16], v, *b, 0),
        "strided codes buffer": lambda b: (k, v, b[0].transpose(2, 3).contiguous().transpose(2, 3), *b[1:], 0),
        "float16 scales": lambda b: (k, v, b[0], b[1], b[2].half(), b[3], 0),
        "no tokens": lambda b: (k[:, :, :0], v[:, :, :0], *b, 0),
        "sparse states": lambda b: (k.to_sparse(), v, *b, 0),
    }
    for what, args in cases.items():
        b = buffers()
        a = args(b)
        assert KA.append(*a) is False, what
        assert (a[2] == POISON).all() and (a[3] == POISON).all(), what
