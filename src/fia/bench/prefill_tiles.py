"""Timing and memory probes of the prefill backend (docs/performance.md, "Prefill").

    python -m fia.bench.prefill_tiles time --S 2048 8192 --repeats 5
    python -m fia.bench.prefill_tiles mem            # B=1, N=8, S=32768, D=128 causal, peak RSS

Cases follow fia.bench: B=1, N=32, KV_N=8, D=128, BNSD, bf16. Implementations run interleaved (one call of
each per round) so that load from other processes hits all of them alike; the report gives the minimum and
the median wall time per implementation and the ratios of those within the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _inputs(S, N=32, KV_N=8, D=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, S, D, generator=g, dtype=dtype)
    k = torch.randn(1, KV_N, S, D, generator=g, dtype=dtype)
    v = torch.randn(1, KV_N, S, D, generator=g, dtype=dtype)
    return q, k, v


def _alibi(N, S, dtype):
    dist = (torch.arange(S, dtype=torch.float32)[:, None] - torch.arange(S, dtype=torch.float32)[None]).abs_()
    out = torch.empty(1, N, S, S, dtype=dtype)
    for h in range(N):
        out[0, h] = dist * -(2.0 ** (-8.0 * (h + 1) / N))
    return out


def _fia(q, k, v, backend="prefill", **kw):
    import fia
    with fia.use_backend(backend):
        return fia.npu_fused_infer_attention_score(q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1],
                                                   input_layout="BNSD", scale=1 / math.sqrt(q.shape[-1]), **kw)[0]


def _bench(fns, repeats):
    for f in fns.values():
        f()
    wall = {n: [] for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            wall[n].append((time.perf_counter() - t0) * 1e3)
    return {n: (min(w), statistics.median(w)) for n, w in wall.items()}


def _show(title, res, pairs):
    print(title)
    for n, (mn, md) in res.items():
        print(f"  {n:28s} min {mn:9.1f} ms   median {md:9.1f} ms")
    for num, den, label in pairs:
        print(f"  {label:40s} min-ratio {res[den][0] / res[num][0]:5.2f}x  median-ratio "
              f"{res[den][1] / res[num][1]:5.2f}x")


def time_cases(sizes, repeats, which):
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    for S in sizes:
        q, k, v = _inputs(S)
        sc = 1 / math.sqrt(q.shape[-1])
        if "causal" in which or "band" in which:
            fns = {
                "prefill causal (sparse 2)": lambda: _fia(q, k, v, atten_mask=tmpl, sparse_mode=2),
                "sdpa is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sc,
                                                                         enable_gqa=True),
            }
            if "band" in which:
                fns["prefill band (sparse 4, 256/256)"] = lambda: _fia(q, k, v, atten_mask=tmpl, sparse_mode=4,
                                                                       pre_tokens=256, next_tokens=256)
            res = _bench(fns, repeats)
            pairs = [("prefill causal (sparse 2)", "sdpa is_causal", "causal vs SDPA (target >= 1.0)")]
            if "band" in which:
                pairs.append(("prefill band (sparse 4, 256/256)", "prefill causal (sparse 2)",
                              "band vs own causal (target >= 5)"))
            _show(f"S={S} bf16 B=1 N=32 KV_N=8 D=128", res, pairs)
        if "pse" in which:
            pse = _alibi(q.shape[1], S, q.dtype)
            res = _bench({
                "prefill pse": lambda: _fia(q, k, v, pse_shift=pse),
                "sdpa float mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=pse, scale=sc,
                                                                          enable_gqa=True),
            }, repeats)
            _show(f"S={S} bf16 pse (ALiBi [1, N, S, S])", res,
                  [("prefill pse", "sdpa float mask", "pse vs SDPA (target >= 1.5)")])
            del pse
        sys.stdout.flush()


def _mem_child(S, N, D):
    from fia.bench.runner import probe
    q, k, v = _inputs(S, N=N, KV_N=N, D=D)
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    _fia(q[:, :, :256], k[:, :, :256], v[:, :, :256], atten_mask=tmpl, sparse_mode=2)   # warm-up
    _, secs, mb = probe(lambda: _fia(q, k, v, atten_mask=tmpl, sparse_mode=2))
    print(json.dumps({"S": S, "N": N, "D": D, "seconds": secs, "peak_extra_mb": mb}))


def mem(S=32768, N=8, D=128):
    """Peak extra resident memory of one causal call, measured in a fresh subprocess."""
    r = subprocess.run([sys.executable, "-m", "fia.bench.prefill_tiles", "_memchild", "--S", str(S),
                        "--N", str(N), "--D", str(D)], capture_output=True, text=True, check=True)
    print(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["time", "mem", "_memchild"])
    ap.add_argument("--S", type=int, nargs="+", default=[2048])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--which", default="causal,band,pse")
    a = ap.parse_args(argv)
    if a.cmd == "time":
        time_cases(a.S, a.repeats, a.which.split(","))
    elif a.cmd == "mem":
        mem(a.S[0] if a.S != [2048] else 32768, a.N, a.D)
    else:
        _mem_child(a.S[0], a.N, a.D)


if __name__ == "__main__":
    main()
