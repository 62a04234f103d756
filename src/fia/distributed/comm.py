"""The collectives of fia.distributed on torch.distributed: the call-signature agreement, all_gather of the
partial results, and the ring's point-to-point shift. Every failure of a collective (a rank that raised, died,
made another call, or a process-group timeout) becomes one FiaRuntimeError naming the operation.

Nothing here is device specific: small control tensors live on the CPU for gloo and on the data's device for
other backends (NCCL needs CUDA tensors).
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import FiaInputError, FiaRuntimeError, input_error

__all__ = ["Group", "agree", "all_gather", "all_gather_ints", "RingShift", "traffic", "reset_traffic"]

# bytes this process received through fia.distributed's data collectives (benchmark and docs)
_TRAFFIC = {"bytes": 0}


def traffic() -> int:
    """Bytes of partial results / K/V slices this process received since the last reset_traffic()."""
    return _TRAFFIC["bytes"]


def reset_traffic() -> None:
    _TRAFFIC["bytes"] = 0


def _failed(op: str, what: str, err: BaseException) -> FiaRuntimeError:
    return FiaRuntimeError(
        f"{op}: {what} across the process group failed ({type(err).__name__}: {err}); a rank of the group raised "
        f"before or during this call, died, or made a different call (every rank must call {op} together; "
        "init_process_group(timeout=...) bounds how long a rank waits)")


class Group:
    """The process group of one call: its size, this process's rank in it, and where control tensors live."""

    def __init__(self, op: str, group: Optional[dist.ProcessGroup], like: torch.Tensor):
        if not dist.is_available() or not dist.is_initialized():
            raise input_error("group", "an initialized torch.distributed process group "
                              "(torch.distributed.init_process_group before the call)", "no process group", op)
        self.op = op
        self.group = group
        try:
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            backend = str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError) as e:
            raise input_error("group", "a process group this process belongs to", f"{group!r} ({e})")
        if self.rank < 0:
            raise input_error("group", "a process group this process belongs to", f"{group!r} (rank -1)")
        # gloo moves CPU tensors; NCCL and the others move tensors of the data's device
        self.device = torch.device("cpu") if backend == "gloo" or like.is_meta else like.device

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)


def _digest(signature: Dict[str, object]) -> int:
    """A stable 63-bit digest of the signature (Python's hash() differs between processes)."""
    text = repr(sorted((k, repr(v)) for k, v in signature.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def agree(g: Group, signature: Dict[str, object], error: Optional[BaseException] = None) -> None:
    """Every rank calls this with its call's signature and the exception its local part raised (or None).
    Returns when all signatures match and no rank failed; otherwise raises on every rank: the failing rank its
    own exception, the others a FiaRuntimeError naming that rank's error, or, for differing calls, a
    FiaInputError naming the first differing argument with every rank's value."""
    mine = torch.tensor([_digest(signature), 0 if error is None else 1], dtype=torch.int64, device=g.device)
    try:
        every = torch.stack(_gather(g, mine))                                              # [W, 2]
    except Exception as e:                                          # gloo / NCCL raise several classes
        if error is not None:
            raise error
        raise _failed(g.op, "the call-signature exchange", e)
    if bool((every[:, 0] == every[0, 0]).all()) and not bool(every[:, 1].any()):
        return
    # the slow path: every rank takes it (they all saw the same gathered tensor), so none is left waiting
    infos: List[object] = [None] * g.size
    note = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(infos, (signature, note), group=g.group)
    except Exception as e:
        if error is not None:
            raise error
        raise _failed(g.op, "the exchange of error details", e)
    if error is not None:
        raise error
    for r, (_, msg) in enumerate(infos):
        if msg is not None:
            raise FiaRuntimeError(f"{g.op}: rank {r} of the group failed: {msg}")
    sigs = [s for s, _ in infos]
    names = list(sigs[0]) + sorted(set().union(*[s.keys() for s in sigs]) - set(sigs[0]))
    for key in names:                            # in call order: query, key, value, then the keywords
        vals = [s.get(key, "<absent>") for s in sigs]
        if any(v != vals[0] for v in vals):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
            raise FiaInputError(f"{key}: expected the same value on every rank of the group in {g.op}, got "
                                f"{shown}", argument=key)
    raise FiaInputError(f"{g.op}: expected the same call on every rank of the group, got differing signatures",
                        argument=None)


def _gather(g: Group, t: torch.Tensor) -> List[torch.Tensor]:
    """dist.all_gather into fresh buffers (the list form: every backend has it)."""
    parts = [torch.empty_like(t) for _ in range(g.size)]
    dist.all_gather(parts, t, group=g.group)
    return parts


def all_gather(g: Group, t: torch.Tensor, what: str) -> List[torch.Tensor]:
    """The same-shaped tensor of every rank, in rank order (on t's device)."""
    src = t.contiguous().to(g.device)
    try:
        parts = _gather(g, src)                                                           # W x t.shape
    except Exception as e:
        raise _failed(g.op, f"all_gather of {what}", e)
    _TRAFFIC["bytes"] += (g.size - 1) * src.numel() * src.element_size()
    return [x.to(t.device) for x in parts]


def all_gather_ints(g: Group, values: Sequence[int], what: str) -> List[List[int]]:
    """A same-length list of ints from every rank, in rank order (metadata, not counted as traffic)."""
    t = torch.tensor(list(values), dtype=torch.int64, device=g.device)
    try:
        return [x.tolist() for x in _gather(g, t)]
    except Exception as e:
        raise _failed(g.op, f"all_gather of {what}", e)


class RingShift:
    """One step of the ring: send tensors to rank + 1 and receive same-role tensors from rank - 1, posted at
    once (isend / irecv) so the caller computes while they travel; wait() returns the received tensors."""

    def __init__(self, g: Group, send: Optional[Sequence[torch.Tensor]],
                 recv_like: Optional[Sequence[torch.Tensor]], step: int, device: torch.device):
        """recv_like: shape / dtype templates (meta tensors will do); device: where received tensors go."""
        self.g, self.works, self.recv, self.device = g, [], None, device
        nxt, prv = g.global_rank((g.rank + 1) % g.size), g.global_rank((g.rank - 1) % g.size)
        try:
            if recv_like is not None:
                self.recv = [torch.empty(t.shape, dtype=t.dtype, device=g.device) for t in recv_like]
                for i, t in enumerate(self.recv):
                    self.works.append(dist.irecv(t, src=prv, group=g.group, tag=2 * step + i))
            if send is not None:
                self.sent = [t.contiguous().to(g.device) for t in send]      # kept alive until wait()
                for i, t in enumerate(self.sent):
                    self.works.append(dist.isend(t, dst=nxt, group=g.group, tag=2 * step + i))
        except Exception as e:
            raise _failed(g.op, "posting the ring's send / receive", e)

    def wait(self) -> Optional[List[torch.Tensor]]:
        try:
            for w in self.works:
                w.wait()
        except Exception as e:
            raise _failed(self.g.op, "the ring's K/V transfer", e)
        if self.recv is None:
            return None
        _TRAFFIC["bytes"] += sum(t.numel() * t.element_size() for t in self.recv)
        return [t.to(self.device) for t in self.recv]
