"""The prefill flash kernel's AVX2 + FMA variant (8-lane GEMMs, cpu/gemm_narrow.py) on a host with AVX-512, and its
bf16 variant for AVX-512 without AVX512-BF16 (gemm_bf16w) on a host with it.

The suite runs the kernels compiled for the host; on a CPU without AVX-512 that is already the 8-lane variant.
On an AVX-512 host (with AVX2, FMA and F16C) this module checks the variant in a child process whose Numba
targets AMD Zen 3 (no AVX-512) and whose torch uses AVX2 only: _prefill_avx2_child.py compiles the kernels
once and runs bf16 / float16 / float32 calls (causal, band, pse, user masks, fully masked rows, GQA, NaN-poisoned
padding, int8 K / V, Dv != D; default and small tiles) against the float64 reference. Elsewhere it defines
no test.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import child_env

pytest.importorskip("numba")
from fia.cpu.simd import target_has

pytestmark = pytest.mark.backend_independent      # runs its own process: once, not per backend (conftest)

ZEN3_FEATURES = ("+64bit,+adx,+aes,+avx,+avx2,+bmi,+bmi2,+clflushopt,+clwb,+clzero,+cx16,+cx8,+f16c,+fma,+fsgsbase,"
                 "+fxsr,+lzcnt,+mmx,+movbe,+mwaitx,+pclmul,+popcnt,+prfchw,+rdpid,+rdrnd,+rdseed,+sahf,+sha,+sse,"
                 "+sse2,+sse3,+sse4.1,+sse4.2,+sse4a,+ssse3,+xsave,+xsavec,+xsaveopt,+xsaves")
AVX2_ENV = dict(NUMBA_CPU_NAME="znver3", NUMBA_CPU_FEATURES=ZEN3_FEATURES, ATEN_CPU_CAPABILITY="avx2",
                DNNL_MAX_CPU_ISA="AVX2")
HERE = Path(__file__).resolve().parent

# Intel Ice Lake: AVX-512 (F, BW, VL, VNNI) without AVX512-BF16; torch without AVX512-BF16 GEMMs (oneDNN capped)
ICELAKE_ENV = dict(NUMBA_CPU_NAME="icelake-server",
                   NUMBA_CPU_FEATURES="+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni",
                   ATEN_CPU_CAPABILITY="avx512", DNNL_MAX_CPU_ISA="AVX512_CORE_VNNI")


def _child(mode: str, emulate: dict) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FIA_PREFILL_OWN", "FIA_DECODE_DP")}
    env.update(emulate)
    r = subprocess.run([sys.executable, str(HERE / "_prefill_avx2_child.py"), mode], env=child_env(env), cwd=HERE,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-8000:])
    assert r.stdout.strip().splitlines()[-1].startswith("ok "), r.stdout[-2000:]


if target_has("avx512f") and target_has("avx2", "fma", "f16c"):
    def test_avx2_variant_in_a_child_process():
        _child("avx2", AVX2_ENV)

if target_has("avx512f", "avx512bw", "avx512vl", "avx512bf16"):
    def test_avx512_without_bf16_variant_in_a_child_process():
        """bf16 on AVX-512 without AVX512-BF16 (Skylake-SP to Ice Lake): the pairs widened to float32 FMAs."""
        _child("avx512", ICELAKE_ENV)
