"""Cold start (`python -m fia.bench --cold`): what a new process meets, per call family.

For each family a child process starts with an EMPTY kernel cache (its own NUMBA_CACHE_DIR) and the default tier
policy (FIA_JIT=background) and runs a decode loop (a new query every step, a pause of `gap` s between calls, as
a serving loop has) for at most `budget` s, recording every call's latency, the backend that ran it and the
result's error against the reference. Then a second child starts on the cache the first one left (a populated
cache) and times its first call and its steady calls (the warm call time).

Reported per family: import time; the first call's time and the slowest call's (targets: <= 3 s, every call);
the time from the first call until the compiled backend runs and until a call is within 1.5x the warm call time
(target <= 300 s); the populated-cache first call (target <= 1 s); the largest error of any call.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, List

FAMILIES = ("dense-bf16-gqa", "paged-int8")

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch, fia
t_import = time.perf_counter() - t0
family, budget, gap, warm = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "warm"
g = torch.Generator().manual_seed(0)
B, N, KVN, D, S = 4, 32, 8, 128, 2048
kw = dict(num_heads=N, num_key_value_heads=KVN, scale=D ** -0.5)
if family == "dense-bf16-gqa":
    k = torch.randn(B, KVN, S, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, KVN, S, D, generator=g).to(torch.bfloat16)
    kw.update(input_layout="BNSD")
    def query():
        return torch.randn(B, N, 1, D, generator=g).to(torch.bfloat16)
else:
    bs, nb = 128, B * S // 128
    k = torch.randint(-127, 128, (nb, bs, KVN * D), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (nb, bs, KVN * D), generator=g, dtype=torch.int8)
    table = torch.randperm(nb, generator=g).to(torch.int32).reshape(B, nb // B)
    kw.update(input_layout="BSH", block_table=table, block_size=bs, antiquant_mode=0,
              antiquant_scale=(torch.rand(2, KVN * D, generator=g) * 0.02 + 0.001).to(torch.float16))
    def query():
        return torch.randn(B, 1, N * D, generator=g).to(torch.float16)
f = fia.npu_fused_infer_attention_score
rows, t_start, n = [], time.perf_counter(), 0
lens = [S - 64 - i for i in range(B)]
while True:
    q = query()
    lens = [x + 1 if x < S else x for x in lens]
    args = dict(kw, actual_seq_lengths_kv=list(lens))
    t = time.perf_counter()
    out, _ = f(q, k, v, **args)
    dt = time.perf_counter() - t
    be = fia.explain(q, k, v, **args).selected
    err = None
    if n % 25 == 0 or n < 3:
        with fia.use_backend("reference"):
            ref, _ = f(q, k, v, **args)
        err = float((out.float() - ref.float()).abs().max())
    rows.append([time.perf_counter() - t_start, dt, be, err])
    n += 1
    if time.perf_counter() - t_start > budget or (warm and n >= 40):
        break
    time.sleep(gap)
print(json.dumps(dict(import_s=t_import, rows=rows)))
"""


def _run(family: str, cache: str, budget: float, gap: float, warm: bool) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, FIA_JIT="background")
    r = subprocess.run([sys.executable, "-c", _CHILD, family, str(budget), str(gap), "warm" if warm else "cold"],
                       env=env, capture_output=True, text=True, timeout=budget + 900)
    if r.returncode:
        raise RuntimeError(f"cold-start child ({family}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(family: str, budget: float = 420.0, gap: float = 0.05) -> Dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="fia-cold-") as cache:
        cold = _run(family, cache, budget, gap, warm=False)
        warm = _run(family, cache, 60.0, gap, warm=True)
    rows, wrows = cold["rows"], warm["rows"]
    warm_ms = sorted(r[1] for r in wrows[5:])[len(wrows[5:]) // 2] * 1e3
    compiled = next((r[0] for r in rows if r[2] != "torch"), None)
    within = next((r[0] for r in rows if r[1] * 1e3 <= 1.5 * warm_ms), None)
    return {
        "family": family, "import_s": cold["import_s"], "first_call_s": rows[0][1],
        "max_call_s": max(r[1] for r in rows), "calls": len(rows),
        "torch_tier_ms": _median([r[1] * 1e3 for r in rows if r[2] == "torch"]),
        "compiled_after_s": compiled, "warm_within_1_5x_after_s": within, "warm_call_ms": warm_ms,
        "populated_first_call_s": wrows[0][1], "populated_import_s": warm["import_s"],
        "max_err": max(r[3] for r in rows + wrows if r[3] is not None),
        "backends": sorted({r[2] for r in rows}),
    }


def _median(xs: List[float]):
    return sorted(xs)[len(xs) // 2] if xs else None


def lines(results: List[dict]) -> List[str]:
    out = ["| family | import s | 1st call s | slowest call s | torch tier ms | compiled after s | "
           "within 1.5x warm after s | warm call ms | populated cache: 1st call s | max err |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def f(x, fmt="{:.2f}"):
            return "-" if x is None else fmt.format(x)
        out.append(f"| {r['family']} | {f(r['import_s'], '{:.1f}')} | {f(r['first_call_s'])} | "
                   f"{f(r['max_call_s'])} | {f(r['torch_tier_ms'], '{:.1f}')} | {f(r['compiled_after_s'], '{:.0f}')} | "
                   f"{f(r['warm_within_1_5x_after_s'], '{:.0f}')} | {f(r['warm_call_ms'], '{:.1f}')} | "
                   f"{f(r['populated_first_call_s'])} | {f(r['max_err'], '{:.1e}')} |")
    return out


def main(families=FAMILIES, budget: float = 420.0) -> List[dict]:
    results = []
    for fam in families:
        print(f"cold start: {fam} (fresh process, empty kernel cache, up to {budget:.0f} s) ...", flush=True)
        results.append(measure(fam, budget))
        print(textwrap.indent(json.dumps(results[-1]), "  "), flush=True)
    print("\n".join(lines(results)))
    return results
