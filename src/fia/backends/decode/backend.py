"""The decode backend: Q_S <= 16 on the CPU, Numba kernels (the kernels package). This module is its adapter (what it
supports, prefers, describes; plan / launch); the stages live beside it: inputs.py (what the kernels read of a
call), plan.py (what follows from metadata, memoized), execute.py (launch and merge), replay.py (fia.replay's
re-launch of a kept plan).

Design:
* grouped heads: one work item owns one KV head and all its G * Q_S query rows, so every K/V row is
  read once per item and used by the whole group (no repeat of K/V, no per-head re-reads);
* split-KV: work items are (batch, KV head, key range); long sequences are cut into ranges so that
  every core gets work, and the partials are merged through their LSEs (the math of merge.py's
  merge_partials, done inside the `merge` kernel);
* KV in place: dense / packed / tensor-list / paged caches are read where they are. Key position p
  of batch b lives at element `table[b, p // bs] * stride_block + h * stride_head + (p % bs) *
  stride_slot` of the cache's storage (paged: the block table; dense: table = batch index, bs = inf);
* fused dequantization: int8 / int4 K and V are widened per row inside the loop; per-channel,
  per-tensor and per-head factors are folded into the query (key) and the epilogue (value),
  per-token factors are applied per key;
* shared prefix: a separate pass reads the prefix once for a group of batches (all of them while
  G * Q_S * batches <= PREFIX_ROWS), and its partials are merged like one more split;
* masks, pse_shift, band geometry (Q_S > 1), left padding, lengths, learnable sink, row-invalid
  correction: applied in the kernels with the reference's rules (MASK_FILL, dead rows);
* output quantization, dtype and layout: the shared epilogue (finalize.py).

Host-side work per call is small on purpose (the small-call target): a handful of int64 arrays
describe the problem, the query is read in place by the kernel (converted, scaled and dequantized per
item), and the planning (splits) is a compiled function. That plan follows from metadata only, so it
is built once per parse-memo signature (plan.plan_of); a call then only passes its buffers' addresses.

Not supported (declared in not_supported_reasons, so dispatch falls back): Q_S > 16, full int8
quantization (prefill only anyway), float64 compute, non-CPU tensors, K/V/rope/prefix whose last
dimension is not contiguous.
"""
from __future__ import annotations

import inspect
from typing import List, Optional

import torch

from ...cpu import jit
from ...problem.attention import AttentionProblem
from ..base import PRIORITY_DECODE, PRIORITY_PREFILL, Backend, BackendResult, Capabilities, kv_tensors
from ..reference import ReferenceBackend
from . import loader, plan as decode_plan
from .execute import execute
from .inputs import KINDS, Inputs, ir_covers
from .loader import numba_available
from .plan import Launch, Plan, plan_of
from .replay import Replay, prepare

MAX_Q_S = 16
PREFILL_ROWS = 128          # Q_S > 1 with more rows per KV head than this: prefer the prefill backend
_KERNEL_SETS = ("decode",)  # fia.cpu.jit: the decode kernels' entry points every call runs


def _generic_items(fn, sig) -> bool:
    """attend_items built with its generic float32 loops (its argument `generic` an array, not None)."""
    return str(sig[list(inspect.signature(fn).parameters).index("generic")]) != "none"


# the backend's kernel sets (fia.cpu.jit), their warm-up calls in fia.kernel_warmup (made through the public API)
jit.register(jit.KernelSet("decode", "fia.backends.decode.kernels",
                           ("kernel_flags", "split_work", "schedule", "replan", "fill_factors", "attend_items", "merge",
                            "attend_merge"),
                           "fia.kernel_warmup:run_decode"))
# int4 K or V, MLA rope, head dims not multiples of 16: attend_items' second build (about half the
# decode build's compile time), needed by few calls
jit.register(jit.KernelSet("decode-generic", "fia.backends.decode.kernels", ("attend_items",),
                           "fia.kernel_warmup:run_decode_generic", _generic_items))
_KERNEL_SETS_GENERIC = ("decode", "decode-generic")


class DecodeBackend(Backend):
    """Fast CPU decode: Q_S <= 16, grouped heads, split-KV, fused dequant, paged KV in place."""
    name = "decode"
    priority = PRIORITY_DECODE            # above prefill: Q_S <= 16 comes here
    capabilities = Capabilities(
        devices=("cpu",), max_q_s=MAX_Q_S, full_quant=False, compute_dtypes=(torch.float32,), strided_kv=False,
        numba="yes", why={"compute": "float32 only"},
        notes={"nz": "yes (each chunk's fragments packed into rows)",
               "prefix": "yes (not with a KV window that does not start at 0)",
               "float64": "no (float32 compute only)"})

    def not_supported_reasons(self, p: AttentionProblem) -> List[str]:
        r = super().not_supported_reasons(p)
        if not numba_available():
            r.append("numba is not installed")
        for t in kv_tensors(p) + [p.query, p.query_rope, p.pse]:
            if t is not None and t.dtype not in KINDS:
                r.append(f"dtype {t.dtype}")
                break
        if p.prefix is not None and any(g.kv_lo != 0 for g in p.geometry):
            r.append("shared prefix with a KV window not starting at 0")
        return r

    def preference(self, p: AttentionProblem) -> int:
        """Q_S > 1 with more than PREFILL_ROWS query rows per KV head: rank below the prefill backend, which
        is faster there for fp16 (measured, docs/performance.md, "Multi-token decode": at 256 rows
        decode / prefill bf16 17.6 / 35.7 ms, fp16 33.2 / 24.6; at 128 rows and below decode wins for bf16,
        fp16 and float32); it still runs when forced."""
        if p.Q_S > 1 and p.G * p.Q_S > PREFILL_ROWS:
            return PRIORITY_PREFILL - 1
        return self.priority

    def kernel_sets(self, p: AttentionProblem):
        """fia.cpu.jit: the decode set; with the generic float32 loops too where the IR kernels do not cover K / V
        (what Source.generic decides per source, here from the problem's metadata)."""
        kv = p.kv
        k, v = (kv.keys[0], kv.values[0]) if kv.kind == "list" else (kv.key, kv.value)
        rope = getattr(kv, "key_rope", None) is not None or getattr(kv, "key_ropes", None) is not None
        K = loader.kernels()
        fused = ir_covers(k.dtype, v.dtype, k.shape[-1], v.shape[-1], rope, bool(K.DP_FLAGS & K.DP_F32))
        return _KERNEL_SETS if fused else _KERNEL_SETS_GENERIC

    def describe(self, p: AttentionProblem) -> Optional[str]:
        if p.B == 0 or p.N == 0 or p.Q_S == 0 or (p.packed and p.T == 0) or (p.Dv == 0 and not p.want_lse):
            return "kernels: none (empty output)"
        if p.Dv == 0:
            return "kernels: none (empty output; the lse by the reference's formulas)"
        K = loader.kernels()
        x = Inputs(p)
        if x.exceptional:
            return "kernels: none (NaN, infinite or huge dequant factors: the reference's element-wise formulas)"
        plan = plan_of(p, x, K)
        names = []
        for launch in plan.own + [plan.prefix]:
            if launch is not None:
                name = _kernel_names(K, launch)
                if name not in names:
                    names.append(name)
        return "kernels: " + " | ".join(names)

    def plan(self, p: AttentionProblem) -> Optional[Plan]:
        """p's plan (plan.py: metadata only, memoized per parse-memo key); None where no kernel runs (an empty
        output, head dim 0)."""
        if _no_kernel(p):
            return None
        return plan_of(p, None, loader.kernels())

    def launch(self, p: AttentionProblem, plan: Optional[Plan]) -> BackendResult:
        """Run p on its plan (`plan(p)`; None: looked up, or built from p's inputs, here)."""
        if _no_kernel(p):
            return _no_kernel_result(p)
        K = loader.kernels()
        x = Inputs(p)
        if x.exceptional:
            return _reference(p)
        res = execute(p, x, plan_of(p, x, K) if plan is None else plan, K)
        return _reference(p) if res is None else res            # NaN / infinite rows: DECISIONS 52

    def run(self, p: AttentionProblem) -> BackendResult:
        """launch(p, plan(p)), with the call's inputs made once (the plan, where it is built, reads them)."""
        return self.launch(p, None)

    def replay(self, p: AttentionProblem, query, key, value, lengths: bool = False,
               extras: tuple = (), kv_axis: Optional[int] = None) -> Optional[Replay]:
        """fia.replay's prepared launch of p's call: p's plan kept and re-launched per call (replay.prepare)."""
        return prepare(p, query, key, value, lengths, extras, kv_axis)


def _kernel_names(K, launch: Launch) -> str:
    """The kernels of one launch in words (K.kernel_flags decides them; fia.explain shows this)."""
    f = int(K.kernel_flags(launch.ip))

    def one(step, dp, i8, fma, amx, eo, kind):
        if f & amx:
            return f"{step} bf16 AMX tiles (16-key blocks; the rest AVX512-BF16)"
        if f & dp:
            return f"{step} bf16 dot products (AVX512-BF16)"
        if f & i8:
            return f"{step} int16 x int8 dot products ({K.I8_DOT})"
        if f & fma:
            return f"{step} float32 FMA" + (" (bf16 in even / odd halves)" if f & eo else
                                            " on float32 rows" if launch.ip[kind] == K.KIND_F32 else "")
        if launch.ip[kind] == K.KIND_FP4:          # (the generic build: each chunk decoded, then the FMA kernel)
            return f"{step} float32 FMA" + (" (bf16 in even / odd halves)" if f & eo else "")
        return f"{step} generic float32 loops"
    parts = [one("QK", K.KF_DP_QK, K.KF_I8_QK, K.KF_FMA_QK, K.KF_AMX_QK, K.KF_EO_QK, K.IP_K_KIND),
             one("PV", K.KF_DP_PV, K.KF_I8_PV, K.KF_FMA_PV, K.KF_AMX_PV, K.KF_EO_PV, K.IP_V_KIND)]
    fp4 = int(launch.ip[K.IP_K_KIND]) == K.KIND_FP4
    ir = f & (K.KF_DP_QK | K.KF_I8_QK | K.KF_FMA_QK) or fp4        # (the generic loops never prefetch)
    if f & K.KF_PREFETCH and ir:
        how = ["nta" if f & K.KF_NTA else "t1"] + ([] if f & K.KF_PV_K else ["V rows only"])
        ahead = [n for n, b in (("K", K.KF_AHEAD_K), ("V", K.KF_AHEAD_V)) if f & b]
        if ahead:
            how.append(f"rows ahead: {', '.join(ahead)}")
        parts.append("software prefetch" + (f" ({'; '.join(how)})" if how else ""))
    elif ir and K.DP_FLAGS & K.DP_PREFETCH and not launch.ip[K.IP_DP] & K.DP_PREFETCH:
        parts.append(f"no software prefetch (at most {decode_plan.PREFETCH_MIN_BYTES >> 10} KiB of K / V: likely cached)")
    if launch.ip[K.IP_K_FS] or launch.ip[K.IP_V_FS]:
        parts.append("NZ cache: each chunk's fragments packed into rows first")
    if fp4:
        parts.append(f"FP4 K / V decoded to bf16 {K.FP4_SUB} rows at a time" if f & K.KF_DP_QK else
                     "FP4 K / V decoded to bf16 a chunk at a time")
    hb = int(launch.ip[K.IP_HB])
    if hb > 1:
        parts.append(f"{hb} KV heads per item" + (", each chunk's rows read front to back first"
                                                  if f & K.KF_TOUCH else ""))
    return ", ".join(parts)


def _no_kernel(p: AttentionProblem) -> bool:
    """No kernel runs p: an empty output (zeros, lse +inf) or head dim 0 (the reference's lse)."""
    return p.B == 0 or p.N == 0 or p.Q_S == 0 or (p.packed and p.T == 0) or p.Dv == 0


def _no_kernel_result(p: AttentionProblem) -> BackendResult:
    if p.Dv == 0 and p.want_lse and not (p.B == 0 or p.N == 0 or p.Q_S == 0 or (p.packed and p.T == 0)):
        return _reference(p)            # an empty output, but an lse (log of the keys' weights): the reference's
    out = torch.zeros(p.out_shape(), dtype=torch.float32)
    lse = torch.full(p.lse_shape(), float("inf"), dtype=torch.float32)
    return BackendResult(out, lse if p.want_lse else None)


def _reference(p: AttentionProblem) -> BackendResult:
    """The call computed with the reference's formulas: for what the kernels' folded arithmetic cannot reproduce
    (NaN / infinite / huge dequant factors applied outside the loop: their inf * 0 and overflows happen per
    element; head dim 0: the lse alone; a result with NaN or infinite rows, DECISIONS 52). Degenerate inputs
    only."""
    return ReferenceBackend().run(p)
