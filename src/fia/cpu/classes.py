"""The CPU classes FIA's kernel choices follow, named for fia.explain and the benchmark.

The compiled kernels choose by instruction set (`simd.target_has`: the host's, or the CPU Numba was told to
target) and, for the decode prefetch policy, by vendor and AMD generation. Users run FIA on five classes of CPU:

1. AVX2 + FMA (AMD Zen 2 / 3, Intel Haswell to Comet Lake): 8-lane float32 FMA kernels;
2. AVX-512 without BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): 16-lane float32 FMA kernels;
3. AVX-512 with BF16 (AMD Zen 4 / 5, Intel Cooper Lake): bf16 dot products (`vdpbf16ps`) on AMD; on Intel, whose
   two 512-bit FMA ports outrun its `vdpbf16ps`, bf16 widened to float32 FMAs;
4. AMX (Intel Sapphire Rapids and later): bf16 dot products plus AMX tiles for decode items of many query rows;
5. aarch64 (Graviton, Kunpeng): the decode kernels' 8-lane float32 form (LLVM vector IR, lowered to NEON; not
   measured here), ATen's flash kernel for prefill.
"""
from __future__ import annotations

import platform
from typing import NamedTuple

from .simd import target_has


class CpuClass(NamedTuple):
    number: int          # 1-5 as in the module doc (0: an x86 CPU without AVX2 + FMA)
    name: str
    vendor: str          # "AMD", "Intel" or "" (not x86)

    def __str__(self) -> str:
        return f"class {self.number}: {self.name}" + (f" ({self.vendor})" if self.vendor else "")


def cpu_class() -> CpuClass:
    """This process's CPU class, as the kernels see it (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES emulate another)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return CpuClass(5, "aarch64: 8-lane float32 decode kernels, ATen's prefill", "")
    vendor = "AMD" if target_has("sse4a") else "Intel"      # (sse4a: AMD only; the decode prefetch policy)
    if target_has("amx-tile", "amx-bf16", "avx512bf16"):
        return CpuClass(4, "AMX + AVX-512 with BF16", vendor)
    if target_has("avx512f", "avx512bf16"):
        return CpuClass(3, "AVX-512 with BF16", vendor)
    if target_has("avx512f", "avx512bw"):
        return CpuClass(2, "AVX-512 without BF16", vendor)
    if target_has("avx2", "fma"):
        return CpuClass(1, "AVX2 + FMA", vendor)
    return CpuClass(0, "x86 without AVX2 + FMA: generic compiled loops", vendor)
