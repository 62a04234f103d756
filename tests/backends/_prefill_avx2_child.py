"""Child process of test_prefill_avx2.py: runs with Numba targeting another CPU class (the parent sets
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES) -- argv[1] "avx2": an AVX2 + FMA CPU (the 8-lane variant); "avx512":
AVX-512 without AVX512-BF16 (16-lane, bf16 widened: gemm_bf16w) -- so the prefill flash kernel compiles that
variant once, then checks a handful of calls against the float64 reference. Prints "ok <cases>" on success;
any failure raises."""
from __future__ import annotations

import math
import sys

import torch

import fia
from fia.backends import registry
from fia.backends.prefill import flash as prefill_flash
from fia.cpu import fma, simd
from test_backend_prefill import BF16, F16, F32, FIA, _case_kw, golden_check
from util import gen, randn, seed_of

F64 = torch.float64


def _counting():
    """Wrap prefill_flash.flash to count the own kernel's calls (a case must run on it, not ATen's)."""
    inner = prefill_flash.flash
    calls = [0]

    def flash(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    prefill_flash.flash = flash
    return calls


def _small_tiles():
    """Many key tiles and ragged items (the "small" tiles of test_backend_prefill)."""
    be = registry.by_name("prefill")
    for k, v in dict(block_q=32, band_block_q=32, pse_rows=48, pse_tile=16, pse_skip_min=0,
                     mask_chunk_elems=4096).items():
        setattr(be, k, v)
    prefill_flash.KT = 64
    prefill_flash.ROWS_PER_ITEM = 5
    prefill_flash.PARALLEL_MIN_FLOPS = 0


def _int8_kw():
    g = gen(9)
    B, N, KVN, SQ, SKV, D = 2, 8, 2, 40, 300, 64
    k = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (B, KVN, SKV, D), generator=g, dtype=torch.int8)
    ks = ((torch.rand(KVN, D, generator=g) + 0.5) / 64).to(BF16)
    vs = ((torch.rand(KVN, D, generator=g) + 0.5) / 64).to(BF16)
    return dict(query=randn((B, N, SQ, D), g, BF16), key=k, value=v, num_heads=N, num_key_value_heads=KVN,
                input_layout="BNSD", scale=0.125, key_antiquant_scale=ks, value_antiquant_scale=vs,
                key_antiquant_mode=0, value_antiquant_mode=0, actual_seq_lengths_kv=[300, 123])


def _dv_case(dtype, tol):
    """flash() directly with Dv != D (the fused API ties them): GQA, L != S, causal, outputs NaN-poisoned."""
    g = gen(5)
    q, k, v = randn((1, 8, 150, 128), g, dtype), randn((1, 2, 333, 128), g, dtype), randn((1, 2, 333, 64), g, dtype)
    out = torch.full((1, 8, 150, 64), float("nan")).to(dtype)
    lse = torch.full((1, 8, 150), float("nan"))
    prefill_flash.flash(q, k, v, True, None, 0.1, out=out, lse=lse)
    s = q.to(F64) @ k.to(F64).repeat_interleave(4, 1).transpose(-1, -2) * 0.1
    s = s.masked_fill(torch.ones(150, 333, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.softmax(s, -1) @ v.to(F64).repeat_interleave(4, 1)
    err = (out.to(F64) - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tol, (dtype, err)
    assert (lse.to(F64) - torch.logsumexp(s, -1)).abs().max().item() <= 1e-4


def main(mode: str) -> None:
    if mode == "avx2":
        assert fma.NARROW and not simd.target_has("avx512f"), "the child must compile for a CPU without AVX-512"
        assert prefill_flash.ENABLED and prefill_flash.ENABLED_F16 and prefill_flash.ENABLED_F32
        assert "AVX2" in prefill_flash.variant()
        cases = [("causal3", "s1<s2", BF16), ("band4", "ragged", F16), ("nomask", "full", F32),
                 ("pse", "s1>s2", BF16), ("band0-user", "s1<s2", F16), ("all-mask", "full", BF16),
                 ("pse-band4", "full", F16)]
    else:                                            # AVX-512 without BF16: the bf16 calls (gemm_bf16w)
        assert not fma.NARROW and simd.target_has("avx512f") and not simd.HAS_DP, "an AVX-512 CPU without BF16"
        assert prefill_flash.ENABLED and "without BF16" in prefill_flash.variant()
        cases = [("causal3", "s1<s2", BF16), ("pse", "s1>s2", BF16), ("all-mask", "full", BF16),
                 ("band4", "ragged", BF16), ("nomask", "full", BF16)]
    calls = _counting()
    done = 0

    def check(kw, dtype=None):
        nonlocal done
        before = calls[0]
        golden_check(FIA, kw, dtype=dtype)
        assert calls[0] > before, "the own kernel did not run"
        done += 1

    def run_all():
        for name, lens, dt in cases:
            kw = _case_kw(name, lens, BF16 if dt == F32 else dt, seed_of(name, lens, "avx2"),
                          D=128 if dt == F16 else 64)
            if dt == F32:
                for key in ("query", "key", "value"):
                    kw[key] = kw[key].to(F32)
                with fia.validation_mode("portable"):
                    check(kw, F32)
            else:
                check(kw)
        for n, kvn in ((16, 2), (8, 1)):
            check(_case_kw("band4", "s1<s2", BF16, seed_of(n, kvn, "avx2"), N=n, KVN=kvn))
        if mode == "avx2":
            with fia.validation_mode("portable"):    # Q_S > 16 with int8 K / V
                check(_int8_kw())                    # dequantized when packed: the float32 kernel

    run_all()
    dv = ((BF16, 1e-2), (F16, 2e-3), (F32, 2e-5)) if mode == "avx2" else ((BF16, 1e-2),)
    for dtype, tol in dv:
        _dv_case(dtype, tol)
    _small_tiles()
    run_all()
    print(f"ok {done + len(dv)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "avx2")
    sys.stdout.flush()
