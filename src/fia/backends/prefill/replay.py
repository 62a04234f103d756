"""fia.replay's prepared launch of a prefill call: the full path's own launch on the stored problem.

A model's prefill repeats one call per layer (same shapes, strides, arguments; new tensors), and on a short prompt
its host path -- entry point, parse (even memoized), backend choice, plan -- costs more than the kernel. A replay
keeps the problem parsed once without its tensors and, per call, views the new query / key / value as parse does
(to_canonical) and runs the backend's one-kernel-call launch (PrefillBackend._one_call, through replayed_call)
and the epilogue (finalize's final_outputs): the full path's code from the launch on, on the problem the parse
memo would hand it (parse/memo.py _recall builds it the same way). So it needs no trial run (fia.replay): that
would cost one more kernel call.

Offered for calls one kernel call covers (PrefillPlan.one_call): dense K / V, nothing but query, key and value as
tensors (the template mask of sparse modes 2-4 is keyed by its metadata; parse reads no more of it), below the size
from which the full path checks the free memory first (base.CHECK_FROM). A call the replay does not serve -- other
KV lengths or KV_S than the stored call's, tensors that require grad, a score beyond float32's range on ATen's
kernel, changed tuning constants -- returns None: the full path runs it (data that need the general path or the
reference's numbers are _one_call's own business, as on the full path).
"""
from __future__ import annotations

from typing import Optional

from ..base import CHECK_FROM
from ...problem.attention import AttentionProblem, DenseKV
from ...problem.layout import to_canonical
from ...problem.outputs import final_outputs
from . import flash as prefill_flash


def _tuning(backend) -> tuple:
    """What _one_call's choices read besides the problem (tests and users may change them)."""
    return (backend.block_q, backend.pse_skip, backend.pse_skip_min, prefill_flash.SMALL_ATEN_POSITIONS,
            prefill_flash.ENABLED, prefill_flash.ENABLED_F16, prefill_flash.ENABLED_F32)


class PrefillReplay:
    """A prefill call's replay (see the module doc): __call__ -> (out, lse) as the full path's, or None."""

    trial = False               # fia.replay.admit: the full path's own launch, no trial run

    def __init__(self, backend, p: AttentionProblem, kind: int, kd, lens: Optional[tuple]):
        self.backend, self.kind, self.kd = backend, kind, kd
        self.template = p.evolve(query=None, kv=None)         # (no tensors kept alive)
        self.lens = lens                    # the stored call's KV length (B = 1; None: a growing replay without lengths)
        self.kv_s = p.KV_S
        self.inp, self.n, self.kv_n = p.layout.inp, p.N, p.KV_N
        self.tuning = _tuning(backend)
        self.own = backend._one_call_own(p, kd)              # (the kernel choice: metadata only)

    def stale(self) -> bool:
        return _tuning(self.backend) != self.tuning

    def __call__(self, q, k, v, lens=None, table=None, extras=(), kv_s=None, lse=True):
        if lens is not None and (self.lens is None or len(lens) != 1 or type(lens[0]) is not int
                                 or lens[0] != self.lens[0]):
            return None                                       # other lengths: another geometry (the full path)
        if (kv_s is not None and kv_s != self.kv_s) or self.stale() or q.requires_grad or k.requires_grad or \
                v.requires_grad:
            return None                                       # (the full path runs without autograd history)
        inp = self.inp
        p = self.template.evolve(query=to_canonical(q, inp, self.n),
                                 kv=DenseKV(to_canonical(k, inp, self.kv_n), to_canonical(v, inp, self.kv_n)))
        res = self.backend.replayed_call(p, self.kind, self.kd, self.own)
        return None if res is None else final_outputs(p, res.out, res.lse)


def prepare(backend, p: AttentionProblem, plan, lengths: bool, extras: tuple) -> Optional[PrefillReplay]:
    """The replay of p's call (plan: backend.plan(p)), or None where it is not offered (see the module doc)."""
    if plan.one_call is None or extras or p.kv.kind != "dense" or p.kv.key_rope is not None or p.prefix is not None \
            or p.pse is not None or p.antiquant is not None or p.query_dequant is not None or p.full_quant is not None:
        return None
    g = p.geometry[0]                                     # (one_call: B = 1)
    if g.kv_lo != 0 or sum(b for _, b in backend.memory_need(p)) >= CHECK_FROM:
        return None                                       # (a call that large checks the free memory first)
    return PrefillReplay(backend, p, plan.one_call, plan.kernel_dtype, (g.kv_hi,) if lengths else None)
