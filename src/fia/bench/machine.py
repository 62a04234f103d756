"""This machine's ceilings, measured in-process with plain torch.

* Streaming read bandwidth: `x.sum()` over a float32 tensor far larger than the last-level cache;
  GB/s = bytes read / time. A `dst.copy_(src)` rate (bytes read + written / time) is recorded next to
  it as a cross-check (`copy_gbps`); the two agree within ~15% on a quiet machine.
* Matmul rate per dtype: `torch.mm(a, b)` on square n x n matrices, 2·n³ flop per call, n = 2048 (48 MiB
  of fp32 operands, > L3) unless the dtype is so slow that a 2048 call would take seconds (then smaller:
  on AVX2-only CPUs torch's native bf16/fp16 mm runs at ~1 GFLOP/s and is measured at n = 512).
Each figure is the best of a few repeats: a ceiling is what the machine can do, and the best run is the
least disturbed by other processes. The CLI measures before and after the cases and keeps the better.

Prefill attention ceiling of a dtype = max(native torch.mm rate of that dtype, float32 torch.mm rate):
the operator accumulates in float32 (SPEC 3), and on CPUs without bf16/fp16 dot-product instructions
(e.g. AVX2 only) torch's native bf16/fp16 mm is orders of magnitude slower than converting tiles to
float32 — the float32 rate is then the achievable ceiling. Both numbers are reported.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from ..cpu.classes import cpu_class

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool start)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _median_time(fn, repeats: int) -> float:
    """Median time of `repeats` calls after a warm-up. The bandwidth ceilings use it: on a shared VM the
    best of a few 20-ms reads picked outliers up to 1.5x the typical rate (45 vs 30 GB/s in one run), while
    the cases' own times are medians, so a ratio of the two came out low."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 9) -> float:
    """GB/s of bytes read by a float32 sum over `nbytes` (default 512 MiB, >> L3); median time."""
    x = torch.rand(nbytes // 4, dtype=torch.float32)  # [n] touched, resident, not a constant page
    t = _median_time(lambda: x.sum(), repeats)
    return x.nbytes / t / 1e9


class ReadProbe:
    """The read bandwidth right next to a case: x.sum over a buffer kept for the whole run (median of a few
    reads, ~50 ms). On a shared VM the bandwidth moves within minutes (x.sum read 84 GB/s before one run's
    cases and 50 after), so a ratio against a ceiling measured minutes away says little."""

    def __init__(self, nbytes: int = 512 << 20, repeats: int = 5):
        self.x = torch.rand(nbytes // 4, dtype=torch.float32)  # [n] touched, resident
        self.repeats = repeats

    def gbps(self) -> float:
        return self.x.nbytes / _median_time(lambda: self.x.sum(), self.repeats) / 1e9


def measure_copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 9) -> float:
    """GB/s of bytes read + written by `dst.copy_(src)` of `nbytes`; median time."""
    src = torch.rand(nbytes // 4, dtype=torch.float32)  # [n]
    dst = torch.zeros_like(src)                          # [n]
    t = _median_time(lambda: dst.copy_(src), repeats)
    return 2 * src.nbytes / t / 1e9


def measure_matmul(dtype: torch.dtype, max_call_s: float = 0.5, max_n: int = 2048, repeats: int = 3):
    """(TFLOP/s, n) of torch.mm for square n x n matrices of `dtype`.

    n starts at 512 and doubles up to max_n (2048: 48 MiB of fp32 operands, > L3) while the next size
    (8x the work) is predicted to take at most max_call_s — a slow dtype is not measured for minutes.
    """
    n = 512
    while True:
        a = torch.randn(n, n).to(dtype)  # [n, n]
        b = torch.randn(n, n).to(dtype)  # [n, n]
        torch.mm(a, b)
        t0 = time.perf_counter()
        torch.mm(a, b)
        t = time.perf_counter() - t0
        if n >= max_n or 8 * t > max_call_s:
            break
        n *= 2
    t = _best_time(lambda: torch.mm(a, b), repeats)
    return 2 * n ** 3 / t / 1e12, n


@dataclass
class Ceilings:
    read_gbps: float                      # streaming read bandwidth (x.sum), the decode ceiling
    copy_gbps: float                      # copy (read + write) bandwidth, cross-check only
    mm_tflops: dict                       # dtype name -> native torch.mm TFLOP/s
    mm_n: dict                            # dtype name -> matrix size used
    threads: int = field(default_factory=torch.get_num_threads)
    cpu: str = field(default_factory=lambda: _cpu_name())
    torch_version: str = torch.__version__
    cpu_capability: str = field(default_factory=lambda: _cpu_capability())
    cpu_class: str = field(default_factory=lambda: str(cpu_class()))     # what FIA's kernel choices follow
    # OpenMP workers that spin after each torch op take a core from the next call on small machines
    # (docs/performance.md, "Deployment"); scripts/main.sh sets PASSIVE
    omp_wait_policy: str = field(default_factory=lambda: os.environ.get("OMP_WAIT_POLICY", "unset"))
    # the last-level cache the OS reports (MB, 0 unknown): K / V below it can stay cached between calls
    llc_mb: float = field(default_factory=lambda: _llc_mb())

    def prefill_ceiling(self, dtype_name: str):
        """(TFLOP/s, basis) — the best of the dtype's native mm and fp32 mm (see module doc)."""
        native = self.mm_tflops.get(dtype_name, 0.0)
        fp32 = self.mm_tflops["fp32"]
        if native >= fp32:
            return native, f"{dtype_name} mm"
        return fp32, f"fp32 mm ({dtype_name} mm: {native:.3g})"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def best(a: "Ceilings", b: "Ceilings") -> "Ceilings":
        """Per figure, the better of two measurements (a ceiling disturbed by another process reads low)."""
        rates = {k: max(a.mm_tflops[k], b.mm_tflops[k]) for k in a.mm_tflops}
        sizes = {k: (a if a.mm_tflops[k] >= b.mm_tflops[k] else b).mm_n[k] for k in a.mm_tflops}
        return Ceilings(read_gbps=max(a.read_gbps, b.read_gbps), copy_gbps=max(a.copy_gbps, b.copy_gbps),
                        mm_tflops=rates, mm_n=sizes)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict:
    """What a benchmark without ceilings reports about the machine (the fields Ceilings shares)."""
    return {"cpu": _cpu_name(), "cpu_capability": _cpu_capability(), "cpu_class": str(cpu_class()),
            "threads": torch.get_num_threads(),
            "torch_version": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}


def _llc_mb() -> float:
    """Size of the highest cache level of CPU 0 in MB (Linux sysfs; 0 when unknown). On a VM this is the
    host's cache as the hypervisor reports it, shared with other guests."""
    best_level, size = 0, 0.0
    try:
        base = "/sys/devices/system/cpu/cpu0/cache"
        for d in os.listdir(base):
            if not d.startswith("index"):
                continue
            with open(f"{base}/{d}/level") as f:
                level = int(f.read())
            with open(f"{base}/{d}/size") as f:
                txt = f.read().strip()
            mult = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(txt[-1:], 1 / (1 << 20))
            val = float(txt.rstrip("KMG")) * mult
            if level > best_level or (level == best_level and val > size):
                best_level, size = level, val
    except (OSError, ValueError):
        return 0.0
    return size


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "unknown"


def measure_ceilings(quick: bool = False) -> Ceilings:
    """Measure bandwidth and matmul ceilings (~2 s quick, ~5 s full)."""
    nbytes = (256 if quick else 512) << 20
    reps = 3 if quick else 5
    rates, sizes = {}, {}
    for name, dt in DTYPES.items():
        rates[name], sizes[name] = measure_matmul(dt, repeats=reps)
    return Ceilings(read_gbps=measure_read_bandwidth(nbytes, reps), copy_gbps=measure_copy_bandwidth(nbytes, reps),
                    mm_tflops=rates, mm_n=sizes)


if __name__ == "__main__":  # python -m fia.bench.machine
    c = measure_ceilings(quick=bool(os.environ.get("FIA_BENCH_QUICK")))
    print(c.to_dict())
