"""Starting the processes of a group: under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) join
it; otherwise spawn `world` local processes that meet on 127.0.0.1 at a free port. The demo and the benchmark
use it; library calls never start processes."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Callable, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_process(world_on_host: int) -> int:
    """This host's cores shared by its processes (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // max(1, world_on_host))


def init(timeout_s: float = 60.0, device: str = "cpu") -> Tuple[int, int]:
    """Joins the group described by the environment: gloo for CPU tensors, NCCL for CUDA ones. -> (rank, world)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    fn(*args)


def run(fn: Callable, world: int, *args) -> None:
    """Runs fn(*args) in every process of the group: this process under torchrun, else `world` spawned ones
    (fn must be importable: a module-level function). fn calls init() itself."""
    if under_torchrun():
        fn(*args)
        return
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
