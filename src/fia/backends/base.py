"""Backend protocol: capabilities as data + not_supported_reasons() + plan() / launch() (run() = both)."""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import List, Optional, Tuple

import torch

from ..errors import FiaMemoryError
from ..problem.attention import AttentionProblem

# backend ranks (Backend.priority): the CPU backends above the torch backend above the reference
PRIORITY_REFERENCE, PRIORITY_TORCH, PRIORITY_PREFILL, PRIORITY_DECODE = 0, 10, 50, 60


@dataclass
class BackendResult:
    """Canonical results: out [B, N, Q_S, Dv] (packed [N, T, Dv]) in the compute dtype or the output dtype;
    lse [B, N, Q_S] (packed [N, T]) float32 or float64, or None when not requested."""
    out: torch.Tensor
    lse: Optional[torch.Tensor]


class Backend:
    name: str = "?"
    priority: int = 0                 # higher runs first (the PRIORITY_* ranks below)
    devices: tuple = ("cpu", "cuda")  # device types it runs on

    def not_supported_reasons(self, p: AttentionProblem) -> List[str]:
        """Why this backend cannot run p (empty: it can). Reads p's metadata only, never tensor data, like
        `preference`: registry.select memoizes both per AttentionProblem.memo_key."""
        reasons = []
        if p.device.type not in self.devices:
            reasons.append(f"device {p.device.type} not in {self.devices}")
        return reasons

    def preference(self, p: AttentionProblem) -> int:
        """Rank of this backend for p among those that can run it (higher wins; default: priority). A speed
        preference that depends on the problem belongs here, not in not_supported_reasons: a backend
        forced with fia.use_backend still runs every problem it supports."""
        return self.priority

    def kernel_sets(self, p: AttentionProblem) -> Tuple[str, ...]:
        """The compiled kernel sets (fia.cpu.jit.KERNEL_SETS) running p needs; () for a backend that compiles
        nothing. While they are not loaded, automatic selection runs p on the best backend whose sets are."""
        return ()

    def describe(self, p: AttentionProblem) -> Optional[str]:
        """How this backend would run p (e.g. the kernels it picks on this CPU), for fia.explain; None: no
        more to say than its name. Only called for a problem it supports."""
        return None

    def memory_need(self, p: AttentionProblem) -> List[Tuple[object, int]]:
        """(what, bytes) of the largest buffers running p allocates at once: by default the canonical output in
        float32 and the returned one (finalize converts it). A backend with larger working buffers adds them.
        `what` is a name or a function making it (named only when the call does not fit: this runs every call)."""
        out = math.prod(p.out_shape()) * 4
        return [(lambda: f"attention_out {list(p.out_shape())} float32", out), ("the returned attention_out", out)]

    # ---- plan / launch (FlashInfer's plan / run): plan decides from metadata, launch reads the data
    def plan(self, p: AttentionProblem) -> object:
        """What running p needs that follows from its metadata alone (work split, launch parameters, shapes):
        never tensor data, so it can be kept per AttentionProblem.memo_key and re-launched on another call of the
        same metadata (fia.replay does). Default None: a backend that plans nothing."""
        return None

    def launch(self, p: AttentionProblem, plan: object) -> BackendResult:
        """Run p on `plan` (this backend's plan(p), or one it made for a problem of the same metadata). A
        backend that implements run alone plans nothing: its launch is run."""
        if type(self).run is Backend.run:  # pragma: no cover - interface
            raise NotImplementedError(f"backend {self.name!r} implements neither launch nor run")
        return self.run(p)

    def run(self, p: AttentionProblem) -> BackendResult:
        """p's results: launch(p, plan(p)). A backend may fuse the two (sharing what both read of p)."""
        return self.launch(p, self.plan(p))


_CHECK_FROM = 1 << 30         # calls needing less than this never read the machine's free memory


def run_inference(backend: Backend, p: AttentionProblem) -> BackendResult:
    """backend.run(p) with no autograd history on any backend, whatever the inputs carry: these are inference
    ops (torch_npu's have no backward), so every backend returns results that do not require grad. A call whose
    buffers would not fit in the CPU's available memory fails first, naming the largest one (torch's allocator
    would fail only after seconds of paging, or the kernel would be killed)."""
    if p.device.type == "cpu":
        need = backend.memory_need(p)
        total = sum(b for _, b in need)
        if total >= _CHECK_FROM:
            avail = available_memory()
            if avail is not None and total > avail:
                what, big = max(need, key=lambda x: x[1])
                what = what() if callable(what) else what
                raise FiaMemoryError(
                    f"{backend.name} backend: this call needs {total / 2**30:.1f} GiB of working memory, more than "
                    f"the {avail / 2**30:.1f} GiB available; the largest part is {what}: {big / 2**30:.1f} GiB",
                    tensor=what, need=total, available=avail)
    with torch.no_grad():
        return backend.run(p)


def available_memory() -> Optional[int]:
    """Bytes of memory the machine can still give (Linux MemAvailable), or None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
