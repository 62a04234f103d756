"""A context-parallel decode loop: the KV cache of B sequences is sharded across the processes of a group
(rank r holds the r-th slice of every sequence; new tokens go to the last rank), every step runs
fia.distributed.decode_attention and prints its time and its difference from single-process FIA on the whole
cache.

    python -m fia.distributed.demo --world 2                       # spawns 2 gloo processes on 127.0.0.1
    torchrun --nproc-per-node 2 -m fia.distributed.demo
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:PORT -m fia.distributed.demo
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from . import decode_attention
from .launch import init, run, threads_per_process


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fia.distributed.demo", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keys", type=int, default=8192, help="cached keys per sequence before the first step")
    p.add_argument("--backend", default=None, help="force a FIA backend (torch, decode, reference); default: auto")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    return p.parse_args(argv)


def _worker(opts: argparse.Namespace) -> None:
    import fia

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(threads_per_process(local_world))
    rank, world = init(opts.timeout, opts.device)
    dev = torch.device(opts.device if opts.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    b, n, kvn, d, s, steps = opts.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.keys, opts.steps
    g = torch.Generator().manual_seed(0)
    total = s + steps
    # the whole cache, the same on every rank (seeded); rank r keeps its slice, rank 0 the whole for the reference
    k = torch.randn(b, kvn, total, d, generator=g).to(torch.bfloat16)                 # [B, KV_N, S, D]
    v = torch.randn(b, kvn, total, d, generator=g).to(torch.bfloat16)
    bounds = [s * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    last = rank == world - 1
    cap = hi - lo + (steps if last else 0)
    lk = k[:, :, lo:lo + cap].contiguous().to(dev)                                     # [B, KV_N, cap, D]
    lv = v[:, :, lo:lo + cap].contiguous().to(dev)
    if rank == 0:
        print(f"context-parallel decode: {world} processes x {torch.get_num_threads()} threads, B={b} N={n} "
              f"KV_N={kvn} D={d} bf16, {s} cached keys per sequence sharded {[hi_ - lo_ for lo_, hi_ in zip(bounds, bounds[1:])]}"
              f", backend {opts.backend or 'auto'}", flush=True)
    kw = dict(num_heads=n, num_key_value_heads=kvn, scale=d ** -0.5, input_layout="BNSD", softmax_lse_flag=True)
    times, worst = [], 0.0
    with fia.use_backend(opts.backend):
        for step in range(steps):
            q = torch.randn(b, n, 1, d, generator=g).to(torch.bfloat16).to(dev)      # [B, N, 1, D]
            local_len = hi - lo + (step + 1 if last else 0)
            dist.barrier()
            t0 = time.perf_counter()
            out, lse = decode_attention(q, lk, lv, actual_seq_lengths_kv=[local_len], **kw)
            ms = torch.tensor([(time.perf_counter() - t0) * 1e3])
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)                                # the slowest rank's time
            times.append(float(ms))
            if rank == 0:
                t1 = time.perf_counter()
                ref, ref_lse = fia.npu_fused_infer_attention_score(
                    q, k.to(dev), v.to(dev), actual_seq_lengths_kv=[s + step + 1], **kw)
                ref_ms = (time.perf_counter() - t1) * 1e3
                err = float((out.float() - ref.float()).abs().max())
                lse_err = float((lse - ref_lse).abs().max())
                worst = max(worst, err)
                print(f"step {step:2d}: keys {s + step + 1}, distributed {float(ms):7.2f} ms, single process "
                      f"({torch.get_num_threads()} threads) {ref_ms:7.2f} ms, max |out diff| {err:.3g}, "
                      f"max |lse diff| {lse_err:.3g}", flush=True)
    if rank == 0:
        print(f"median step {statistics.median(times):.2f} ms over {steps} steps; worst |out diff| {worst:.3g} "
              "(bf16 output: differences of one bf16 ulp are expected)", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    opts = parse_args(argv)
    run(_worker, opts.world, opts)


if __name__ == "__main__":
    main()
