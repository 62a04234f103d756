"""fia.replay's prepared launch of a prefill call: the full path's own launch on the stored problem.

A model's prefill repeats one call per layer (same shapes, strides, arguments; new tensors), and on a short prompt
its host path -- entry point, parse (even memoized), backend choice, plan -- costs more than the kernel. A replay
keeps the problem parsed once without its tensors and its plan, and per call views the new query / key / value as
parse does (to_canonical) and runs the backend's launch (PrefillBackend.launch: one kernel call for a whole
window, else the blocked path) and the epilogue (finalize's final_outputs): the full path's code from the launch
on, on the problem the parse memo would hand it (parse/memo.py _recall builds it the same way). So it needs no
trial run (fia.replay): that would cost one more kernel call.

Offered for calls whose only tensors are query, key and value (the template mask of sparse modes 2-4 is keyed by
its metadata; parse reads no more of it), dense K / V without dequantization, prefix, pse, rope, sinks or output
quantization, right-padded, below the size from which the full path checks the free memory first
(base.CHECK_FROM). A call the replay does not serve -- other KV lengths or KV_S than the stored call's, tensors
that require grad, changed tuning constants -- returns None: the full path runs it. Data that need the blocked
path or the reference's numbers are the launch's own business, as on the full path.
"""
from __future__ import annotations

from typing import Optional

from ..base import CHECK_FROM
from ...problem.attention import AttentionProblem, DenseKV
from ...problem.layout import to_canonical
from ...problem.outputs import final_outputs
from . import flash as prefill_flash


def _tuning(backend) -> tuple:
    """What the plan and _one_call's kernel choice read besides the problem (tests and users may change them; the
    blocked path reads its tuning when it runs)."""
    return (backend.block_q, backend.pse_skip, backend.pse_skip_min, prefill_flash.SMALL_ATEN_POSITIONS,
            prefill_flash.SMALL_ATEN_D64, prefill_flash.ENABLED, prefill_flash.ENABLED_F16, prefill_flash.ENABLED_F32)


class PrefillReplay:
    """A prefill call's replay (see the module doc): __call__ -> (out, lse) as the full path's, or None."""

    def __init__(self, backend, p: AttentionProblem, plan, lens: Optional[tuple]):
        self.backend, self.plan = backend, plan
        self.template = p.evolve(query=None, kv=None)         # (no tensors kept alive)
        self.lens = lens                    # the stored call's per-batch KV lengths (None: a growing replay without)
        self.kv_s = p.KV_S
        self.inp, self.n, self.kv_n = p.layout.inp, p.N, p.KV_N
        self.tuning = _tuning(backend)
        self.own = backend._one_call_own(p, plan)             # (the one call's kernel: metadata only)

    def stale(self) -> bool:
        return _tuning(self.backend) != self.tuning

    def __call__(self, q, k, v, lens=None, table=None, extras=(), kv_s=None, lse=True):
        if lens is not None and not self._same_lengths(lens):
            return None                                       # other lengths: another geometry (the full path)
        if (kv_s is not None and kv_s != self.kv_s) or self.stale() or q.requires_grad or k.requires_grad or \
                v.requires_grad:
            return None                                       # (the full path runs without autograd history)
        inp = self.inp
        p = self.template.evolve(query=to_canonical(q, inp, self.n),
                                 kv=DenseKV(to_canonical(k, inp, self.kv_n), to_canonical(v, inp, self.kv_n)))
        res = self.backend.launch(p, self.plan, self.own)
        return final_outputs(p, res.out, res.lse)

    def _same_lengths(self, lens) -> bool:
        """Whether the call's KV lengths list gives the stored call's per-batch lengths. Its count is the stored
        call's (fia.replay's key), which parse accepted: one value for every batch, or the first B values."""
        mine = self.lens
        if mine is None or not all(type(x) is int for x in lens):
            return False
        return (len(lens) == 1 and all(x == lens[0] for x in mine)) or tuple(lens[:len(mine)]) == mine


def prepare(backend, p: AttentionProblem, plan, lengths: bool, extras: tuple) -> Optional[PrefillReplay]:
    """The replay of p's call (plan: backend.plan(p)), or None where it is not offered (see the module doc)."""
    if extras or p.kv.kind != "dense" or p.kv.key_rope is not None or p.prefix is not None or p.pse is not None \
            or p.antiquant is not None or p.query_dequant is not None or p.full_quant is not None \
            or p.out_quant is not None or p.sink is not None or p.mask.user_mask is not None \
            or p.query_rope is not None or p.packed:
        return None
    if any(g.kv_lo != 0 for g in p.geometry) or sum(b for _, b in backend.memory_need(p)) >= CHECK_FROM:
        return None                         # (left padding: not keyed; a call that large checks free memory first)
    return PrefillReplay(backend, p, plan, tuple(g.kv_hi for g in p.geometry) if lengths else None)
