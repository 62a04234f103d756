"""Warm-up: compile every kernel set this CPU uses into the on-disk cache, ahead of the first call.

    python -m fia warmup          # progress per set, then a summary
    fia.warmup()                  # the same from Python; returns {set: seconds}  (this module's `warmup`)

Use it where processes start on a fresh cache: CI images, containers, a new virtualenv (the build then lives in
the image; `NUMBA_CACHE_DIR` moves it). Without it the first calls of a process run on the torch backend while a
background process compiles (fia.cpu.jit).

Each `run_<set>` makes small representative calls of one backend, forced and compiling synchronously, so that
every specialization its calls use gets compiled: the kernels take everything else (dtypes, layouts, modes) as
runtime parameters.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from .api import npu_fused_infer_attention_score as _fia
from .config import use_backend, validation_mode


def _kernel_flags() -> None:
    """kernels.kernel_flags as fia.explain calls it (explain names the kernels only once the set is built, so its
    call above does not compile it in the build itself)."""
    import numpy as np
    from .backends.decode import kernels as K
    K.kernel_flags(np.zeros(K.IP_LEN, np.int64))


def _decode_calls(generic: bool = False) -> List[Callable[[], object]]:
    from .dispatch_report import explain
    g = torch.Generator().manual_seed(0)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    B, N, KVN, D = 2, 8, 2, 128
    q, k, v = rn(B, N, 1, D), rn(B, KVN, 2048, D), rn(B, KVN, 2048, D)
    dense = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=D ** -0.5)
    k8, v8 = (torch.randint(-100, 100, (B, KVN, 256, D), generator=g, dtype=torch.int8) for _ in range(2))
    chan = dict(dense, antiquant_scale=rn(2, KVN, 1, D, dtype=torch.float16).abs() * 0.01, antiquant_mode=0)
    qf = q.to(torch.float16)
    bs, nb = 128, 8
    kc, vc = rn(nb, bs, KVN * D), rn(nb, bs, KVN * D)                         # paged [NB, bs, H]
    table = torch.arange(nb, dtype=torch.int32).reshape(B, nb // B)
    paged = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BSH", block_table=table, block_size=bs)
    qp = q.reshape(B, 1, N * D)
    tok = dict(dense, key_antiquant_scale=rn(B, 256, dtype=torch.float32).abs() * 0.01,
               value_antiquant_scale=rn(B, 256, dtype=torch.float32).abs() * 0.01, key_antiquant_mode=1,
               value_antiquant_mode=1)
    f = _fia
    calls = []
    for _ in range(3):                                                        # full path, then the replay launch
        calls.append(lambda: f(q, k, v, **dense))
    for n in (700, 701, 702):                                                 # a decode loop: the lengths replay
        calls.append(lambda n=n: f(q, k, v, actual_seq_lengths_kv=[n, 2 * n], **dense))
    calls.append(lambda: explain(q, k, v, **dense))
    calls.append(_kernel_flags)                                               # the kernel names (fia.explain)
    calls.append(lambda: f(qf, k8, v8, **chan))                               # int8 factors
    calls.append(lambda: f(qf, k8, v8, **tok))                                # per-token factors
    for n in (300, 301, 302):
        calls.append(lambda n=n: f(qp, kc, vc, actual_seq_lengths_kv=[n, n + 200], **paged))
    calls.append(lambda: f(q, k[:, :, :256], v[:, :, :256], key_shared_prefix=k[:1, :, :64],  # shared prefix
                           value_shared_prefix=v[:1, :, :64], actual_shared_prefix_len=[64], **dense))
    if generic:                                                               # the generic loops' build
        calls = [lambda: f(q[..., :72].contiguous(), k[:, :, :64, :72].contiguous(),    # D = 72
                           v[:, :, :64, :72].contiguous(), **dict(dense, scale=0.1))]
    return calls


def run_decode(generic: bool = False) -> None:
    """Compile the decode backend's kernels (dense, lengths and paged replays, int8 factors, shared prefix)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))                 # splits and their merge need two threads
    try:
        with use_backend("decode"), validation_mode("portable"):
            for c in _decode_calls(generic):
                c()
    finally:
        torch.set_num_threads(before)


def run_decode_generic() -> None:
    """Compile the decode kernels' generic float32 loops (int4 K or V, MLA rope, head dims not multiples of 16;
    float32 K / V with FIA_DECODE_F32=0)."""
    run_decode(generic=True)


def _prefill_calls(dtypes, pse: bool) -> List[Callable[[], object]]:
    g = torch.Generator().manual_seed(1)
    calls = []
    for dt in dtypes:
        q, k = (torch.randn(1, 4, 256, 128, generator=g).to(dt) for _ in range(2))
        v = torch.randn(1, 4, 256, 128, generator=g).to(dt)
        kw = dict(num_heads=4, input_layout="BNSD", scale=0.088)
        if pse:
            kw["pse_shift"] = torch.randn(1, 4, 256, 256, generator=g).to(dt)
        else:
            kw.update(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
        calls.append(lambda q=q, k=k, v=v, kw=kw: _fia(q, k, v, **kw))
    return calls


def run_prefill() -> None:
    """Compile FIA's own prefill flash kernel for the dtypes it serves on this CPU."""
    from .backends.prefill import flash as prefill_flash
    dts = [dt for dt, on in prefill_flash.ENABLED_FOR.items() if on()]
    with use_backend("prefill"), validation_mode("portable"):
        for c in _prefill_calls(dts, pse=False):
            c()


def run_prefill_pse() -> None:
    """Compile the position-bias statistics pass of the prefill backend (which large windows use: the
    threshold is lowered for the small warm-up call)."""
    from .backends import registry
    be = registry.by_name("prefill")
    before = be.pse_skip_min
    be.pse_skip_min = 0
    try:
        with use_backend("prefill"):
            for c in _prefill_calls([torch.bfloat16], pse=True):
                c()
    finally:
        be.pse_skip_min = before


def run_kv_int8() -> None:
    """Compile the int8 KV cache's append (cpu/kv_append.py: one specialization, ints only)."""
    from .cpu import kv_append
    g = torch.Generator().manual_seed(2)
    B, H, T, C, D = 1, 2, 3, 8, 32
    codes, scales = torch.zeros(B, H, C, D, dtype=torch.int8), torch.ones(B, H, C)
    for dt in kv_append.KINDS:
        x = torch.randn(B, H, T, D, generator=g).to(dt)
        kv_append.launch(x, x, codes, codes, scales, scales, 0)


def sets_for_this_cpu() -> List[str]:
    """The kernel sets the CPU's backends use (the own prefill kernel only where the CPU runs it)."""
    from .cpu import jit
    try:
        import numba  # noqa: F401
        from .backends.prefill import flash as prefill_flash
        from .cpu import kv_append  # noqa: F401                 (its set: the int8 FiaCache's append)
    except Exception:                                     # no numba: the torch and reference backends only
        return []
    own = any(on() for on in prefill_flash.ENABLED_FOR.values())
    return [n for n in jit.KERNEL_SETS if n != "prefill" or own]


def warmup(sets: Optional[List[str]] = None, *, progress: bool = True) -> Dict[str, float]:
    """Compile (or load) every kernel set this CPU uses; {set: seconds}. Prints progress to stderr."""
    from .cpu import jit
    done: Dict[str, float] = {}
    names = sets_for_this_cpu() if sets is None else list(sets)
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        cached = jit.load(jit.KERNEL_SETS[name])
        if progress:
            print(f"[{i}/{len(names)}] {name} kernels: " + ("in the cache" if cached else "compiling..."),
                  file=sys.stderr, flush=True)
        if not cached:
            code = jit.build(name)
            if code:
                raise RuntimeError(f"fia.warmup: the {name} kernels did not all compile (status {code})")
        done[name] = time.perf_counter() - t0
        if progress:
            how = "found in the cache" if cached else "compiled"
            print(f"      {name}: {how} in {done[name]:.1f} s", file=sys.stderr,
                  flush=True)
    return done
