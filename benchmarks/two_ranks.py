"""Two CPU processes (gloo) for the data-parallel benchmarks: `run(target, *args)` starts them,
each calls `target(rank, *args)` inside its process group, and their returns come back in
rank order (tensors, numbers, strings: what torch.load reads with weights_only)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, port: int, target, args: tuple, out: str, timeout: float) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    # a rank that waits longer than this for the other (a hang) fails instead
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout))
    torch.set_num_threads(1)
    try:
        torch.save(target(rank, *args), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run(target, *args, timeout: float = 600.0) -> list:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_entry, args=(port, target, args, f"{tmp}/record", timeout), nprocs=2, join=True)
        return [torch.load(f"{tmp}/record.{r}", weights_only=True) for r in range(2)]
