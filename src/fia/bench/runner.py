"""Checking, timing and memory of one case: FIA (automatic backend), FIA's reference backend, torch SDPA.

Order per case:
1. build the inputs (not timed);
2. the judge: the reference backend runs on KV head 0 and its G query heads (head groups are independent,
   so that output equals heads [0, G) of the full one — 1/KV_N of the work). When the whole case is
   estimated (slice time and peak memory x KV_N) to fit the reference budgets, the reference runs on the
   whole case instead and is the judge. If the reference cannot run a case, SDPA in float32 on the head
   slice is the judge;
3. FIA (automatic backend): its first call's output is checked, a second (warm) call is the memory probe
   (skipped when the first took > 5 s: then the first call is the probe), and a third when the probe compiled
   numba kernels (a process without kernel cache: the first call compiles the backend's kernels, the second
   may compile the launch of a replay it admits, fia/replay.py -- 460 MB of compiler memory reported as the small decode
   call's peak before). The check:
   max|out - judge| / max|judge| <= TOL, else "wrong" and nothing of the case is timed. (If the automatic
   choice is the reference itself and its estimated memory does not fit, the call is skipped.);
4. SDPA the same way, and the same check of SDPA (a failing peer is a bug in peers.py: "wrong");
5. time FIA and SDPA in FIA-SDPA-FIA blocks (a linear drift of the machine hits both alike), then — if
   within budget — the reference: `repeats` calls each (fewer if a call is slow: at most `time_budget_s`
   per implementation, at least 1), median ms reported.

Peak memory: right before the probe call, glibc's freed-but-kept memory is returned to the OS
(malloc_trim(0)) and Linux VmHWM ("peak resident set") is reset through /proc/self/clear_refs; peak =
VmHWM after − VmRSS before, i.e. the extra resident memory the call needed above the inputs (temporaries,
workspace, output), at page granularity. Memory touched by helper threads counts too (same process).
Where clear_refs is unavailable peak memory is reported as None.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

try:                                    # (numba is optional: the `fast` extra)
    from numba.core import event as numba_event
except ImportError:
    numba_event = None

from . import cases as C
from . import peers

_PAIRED = ("fia", "dense", "sdpa")   # timed against each other in A-B-(C-B-)A blocks (their ratios are the result)
TOL = {"fp16": 5e-3, "bf16": 2e-2, "fp32": 1e-4}   # max|a - b| / max|ref|


@dataclass
class Options:
    repeats: int = 10
    time_budget_s: float = 10.0     # timed calls per implementation stop after about this long
    ref_budget_s: float = 10.0      # the reference is timed only if one full call is estimated below this
    mem_fraction: float = 0.7       # skip a case whose inputs x 2 exceed this share of available memory
    seed: int = 0

    @classmethod
    def quick(cls, repeats: Optional[int] = None) -> "Options":
        return cls(repeats=repeats or 3, time_budget_s=1.5, ref_budget_s=1.0)


# --- memory -----------------------------------------------------------------------------------------

def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give the memory glibc keeps from freed allocations back to the OS, so the next call's
    temporaries fault in fresh pages and show up in VmHWM instead of reusing resident ones."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim(0)
        except (OSError, AttributeError):
            _libc = False
            return
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def probe(fn: Callable[[], torch.Tensor]):
    """Run fn once: (result, seconds, peak extra resident MB or None)."""
    _malloc_trim()
    base = _status_kb("VmRSS")
    ok = base is not None and _reset_peak()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM") if ok else None
    mb = None if peak is None else max(0, peak - base) / 1024
    return out, dt, mb


def available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --- timing -------------------------------------------------------------------------------------------

def timeit(fn: Callable, repeats: int, budget_s: float, warm: bool = True) -> dict:
    """Time calls until `repeats` are done or `budget_s` has passed (at least one call), after one
    warm-up call unless `warm` (the calls made before already warmed JIT caches and pages)."""
    return timeit_aba([("fn", fn)], repeats, budget_s, {"fn": warm})["fn"]


def timeit_aba(fns: list, repeats: int, budget_s: float, warm: dict) -> dict:
    """Palindromic blocks: half of each function's calls in list order, all of the last one's, then the other
    halves in reverse order (two functions: A-B-A; three: A-B-C-B-A), `repeats` calls each (fewer when
    `budget_s` per function has passed, at least one). A linear drift of the machine (clock, load) hits every
    function alike, and unlike call-by-call alternation a call rarely follows another function's (a multi-GB
    SDPA call leaves caches, TLBs and the page allocator cold for the next one; the median discards the one
    call per block that pays it). One warm-up call first for each function not `warm`.
    Returns {name: {median_ms, min_ms, repeats}}."""
    for name, fn in fns:
        if not warm[name]:
            fn()
    ts = {name: [] for name, _ in fns}

    def block(name, fn, n, budget):
        start = time.perf_counter()
        for _ in range(n):
            if ts[name] and time.perf_counter() - start >= budget:
                break
            t0 = time.perf_counter()
            fn()
            ts[name].append((time.perf_counter() - t0) * 1e3)

    outer, (last, last_fn) = fns[:-1], fns[-1]
    half = max(1, repeats // 2)
    for name, fn in outer:
        block(name, fn, half, budget_s / 2)
    block(last, last_fn, repeats, budget_s)
    if repeats > half:
        for name, fn in reversed(outer):
            block(name, fn, repeats - half, budget_s / 2)
    return {name: _stats(t) for name, t in ts.items()}


def _stats(ts: list) -> dict:
    ts = sorted(ts)
    mid = len(ts) // 2
    med = ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2
    return {"median_ms": med, "min_ms": ts[0], "repeats": len(ts)}


# --- checking -------------------------------------------------------------------------------------------

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.float(), ref.float()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _reason(e: BaseException) -> str:
    return " | ".join(s.strip() for s in str(e).splitlines() if s.strip()) or type(e).__name__


def _fia_call(fia, inp: C.Inputs, backend: Optional[str]) -> Callable[[], torch.Tensor]:
    kw = inp.fia_kwargs()
    fn = fia.npu_fused_infer_attention_score

    args, canon = inp.fia_args(), inp.canonical_out

    def run() -> torch.Tensor:
        with fia.use_backend(backend):
            if inp.extra.get("portable"):
                with fia.validation_mode("portable"):
                    out, _ = fn(*args, **kw)
            else:
                out, _ = fn(*args, **kw)
        return canon(out)                                           # [B, N, S_q, D]

    def run_auto() -> torch.Tensor:
        # the automatic choice with no backend forced anywhere: the call alone (the context manager's own cost,
        # none of it FIA's, would count in the small cases: docs/performance.md, "Kernel choices: the measurements")
        out, _ = fn(*args, **kw)
        return canon(out)
    get = getattr(fia, "get_backend", None)
    auto = backend is None and get is not None and get() is None
    return run_auto if auto and not inp.extra.get("portable") else run


def _selected_backend(fia, inp: C.Inputs) -> tuple:
    """(name of the backend the automatic choice picks for this case, how it runs it on this CPU: its kernel
    choices) via fia.explain, when available; (None, None) otherwise."""
    explain = getattr(fia, "explain", None)
    if explain is None:
        return None, None
    try:
        mode = "portable" if inp.extra.get("portable") else fia.get_validation_mode()
        with fia.use_backend(None), fia.validation_mode(mode):
            rep = explain(*inp.fia_args(), **inp.fia_kwargs())
        return rep.selected, getattr(rep, "details", None)
    except Exception:
        return None, None


def _probe_jit(fn: Callable[[], torch.Tensor]):
    """probe(fn) and whether the call compiled numba code (its time and memory are then the compiler's)."""
    if numba_event is None:
        return (*probe(fn), False)
    with numba_event.install_recorder("numba:compile") as rec:
        out, dt, mb = probe(fn)
    return out, dt, mb, bool(rec.buffer)


def _guard(fia, fn, again_below_s: float = 5.0):
    """First call (its output is the one checked); if it took < again_below_s or compiled numba kernels, a
    second, warm call is the memory probe, and a third if the second compiled (at most three calls), so
    one-time costs (JIT compilation, lazy init) do not count as the call's memory.

    Returns (output, info, status): info = {first_call_s, warm_call_s (or None), peak_mb};
    status None when the calls succeeded, else "n/a: ..." (FiaUnsupportedError) or "error: ...".
    """
    try:
        out, first, mb, jit = _probe_jit(fn)
        warm = None
        if first < again_below_s or jit:
            _, warm, mb, jit = _probe_jit(fn)
            if jit:
                _, warm, mb, _ = _probe_jit(fn)
        return out, {"first_call_s": first, "warm_call_s": warm, "peak_mb": mb}, None
    except fia.FiaUnsupportedError as e:
        return None, {}, "n/a: " + _reason(e)
    except Exception as e:  # a crash is reported, never ends the run
        return None, {}, f"error: {type(e).__name__}: {_reason(e)}"


def _call_s(info: dict) -> float:
    """Best estimate of one call's time from the probe calls."""
    return info["warm_call_s"] if info.get("warm_call_s") is not None else info["first_call_s"]


# --- one case -------------------------------------------------------------------------------------------

def case_record(case: C.Case, ceilings) -> dict:
    rec = {k: getattr(case, k) for k in ("name", "kind", "dtype", "B", "N", "KV_N", "D", "S_q", "S_kv",
                                         "storage", "layout", "mask")}
    rec.update(kv_bytes=case.kv_bytes(), flops=case.flops(), unmasked_pairs=case.unmasked_pairs())
    if case.kind == "decode":
        rec.update(metric="GB/s", ceiling=ceilings.read_gbps, ceiling_basis="read bandwidth")
    else:
        val, basis = ceilings.prefill_ceiling(case.dtype)
        rec.update(metric="TFLOP/s", ceiling=val, ceiling_basis=basis)
    return rec


def apply_ceilings(records: list, ceilings) -> None:
    """Re-derive each record's ceiling and % of ceiling from (final) ceilings."""
    for rec in records:
        if rec["kind"] == "decode":
            rec["ceiling"] = ceilings.read_gbps
        else:
            rec["ceiling"], rec["ceiling_basis"] = ceilings.prefill_ceiling(rec["dtype"])
        for name in ("fia", "reference", "sdpa", "dense"):
            if "rate" in rec.get(name, {}):
                rec[name]["pct_ceiling"] = 100.0 * rec[name]["rate"] / rec["ceiling"]


def _rate(rec: dict, ms: float, case: C.Case) -> float:
    """The case's rate at ms per call (the dense twin's: its own K / V bytes)."""
    if rec["metric"] == "GB/s":
        return case.kv_bytes() / (ms * 1e-3) / 1e9
    return case.flops() / (ms * 1e-3) / 1e12


def _skip_all(rec: dict, msg: str) -> dict:
    for name in ("fia", "reference", "sdpa", "check"):
        rec[name] = {"status": msg}
    return rec


def _judge(fia, inp: C.Inputs, sl: C.Inputs, rec: dict, opts: Options, phase) -> tuple:
    """Run the reference (slice, then whole case if affordable); returns (judge output, name, whole?)."""
    G, KV_N = inp.case.G, inp.case.KV_N
    phase("reference")
    ref_s, info, st = _guard(fia, _fia_call(fia, sl, "reference"))
    if st is not None:                     # the reference cannot run it: SDPA in float32 judges the slice
        rec["reference"] = {"status": st}
        out, _, _ = probe(peers.sdpa_call(sl, torch.float32))
        return out, f"SDPA float32 on KV head 0 (query heads 0..{G - 1}); reference: {st}", False
    mb_slice = info["peak_mb"]
    est_s, est_mb = _call_s(info) * KV_N, None if mb_slice is None else mb_slice * KV_N
    rec["reference"] = {"status": "pending", "est_call_s": est_s, "est_peak_mb": est_mb}
    avail = available_bytes()
    if est_s > opts.ref_budget_s:
        rec["reference"]["status"] = f"skipped: too slow (~{est_s:.1f} s/call est.)"
    elif est_mb is not None and avail is not None and est_mb * 2**20 > opts.mem_fraction * avail:
        rec["reference"]["status"] = f"skipped: needs ~{est_mb / 1024:.1f} GiB (est.)"
    else:
        full, info, st = _guard(fia, _fia_call(fia, inp, "reference"))
        if st is None:
            rec["reference"].update(status="ok", **info)
            return full, "reference (whole case)", True
        rec["reference"]["status"] = st
    return ref_s, f"reference on KV head 0 (query heads 0..{G - 1})", False


def _dense_twin(fia, twin: C.Case, seed: int, rec: dict) -> Optional[Callable]:
    """FIA on the case's dense twin (C.Case.dense_twin), checked against the reference on KV head 0's query
    heads like a case of its own; rec["dense"] gets its status and first / warm call. Returns the call, or
    None when it failed (the case's own timing goes on without it)."""
    inp = C.build(twin, seed)
    sl = inp.head_slice()
    judge, _, st = _guard(fia, _fia_call(fia, sl, "reference"))
    fn = _fia_call(fia, inp, None)
    out, info, st = _guard(fia, fn) if st is None else (None, {}, "reference: " + st)
    rec["dense"] = {"status": st or "ok", "case": twin.name, **info}
    if out is not None:
        err = rel_err(out[:, :twin.G], judge)
        rec["dense"]["rel_err"] = err
        if err > TOL[twin.dtype]:
            rec["dense"]["status"] = "wrong"
    return fn if rec["dense"]["status"] == "ok" else None


def run_case(case: C.Case, ceilings, opts: Options, fia, phase: Callable[[str], None] = lambda s: None,
             probe=None) -> dict:
    """One case's record. probe (machine.ReadProbe): decode cases also get `near_ceiling`, the better of
    the read bandwidths measured right before and right after their FIA-SDPA-FIA blocks, and
    `pct_near` = rate / near_ceiling (the global ceiling is measured minutes away on a drifting host)."""
    rec = case_record(case, ceilings)
    rec.update({name: {"status": "not run"} for name in ("fia", "reference", "sdpa", "check")},
               speedup_vs_sdpa=None, speedup_vs_dense=None)
    twin = case.dense_twin()
    inputs = case.input_bytes() + (twin.input_bytes() if twin else 0)
    avail, need = available_bytes(), 2 * inputs               # inputs + as much again for temporaries
    if avail is not None and need > opts.mem_fraction * avail:
        return _skip_all(rec, f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
    phase("build")
    t0 = time.perf_counter()
    inp = C.build(case, opts.seed)
    sl = inp.head_slice()
    rec["build_s"] = time.perf_counter() - t0

    # the reference first (on the slice: cheap), so its cost estimates can guard the automatic call
    judge, judge_name, whole = _judge(fia, inp, sl, rec, opts, phase)
    pick = (lambda t: t) if whole else (lambda t: t[:, :case.G])
    tol = TOL[case.dtype]
    check = rec["check"] = {"against": judge_name, "tol": tol}

    phase("fia")
    backend, kernels = _selected_backend(fia, inp)
    fia_fn = _fia_call(fia, inp, None)
    est_mb, avail = rec["reference"].get("est_peak_mb"), available_bytes()
    if (backend in (None, "reference") and est_mb is not None and avail is not None
            and est_mb * 2**20 > opts.mem_fraction * avail):
        out, info, st = None, {}, f"skipped: needs ~{est_mb / 1024:.1f} GiB (est.)"
    else:
        out, info, st = _guard(fia, fia_fn)
    rec["fia"] = {"status": st or "ok", "backend": backend, "kernels": kernels, **info}
    if out is not None:
        err = rel_err(pick(out), judge)
        check.update(status="ok" if err <= tol else "wrong", rel_err=err)
        if err > tol:
            rec["fia"]["status"] = "wrong"
    else:
        check["status"] = rec["fia"]["status"]
    del out

    phase("sdpa")
    sdpa_fn = peers.sdpa_call(inp)
    s_out, info, st = _guard(fia, sdpa_fn)
    rec["sdpa"] = {"status": st or "ok", **info}
    if s_out is not None:
        check["sdpa_rel_err"] = err = rel_err(pick(s_out), judge)
        if err > tol:                      # the peer disagrees with the reference: a bug in peers.py
            rec["sdpa"]["status"] = "wrong"
    del s_out, judge

    dense_fn, rec["dense"] = None, {"status": "not run"}
    if twin is not None and check["status"] == "ok":
        phase("dense twin")
        dense_fn = _dense_twin(fia, twin, opts.seed, rec)
    plan = [("fia", fia_fn), ("dense", dense_fn), ("sdpa", sdpa_fn), ("reference", _fia_call(fia, inp, "reference"))]
    if check["status"] == "wrong":         # a benchmark of a wrong answer is refused
        plan = []
        for name in ("sdpa", "reference"):
            if rec[name]["status"] == "ok":
                rec[name]["status"] = "skipped: FIA output wrong"
    plan = [(name, fn) for name, fn in plan if rec[name]["status"] == "ok"]
    warm = {name: rec[name]["warm_call_s"] is not None or rec[name]["first_call_s"] >= 0.5 for name, _ in plan}
    repeats = max(opts.repeats, case.min_repeats)
    # FIA - (dense twin -) SDPA - (dense twin -) FIA blocks, so a drift of the machine (clock, load, other
    # processes) hits them alike and their ratios are taken within the same minutes; the (slow) reference is
    # timed afterwards
    pair = [(n, f) for n, f in plan if n in _PAIRED]
    near = probe is not None and case.kind == "decode" and bool(pair)
    if pair:
        if near:
            phase("read bandwidth")
            bw = probe.gbps()
        phase("time " + " / ".join(n for n, _ in pair))
        for name, res in timeit_aba(pair, repeats, opts.time_budget_s, warm).items():
            rec[name].update(res)
        if near:
            rec["near_ceiling"] = max(bw, probe.gbps())
    for name, fn in plan:
        if name not in _PAIRED:
            phase(f"time {name}")
            rec[name].update(timeit(fn, repeats, opts.time_budget_s, warm[name]))
    for name, _ in plan:
        r = _rate(rec, rec[name]["median_ms"], twin if name == "dense" else case)
        rec[name].update(rate=r, pct_ceiling=100.0 * r / rec["ceiling"])
        if "near_ceiling" in rec and name in _PAIRED:
            rec[name]["pct_near"] = 100.0 * r / rec["near_ceiling"]
    if "median_ms" in rec["fia"] and "median_ms" in rec["sdpa"]:
        rec["speedup_vs_sdpa"] = rec["sdpa"]["median_ms"] / rec["fia"]["median_ms"]
    if "median_ms" in rec["fia"] and "median_ms" in rec["dense"]:
        rec["speedup_vs_dense"] = rec["dense"]["median_ms"] / rec["fia"]["median_ms"]
    del inp, sl
    # tensors go by refcount; this only clears stray cycles, and it is not free
    # (docs/performance.md, "Kernel choices: the measurements")
    if case.input_bytes() > 64 << 20:
        gc.collect()
    return rec


class _PlainProgress:
    """Stand-in for tqdm (an optional extra): iterates, prints result lines, ignores bar updates."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)

    def set_description(self, s):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    @staticmethod
    def write(line):
        print(line, flush=True)


def _progress(cases, progress: bool):
    """A tqdm bar when asked for and installed (not a dependency: a fresh install has none), else plain lines."""
    if progress:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(cases, unit="case", dynamic_ncols=True)
    return _PlainProgress(cases)


def run_all(cases: list[C.Case], ceilings, opts: Options, fia=None, progress: bool = True,
            probe=None) -> list[dict]:
    if fia is None:
        import fia  # the package under test
    records = []
    bar = _progress(cases, progress)
    for case in bar:
        bar.set_description(case.name)
        rec = run_case(case, ceilings, opts, fia, phase=lambda s: bar.set_postfix_str(s, refresh=True),
                       probe=probe)
        records.append(rec)
        f = rec["fia"]
        line = f"{case.name}: fia {f['status']}"
        if "median_ms" in f:
            line += f" {f['median_ms']:.2f} ms"
        if rec["speedup_vs_sdpa"]:
            line += f", x{rec['speedup_vs_sdpa']:.2f} vs SDPA"
        if rec["speedup_vs_dense"]:
            line += f", x{rec['speedup_vs_dense']:.2f} vs dense"
        bar.write(line)
    return records
