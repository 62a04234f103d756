"""Explainable dispatch: which backend would run a call, and why each other backend cannot.

    >>> print(fia.explain(q, k, v, num_heads=8, input_layout="BNSD"))
    npu_fused_infer_attention_score: B=2 N=8 KV_N=8 Q_S=1 KV_S=128 D=64 Dv=64 float16 BNSD decode kv=dense
    backend: reference
      reference: can run (selected)

`explain` takes the arguments of `npu_fused_infer_attention_score`, or of any other entry point named by its
function as first argument or by `api=` (see `explain`), runs that entry point's parse step (so an invalid call
raises the same FiaInputError the call would) and asks every backend, computing nothing.
When no backend can run the problem, the report carries the same lines as the FiaUnsupportedError the
call raises: the error's message, then one line per backend, ``  <name>: <reason>; <reason>``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import eager, parse
from .cpu import jit
from .cpu.classes import cpu_class
from .backends import registry
from .config import get_backend
from .errors import FiaUnsupportedError

__all__ = ["explain", "explain_problem", "DispatchReport"]


@dataclass(frozen=True)
class DispatchReport:
    """The dispatch decision for one call.

    selected: the backend that would run (None: none can).  reasons: backend -> why it cannot run
    ([] for those that can), in priority order.  forced: the backend forced by fia.use_backend /
    FIA_BACKEND, if any.  error: the FiaUnsupportedError message when nothing can run.
    """
    api: str
    summary: str
    selected: Optional[str]
    reasons: Dict[str, List[str]] = field(default_factory=dict)
    forced: Optional[str] = None
    error: Optional[str] = None
    details: Optional[str] = None    # how the selected backend would run it (e.g. its kernels on this CPU)
    tier: Optional[str] = None       # the state of the compiled kernels the best backend needs (fia.cpu.jit)
    cpu: Optional[str] = None        # the CPU class the kernels' choices follow (fia.cpu.classes)

    @property
    def supported(self) -> bool:
        return self.selected is not None

    def __str__(self) -> str:
        lines = [f"{self.api}: {self.summary}" if self.summary else self.api]
        if self.selected is not None:
            lines.append(f"backend: {self.selected}" + (" (forced)" if self.forced else ""))
        else:
            lines.append("backend: none")
            if self.error:
                lines.extend(self.error.splitlines())
        shown = set()
        if self.error:     # the error already lists the backends it tried, in its own words
            shown = {ln.split(":", 1)[0].strip() for ln in self.error.splitlines()[1:]}
        for name, why in self.reasons.items():
            if name in shown:
                continue
            if not why:
                lines.append(f"  {name}: can run" + (" (selected)" if name == self.selected else ""))
                if name == self.selected and self.details:
                    lines.append(f"    {self.details}")
            else:
                lines.append(f"  {name}: " + "; ".join(why))
        if self.tier:
            lines.append(f"compiled kernels: {self.tier}")
        if self.cpu:
            lines.append(f"cpu: {self.cpu}")
        return "\n".join(lines)


def _summary(p) -> str:
    kind = "decode" if p.is_decode else "prefill"
    kv = getattr(p.kv, "kind", "?")
    parts = [f"B={p.B}", f"N={p.N}", f"KV_N={p.KV_N}", f"Q_S={p.Q_S}", f"KV_S={p.KV_S}", f"D={p.D}",
             f"Dv={p.Dv}"]
    if p.packed:
        parts.append(f"T={p.T}")
    parts += [str(p.dtype).replace("torch.", ""), p.layout.name, kind, f"kv={kv}"]
    if p.out_dtype != p.dtype:
        parts.append(f"out={str(p.out_dtype).replace('torch.', '')}")
    if p.want_lse:
        parts.append("lse")
    return " ".join(parts)


def explain_problem(problem) -> DispatchReport:
    """The report for an already parsed AttentionProblem."""
    reasons = registry.explain(problem)
    forced = get_backend()
    details = None
    tier = cpu = None
    try:
        backend = registry.select(problem)
        selected, error = backend.name, None
        best = backend if forced else registry.best(problem)
        sets = best.kernel_sets(problem)
        if sets:                                           # compiled kernels: their choices follow the CPU class
            tier = "; ".join(jit.describe(n) for n in sets)
            cpu = str(cpu_class())
            if best is not backend:
                tier += f"; running on the {backend.name} backend until then"
        if jit.ready(backend.kernel_sets(problem)):        # (describing may run kernels: only compiled ones)
            details = backend.describe(problem)
    except FiaUnsupportedError as e:
        selected, error = None, str(e)
    return DispatchReport(problem.api, _summary(problem), selected, reasons, forced, error, details, tier, cpu)


# the entry points fia.explain understands: name -> (the function whose signature binds the call, its parse step)
def _entries() -> dict:
    from . import aclnn
    return {
        "npu_fused_infer_attention_score": (eager.npu_fused_infer_attention_score, eager.fused_problem),
        "npu_incre_flash_attention": (eager.npu_incre_flash_attention, parse.parse_incre),
        "npu_prompt_flash_attention": (eager.npu_prompt_flash_attention, parse.parse_prompt),
        "npu_fused_infer_attention_score_v2": (eager.npu_fused_infer_attention_score_v2, eager.v2_problem),
        **{op: (getattr(aclnn, op + "GetWorkspaceSize"), functools.partial(aclnn.parse_call, op))
           for op in ("aclnnFusedInferAttentionScoreV2", "aclnnFusedInferAttentionScoreV4",
                      "aclnnIncreFlashAttentionV4")},
    }


def _api_name(api) -> str:
    """A function (fia's, fia.eager's, an aclnn phase-1 or phase-2 function) or a name -> the entry point's name."""
    name = api if isinstance(api, str) else getattr(api, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"explain: api must be an entry point's name or function, not {type(api).__name__}")
    if name.endswith("GetWorkspaceSize"):
        name = name[:-len("GetWorkspaceSize")]
    if name.startswith("_") and name.endswith("_get_max_workspace"):      # the workspace queries parse as the call
        name = name[1:-len("_get_max_workspace")]
    if name not in _entries():
        raise TypeError(f"explain: unknown entry point {name!r}; one of {', '.join(_entries())}")
    return name


def explain(*args, api=None, **kwargs) -> DispatchReport:
    """Which backend would run a call, and why not the others. Computes nothing. Invalid arguments raise the
    FiaInputError the call would raise.

        fia.explain(q, k, v, **kw)                                   # npu_fused_infer_attention_score's keywords
        fia.explain(fia.npu_incre_flash_attention, q, k, v, **kw)    # any entry point: its function first ...
        fia.explain(q, k, v, api="npu_fused_infer_attention_score_v2", **kw)      # ... or its name
        fia.explain(fia.aclnn.aclnnIncreFlashAttentionV4GetWorkspaceSize, q, [k], [v], None, ...)   # aclnn

    Entry points: npu_fused_infer_attention_score (default), npu_incre_flash_attention,
    npu_prompt_flash_attention, npu_fused_infer_attention_score_v2 (their .out variants and workspace queries
    parse the same), aclnnFusedInferAttentionScoreV2 / V4, aclnnIncreFlashAttentionV4 (the phase-1
    arguments; attentionOut / softmaxLse may be left out). Unknown keywords raise the call's TypeError."""
    if args and callable(args[0]) and not isinstance(args[0], torch.Tensor):
        fn_name = _api_name(args[0])
        if api is not None and _api_name(api) != fn_name:
            raise TypeError(f"explain: the function {fn_name} and api={api!r} disagree")
        api, args = fn_name, args[1:]
    name = _api_name(api if api is not None else "npu_fused_infer_attention_score")
    fn, problem_of = _entries()[name]
    sig = inspect.signature(fn)
    if name.startswith("aclnn"):
        bound = sig.bind_partial(*args, **kwargs)     # unknown keywords: the same TypeError as the call
        a = dict(bound.arguments)
        a.pop("attentionOut", None)
        a.pop("softmaxLse", None)
        missing = [p for p in sig.parameters if p not in a and p not in ("attentionOut", "softmaxLse")]
        if missing:
            raise TypeError(f"explain: {name} needs every phase-1 argument (None for nullptr); missing "
                            + ", ".join(missing))
    else:
        bound = sig.bind(*args, **kwargs)             # unknown keywords: the same TypeError as the call
        bound.apply_defaults()
        a = dict(bound.arguments)
        if "unknown" in a and sig.parameters["unknown"].kind == inspect.Parameter.VAR_KEYWORD:
            a["unknown"] = dict(a["unknown"])          # (v2 collects them: its own input error)
    try:
        problem = problem_of(a)
    except FiaUnsupportedError as e:   # valid, but a feature no backend implements (decided while parsing)
        return DispatchReport(name, "", None, dict(e.reasons), get_backend(), str(e))
    return dataclasses.replace(explain_problem(problem), api=name)    # (aclnnIncreFlashAttentionV4 parses as IFA)
