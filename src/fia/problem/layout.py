"""Layout strings <-> canonical views (SPEC 2). Views only: nothing here copies data.

Canonical forms:
* padded layouts (BSH, BSND, BNSD):   [B, N, S, D]
* packed layouts (TND, NTD):          [N, T, D]  with per-batch offsets into T
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# input form -> rank of query/key/value
_INPUT_RANK = {"BSH": 3, "BSND": 4, "BNSD": 4, "TND": 3, "NTD": 3}


@dataclass(frozen=True)
class Layout:
    name: str      # the user's string, e.g. "BNSD_BSND"
    inp: str       # BSH | BSND | BNSD | TND | NTD
    out: str       # BSH | BSND | BNSD | NBSD | TND | NTD

    @property
    def packed(self) -> bool:
        """True for the TND family: batches are concatenated along T."""
        return self.inp in ("TND", "NTD")

    @property
    def rank(self) -> int:
        return _INPUT_RANK[self.inp]

    @property
    def lse_packed(self) -> bool:
        return self.packed


LAYOUTS = {
    "BSH": Layout("BSH", "BSH", "BSH"),
    "BSND": Layout("BSND", "BSND", "BSND"),
    "BNSD": Layout("BNSD", "BNSD", "BNSD"),
    "BNSD_BSND": Layout("BNSD_BSND", "BNSD", "BSND"),
    "BSH_NBSD": Layout("BSH_NBSD", "BSH", "NBSD"),
    "BSND_NBSD": Layout("BSND_NBSD", "BSND", "NBSD"),
    "BNSD_NBSD": Layout("BNSD_NBSD", "BNSD", "NBSD"),
    "TND": Layout("TND", "TND", "TND"),
    "TND_NTD": Layout("TND_NTD", "TND", "NTD"),
    "NTD_TND": Layout("NTD_TND", "NTD", "TND"),
    # torch_npu's MLA layouts (its v2 document's MLA section; op-plugin's layout table)
    "NTD": Layout("NTD", "NTD", "NTD"),
    "BSH_BNSD": Layout("BSH_BNSD", "BSH", "BNSD"),
    "BSND_BNSD": Layout("BSND_BNSD", "BSND", "BNSD"),
}


def seq_dim(inp: str) -> int:
    return {"BSH": 1, "BSND": 1, "BNSD": 2, "TND": 0, "NTD": 1}[inp]


def heads_dim(inp: str) -> int | None:
    """Index of the head axis (None for BSH where heads are folded into H)."""
    return {"BSH": None, "BSND": 2, "BNSD": 1, "TND": 1, "NTD": 0}[inp]


def to_canonical(x: torch.Tensor, inp: str, n: int) -> torch.Tensor:
    """View an input tensor in canonical form: [B, N, S, D] (padded) or [N, T, D] (packed)."""
    if inp == "BSH":
        return x.unflatten(2, (n, x.shape[2] // n)).permute(0, 2, 1, 3)
    if inp == "BSND":
        return x.permute(0, 2, 1, 3)
    if inp == "BNSD":
        return x
    if inp == "TND":
        return x.permute(1, 0, 2)
    if inp == "NTD":
        return x
    raise AssertionError(inp)


def from_canonical(x: torch.Tensor, out: str) -> torch.Tensor:
    """Canonical output ([B, N, S, D] or [N, T, D]) -> the output layout, contiguous."""
    if out == "BSH":
        b, n, s, d = x.shape
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    if out == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if out == "BNSD":
        return x.contiguous()
    if out == "NBSD":
        return x.permute(1, 0, 2, 3).contiguous()
    if out == "TND":
        return x.permute(1, 0, 2).contiguous()
    if out == "NTD":
        return x.contiguous()
    raise AssertionError(out)


def output_shape(out: str, b: int, n: int, s: int, dv: int, t: int) -> tuple:
    """Shape of the user-visible output tensor."""
    return {
        "BSH": (b, s, n * dv), "BSND": (b, s, n, dv), "BNSD": (b, n, s, dv), "NBSD": (n, b, s, dv),
        "TND": (t, n, dv), "NTD": (n, t, dv),
    }[out]
