"""Backend protocol: capabilities as data + not_supported_reasons() + run()."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..spec.problem import AttentionProblem


@dataclass
class BackendResult:
    """Canonical results: out [B, N, Q_S, Dv] (packed [N, T, Dv]) in the compute dtype or the output dtype;
    lse [B, N, Q_S] (packed [N, T]) float32 or float64, or None when not requested."""
    out: torch.Tensor
    lse: Optional[torch.Tensor]


class Backend:
    name: str = "?"
    priority: int = 0                 # higher runs first
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

    def describe(self, p: AttentionProblem) -> Optional[str]:
        """How this backend would run p (e.g. the kernels it picks on this CPU), for fia.explain; None: no
        more to say than its name. Only called for a problem it supports."""
        return None

    def run(self, p: AttentionProblem) -> BackendResult:  # pragma: no cover - interface
        raise NotImplementedError
