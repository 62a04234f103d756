"""Context parallel on one machine: W processes x 1 thread (fia.distributed) against 1 process x W threads
(plain FIA), for a decode step over a sharded KV cache and a causal ring prefill, with the bytes each step
moves between the processes (measured by fia.distributed and from the model in docs/distributed.md).

    python -m fia.bench.distributed_bench [--world 2] [--backend torch] [--repeats 10] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

DECODE = dict(b=4, n=32, kvn=8, d=128, s=8192)
PREFILL = dict(b=1, n=8, kvn=8, d=128, s=2048)
TEMPLATE_SHAPE = (2048, 2048)


def _template() -> torch.Tensor:
    return torch.triu(torch.ones(TEMPLATE_SHAPE, dtype=torch.bool), diagonal=1)


def _median_ms(fn, repeats: int, sync=lambda: None) -> float:
    fn()                                                   # warm-up: caches, plans, first-touch memory
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _decode_inputs(world: int, rank: int):
    c = DECODE
    g = torch.Generator().manual_seed(0)
    k = torch.randn(c["b"], c["kvn"], c["s"], c["d"], generator=g).to(torch.bfloat16)   # [B, KV_N, S, D]
    v = torch.randn(c["b"], c["kvn"], c["s"], c["d"], generator=g).to(torch.bfloat16)
    q = torch.randn(c["b"], c["n"], 1, c["d"], generator=g).to(torch.bfloat16)          # [B, N, 1, D]
    lo, hi = c["s"] * rank // world, c["s"] * (rank + 1) // world
    return q, k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous()


def _prefill_inputs():
    c = PREFILL
    g = torch.Generator().manual_seed(1)
    q = torch.randn(c["b"], c["n"], c["s"], c["d"], generator=g).to(torch.bfloat16)     # [B, N, S, D]
    k = torch.randn(c["b"], c["kvn"], c["s"], c["d"], generator=g).to(torch.bfloat16)
    v = torch.randn(c["b"], c["kvn"], c["s"], c["d"], generator=g).to(torch.bfloat16)
    return q, k, v


def _kw(c: dict, **extra) -> dict:
    return dict(num_heads=c["n"], num_key_value_heads=c["kvn"], scale=c["d"] ** -0.5, input_layout="BNSD",
                softmax_lse_flag=True, **extra)


def _worker(opts: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    import fia
    from fia import distributed as fd
    from fia.distributed.launch import init

    torch.set_num_threads(1)
    rank, world = init(120.0)
    res = {}
    with fia.use_backend(opts.backend):
        q, k, v = _decode_inputs(world, rank)
        fn = lambda: fd.decode_attention(q, k, v, **_kw(DECODE))           # noqa: E731
        fn()
        fd.reset_traffic()
        res["decode_ms"] = _median_ms(fn, opts.repeats, dist.barrier)
        res["decode_bytes_in"] = fd.traffic() / (opts.repeats + 1)          # received per step by this rank
        qf, kf, vf = _prefill_inputs()
        mask = _template()
        for name, zig in (("ring", False), ("zigzag", True)):
            if zig:
                ql, kl, vl = (fd.zigzag_shard(x, rank, world, dim=2) for x in (qf, kf, vf))
            else:
                ql, kl, vl = (x.chunk(world, dim=2)[rank].contiguous() for x in (qf, kf, vf))
            pkw = _kw(PREFILL, sparse_mode=3, atten_mask=mask)
            fn = lambda: fd.ring_attention(ql, kl, vl, zigzag=zig, **pkw)     # noqa: E731,B023
            fn()
            fd.reset_traffic()
            res[f"{name}_ms"] = _median_ms(fn, max(1, opts.repeats // 3), dist.barrier)
            res[f"{name}_bytes_in"] = fd.traffic() / (max(1, opts.repeats // 3) + 1)
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        Path(out_path).write_text(json.dumps(every))
    dist.destroy_process_group()


def run(opts: argparse.Namespace) -> dict:
    import fia
    from fia.distributed.launch import run as launch

    w = opts.world
    c, p = DECODE, PREFILL
    out: dict = {"world": w, "backend": opts.backend or "auto", "decode": dict(c), "prefill": dict(p),
                 "cpu_count": os.cpu_count()}
    # 1 process x W threads: plain FIA on the whole cache / sequence
    torch.set_num_threads(w)
    with fia.use_backend(opts.backend):
        q, k, v = _decode_inputs(1, 0)
        out["single_decode_ms"] = _median_ms(lambda: fia.npu_fused_infer_attention_score(q, k, v, **_kw(c)),
                                             opts.repeats)
        qf, kf, vf = _prefill_inputs()
        out["single_prefill_ms"] = _median_ms(lambda: fia.npu_fused_infer_attention_score(
            qf, kf, vf, **_kw(p, sparse_mode=3, atten_mask=_template())), max(1, opts.repeats // 3))
    # W processes x 1 thread
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "res.json")
        launch(_worker, w, opts, path)
        ranks = json.loads(Path(path).read_text())
    for key in ("decode_ms", "ring_ms", "zigzag_ms"):
        out[f"dist_{key}"] = max(r[key] for r in ranks)                  # a step ends when its slowest rank does
    for key in ("decode_bytes_in", "ring_bytes_in", "zigzag_bytes_in"):
        out[f"dist_{key}_total"] = sum(r[key] for r in ranks)
    dv = c["d"]
    out["model_decode_bytes_fp32"] = w * c["b"] * c["n"] * (dv + 1) * 4
    out["model_decode_bytes_bf16_out"] = w * c["b"] * c["n"] * (dv * 2 + 4)
    out["kv_bytes_read_per_rank"] = 2 * c["b"] * c["kvn"] * (c["s"] // w) * c["d"] * 2
    out["model_ring_bytes_per_rank"] = 2 * p["b"] * p["kvn"] * (p["s"] // w) * p["d"] * 2 * (w - 1)
    return out


def report(r: dict) -> str:
    w = r["world"]
    lines = [
        f"machine: {r['cpu_count']} CPUs; FIA backend: {r['backend']}",
        f"decode step (B={r['decode']['b']} N={r['decode']['n']} KV_N={r['decode']['kvn']} D={r['decode']['d']} "
        f"bf16, {r['decode']['s']} keys):",
        f"  1 process x {w} threads   {r['single_decode_ms']:8.2f} ms",
        f"  {w} processes x 1 thread  {r['dist_decode_ms']:8.2f} ms",
        f"  bytes received per step, all ranks: {r['dist_decode_bytes_in_total']:.0f} (all_gather of bf16 out + "
        f"fp32 lse; model W*B*N*(Dv*2+4) = {r['model_decode_bytes_bf16_out']}, fp32 out "
        f"W*B*N*(Dv+1)*4 = {r['model_decode_bytes_fp32']}) vs KV bytes read per rank "
        f"{r['kv_bytes_read_per_rank']}",
        f"causal prefill (B={r['prefill']['b']} N={r['prefill']['n']} KV_N={r['prefill']['kvn']} "
        f"D={r['prefill']['d']} bf16, S={r['prefill']['s']}):",
        f"  1 process x {w} threads   {r['single_prefill_ms']:8.2f} ms",
        f"  {w} processes x 1 thread, ring    {r['dist_ring_ms']:8.2f} ms "
        f"({r['dist_ring_bytes_in_total']:.0f} bytes moved in all)",
        f"  {w} processes x 1 thread, zigzag  {r['dist_zigzag_ms']:8.2f} ms "
        f"({r['dist_zigzag_bytes_in_total']:.0f} bytes moved in all)",
        f"  model: K/V slice bytes per hop x (W-1) = {r['model_ring_bytes_per_rank']} per rank (full / zigzag; "
        "plain causal skips the hops no later rank needs)",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fia.bench.distributed_bench", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="torch", help="FIA backend forced in every process (default torch: no "
                   "kernel compilation during the run); 'auto' for automatic selection")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    opts = p.parse_args(argv)
    if opts.backend == "auto":
        opts.backend = None
    r = run(opts)
    print(report(r))
    if opts.json:
        Path(opts.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
