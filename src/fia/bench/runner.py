"""Checking, timing and memory of one case: FIA (automatic backend), FIA's reference backend, torch SDPA.

Order per case:
1. build the inputs (not timed);
2. FIA (automatic) once — first call, doubles as warm-up (JIT) and as the memory probe;
3. check it: the reference backend runs on KV head 0 and its G query heads (head groups are independent,
   so that output equals heads [0, G) of the full one — 1/KV_N of the work). When the full reference is
   estimated (slice time x KV_N) to fit the reference budget it runs on the whole case instead and the
   whole output is compared. If the reference cannot run a case, SDPA in float32 on the head slice is the
   judge. A mismatch => "wrong", and nothing of the case is timed;
4. SDPA once (memory probe) and the same check of SDPA (a failing peer is a bug in peers.py: "wrong");
5. time FIA, SDPA and — if within budget — the reference: warm-up, then `repeats` calls (fewer if a
   call is slow: at most `time_budget_s` per implementation, at least 1), median ms reported.

Peak memory: Linux VmHWM ("peak resident set") is reset through /proc/self/clear_refs right before the
probe call; peak = VmHWM after − VmRSS before, i.e. the extra resident memory the call needed above the
inputs (temporaries, workspace, output). glibc may serve small allocations from memory it kept from
earlier calls, so small temporaries can be undercounted; large ones (mmap'ed) are exact. Where
clear_refs is unavailable peak memory is reported as None.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import cases as C
from . import peers

TOL = {"fp16": 5e-3, "bf16": 2e-2}   # max|a - b| / max|ref|


@dataclass
class Options:
    repeats: int = 10
    time_budget_s: float = 20.0     # timed calls per implementation stop after about this long
    ref_budget_s: float = 10.0      # the reference is timed only if one full call is estimated below this
    mem_fraction: float = 0.6       # skip a case whose inputs x 3 exceed this share of available memory
    seed: int = 0

    @classmethod
    def quick(cls, repeats: Optional[int] = None) -> "Options":
        return cls(repeats=repeats or 3, time_budget_s=2.0, ref_budget_s=1.0)


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


def probe(fn: Callable[[], torch.Tensor]):
    """Run fn once: (result, seconds, peak extra resident MB or None)."""
    gc.collect()
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

def timeit(fn: Callable, repeats: int, budget_s: float, first_s: float) -> dict:
    """Warm up (the probe call counts; one more call unless it took > 1 s), then time up to `repeats` calls."""
    if first_s <= 1.0:
        t0 = time.perf_counter()
        fn()
        first_s = time.perf_counter() - t0
    n = max(1, min(repeats, int(budget_s / max(first_s, 1e-9))))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    mid = len(ts) // 2
    med = ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2
    return {"median_ms": med, "min_ms": ts[0], "repeats": n}


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

    def run() -> torch.Tensor:
        with fia.use_backend(backend):
            out, _ = fia.npu_fused_infer_attention_score(inp.q, inp.key, inp.value, **kw)
        return out                                                  # [B, N, S_q, D]
    return run


def _guard(fia, fn):
    """(output, seconds, peak MB, status): status None when the call succeeded."""
    try:
        out, dt, mb = probe(fn)
        return out, dt, mb, None
    except fia.FiaUnsupportedError as e:
        return None, None, None, "n/a: " + _reason(e)
    except Exception as e:  # a crash is reported, never ends the run
        return None, None, None, f"error: {type(e).__name__}: {_reason(e)}"


# --- one case -------------------------------------------------------------------------------------------

def case_record(case: C.Case, ceilings) -> dict:
    rec = {k: getattr(case, k) for k in ("name", "kind", "dtype", "B", "N", "KV_N", "D", "S_q", "S_kv",
                                         "storage", "mask")}
    rec.update(kv_bytes=case.kv_bytes(), flops=case.flops(), unmasked_pairs=case.unmasked_pairs())
    if case.kind == "decode":
        rec.update(metric="GB/s", ceiling=ceilings.read_gbps, ceiling_basis="read bandwidth")
    else:
        val, basis = ceilings.prefill_ceiling(case.dtype)
        rec.update(metric="TFLOP/s", ceiling=val, ceiling_basis=basis)
    return rec


def _rate(rec: dict, ms: float) -> float:
    if rec["metric"] == "GB/s":
        return rec["kv_bytes"] / (ms * 1e-3) / 1e9
    return rec["flops"] / (ms * 1e-3) / 1e12


def run_case(case: C.Case, ceilings, opts: Options, fia, phase: Callable[[str], None] = lambda s: None) -> dict:
    rec = case_record(case, ceilings)
    impls = {name: {"status": "not run"} for name in ("fia", "reference", "sdpa")}
    rec.update(impls, check={"status": "not run"}, speedup_vs_sdpa=None)
    avail = available_bytes()
    need = 3 * case.input_bytes()
    if avail is not None and need > opts.mem_fraction * avail:
        msg = f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
        for name in impls:
            rec[name] = {"status": msg}
        rec["check"] = {"status": msg}
        return rec

    phase("build")
    t0 = time.perf_counter()
    inp = C.build(case, opts.seed)
    rec["build_s"] = time.perf_counter() - t0
    G = case.G

    # 2. FIA (automatic backend), first call
    phase("fia")
    fia_fn = _fia_call(fia, inp, None)
    out, fia_first, fia_mb, st = _guard(fia, fia_fn)
    rec["fia"] = {"status": st or "ok", "peak_mb": fia_mb, "first_call_s": fia_first}

    # 3. the judge: reference on the head slice (or the whole case), else SDPA float32 on the slice
    phase("check")
    sl = inp.head_slice()
    ref_s, ref_slice_s, _, ref_st = _guard(fia, _fia_call(fia, sl, "reference"))
    judge, judge_name, ref_full = ref_s, f"reference on KV head 0 (query heads 0..{G - 1})", None
    if ref_st is None:
        est = ref_slice_s * case.KV_N
        rec["reference"] = {"status": "pending", "est_call_s": est}
        if est <= opts.ref_budget_s:
            ref_full, ref_first, ref_mb, st = _guard(fia, _fia_call(fia, inp, "reference"))
            if st is None:
                judge, judge_name = ref_full, "reference (whole case)"
                rec["reference"].update(status="ok", peak_mb=ref_mb, first_call_s=ref_first)
            else:
                rec["reference"]["status"] = st
        else:
            rec["reference"]["status"] = f"skipped: too slow (~{est:.1f} s/call est.)"
    else:
        rec["reference"] = {"status": ref_st}
        judge, _, _ = probe(peers.sdpa_call(sl, torch.float32))
        judge_name = f"SDPA float32 on KV head 0 (query heads 0..{G - 1}); reference: {ref_st}"
    whole = ref_full is not None and judge is ref_full
    pick = (lambda t: t) if whole else (lambda t: t[:, :G])
    tol = TOL[case.dtype]
    check = {"against": judge_name, "tol": tol}
    if out is not None:
        err = rel_err(pick(out), judge)
        check.update(status="ok" if err <= tol else "wrong", rel_err=err)
        if err > tol:
            rec["fia"]["status"] = "wrong"
    else:
        check["status"] = rec["fia"]["status"]
    del out

    # 4. SDPA, first call + same check
    phase("sdpa")
    sdpa_fn = peers.sdpa_call(inp)
    s_out, sdpa_first, sdpa_mb, st = _guard(fia, sdpa_fn)
    rec["sdpa"] = {"status": st or "ok", "peak_mb": sdpa_mb, "first_call_s": sdpa_first}
    if s_out is not None:
        err = rel_err(pick(s_out), judge)
        check["sdpa_rel_err"] = err
        if err > tol:
            rec["sdpa"]["status"] = "wrong"
    rec["check"] = check
    del s_out, judge, ref_s, ref_full
    gc.collect()

    # 5. timing
    plan = [("fia", fia_fn, fia_first), ("sdpa", sdpa_fn, sdpa_first)]
    if rec["reference"]["status"] == "ok":
        plan.append(("reference", _fia_call(fia, inp, "reference"), rec["reference"]["first_call_s"]))
    if check["status"] == "wrong":       # a benchmark of a wrong answer is refused
        plan = []
        for name in ("sdpa", "reference"):
            if rec[name]["status"] == "ok":
                rec[name]["status"] = "skipped: FIA output wrong"
    for name, fn, first in plan:
        if rec[name]["status"] != "ok":
            continue
        phase(f"time {name}")
        budget = opts.time_budget_s
        rec[name].update(timeit(fn, opts.repeats, budget, first))
        r = _rate(rec, rec[name]["median_ms"])
        rec[name].update(rate=r, pct_ceiling=100.0 * r / rec["ceiling"])
    if "median_ms" in rec["fia"] and "median_ms" in rec["sdpa"]:
        rec["speedup_vs_sdpa"] = rec["sdpa"]["median_ms"] / rec["fia"]["median_ms"]
    del inp, sl
    gc.collect()
    return rec


def run_all(cases: list[C.Case], ceilings, opts: Options, fia=None, progress: bool = True) -> list[dict]:
    if fia is None:
        import fia  # noqa: F811  (the package under test)
    from tqdm import tqdm
    records = []
    bar = tqdm(cases, unit="case", disable=not progress, dynamic_ncols=True)
    for case in bar:
        bar.set_description(case.name)
        rec = run_case(case, ceilings, opts, fia, phase=lambda s: bar.set_postfix_str(s, refresh=True))
        records.append(rec)
        f = rec["fia"]
        line = f"{case.name}: fia {f['status']}"
        if "median_ms" in f:
            line += f" {f['median_ms']:.2f} ms"
        if rec["speedup_vs_sdpa"]:
            line += f", x{rec['speedup_vs_sdpa']:.2f} vs SDPA"
        bar.write(line)
    return records
