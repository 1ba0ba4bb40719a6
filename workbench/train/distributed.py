"""Data-parallel processes (torchrun): joining the process group, one device per rank, rank helpers.

Under `torchrun --nproc_per_node N` every rank draws the same global batch and trains on its slice
(`shard`); DDP averages the gradients, so clipping, Muon and AdamW step identically on every rank.
Collectives exchange JSON as bytes in tensors (never pickle).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..config import fail


def init_distributed() -> tuple[int, int, torch.device | None]:
    """Return (rank, world size, device) after joining the process group torchrun describes in the environment.

    Under `torchrun --nproc_per_node N` (WORLD_SIZE > 1 in the environment) this initialises the
    default process group once: NCCL with one CUDA device per process (cuda:LOCAL_RANK) when CUDA is
    present, else gloo on the CPU. Alone (no WORLD_SIZE, or 1) it does nothing and returns (0, 1, None).
    A group that is already initialised is used as it is (its device: cuda:LOCAL_RANK for NCCL).
    """
    import torch.distributed as dist

    env_world = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(env_world)
    except ValueError:
        fail("WORLD_SIZE", env_world, "must be an integer >= 1 (set by torchrun)")
    if world < 1:
        fail("WORLD_SIZE", env_world, "must be an integer >= 1 (set by torchrun)")
    initialised = dist.is_available() and dist.is_initialized()
    if world == 1 and not initialised:
        return 0, 1, None
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} asks for {world} processes, but this torch build has no "
                           "torch.distributed")
    local = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(local)
    except ValueError:
        fail("LOCAL_RANK", local, "must be an integer >= 0 (set by torchrun)")
    cuda = torch.cuda.is_available()
    if cuda and not 0 <= local_rank < torch.cuda.device_count():
        fail("LOCAL_RANK", local_rank, f"must name one of this machine's {torch.cuda.device_count()} CUDA "
             "devices: start at most that many processes per node (--nproc_per_node)")
    if not initialised:
        if cuda:
            torch.cuda.set_device(local_rank)  # before the group: NCCL binds each process to its own device
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda and dist.get_backend() == "nccl" else None
    return dist.get_rank(), dist.get_world_size(), device


def is_distributed() -> bool:
    """Return True when this process belongs to an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def pick_device(name: str | None, rank_default: torch.device | None) -> torch.device:
    """Return the device this process trains on: `name`, else CUDA when present, else the CPU.

    In a process group a bare "cuda" becomes this rank's own device (LOCAL_RANK's under torchrun, else
    the one the caller selected), and an NCCL group needs a CUDA device (else fail naming TrainConfig.device).
    """
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not is_distributed():
        return device
    if device.type == "cuda" and device.index is None:
        device = rank_default or torch.device("cuda", torch.cuda.current_device())
    if torch.distributed.get_backend() == "nccl" and device.type != "cuda":
        fail("TrainConfig.device", name, "must be a CUDA device (or None) in an NCCL process group")
    return device


def shard(x, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """Return this rank's rows of a batch tensor on `device` (all rows when alone).

    On CUDA the rows are copied from pinned memory without blocking: a copy from pageable memory would
    wait for the previous step's update to finish, a second host-device synchronisation per step.
    """
    x = torch.as_tensor(x)
    if world > 1:
        b = x.shape[0] // world
        x = x[rank * b:(rank + 1) * b]
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Return the sum of `x` over every rank (a new tensor; queued on its device, nothing waits for it)."""
    total = x.detach().clone()
    torch.distributed.all_reduce(total)
    return total


def all_gather_json(obj: Any) -> list[Any]:
    """Return every rank's JSON-encodable `obj` (rank order), exchanged as bytes in tensors (no pickle)."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj, sort_keys=True, default=str).encode()), dtype=torch.uint8, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = int(max(s.item() for s in sizes))
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=dev) for _ in sizes]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(longest - data.numel())]))
    return [json.loads(bytes(b[:int(n.item())].tolist()).decode()) for b, n in zip(bufs, sizes)]


def check_same_on_every_rank(what: dict[str, Any]) -> None:
    """Return None when every rank holds the same values (all_gather); else raise naming the rank and the fields.

    The ranks must draw the same loop counts and batches each step (shared seed and sampler), or
    their gradients would average steps of different models.
    """
    import torch.distributed as dist

    mine = json.loads(json.dumps(what, sort_keys=True, default=str))  # compared as the other ranks' arrive
    for rank, theirs in enumerate(all_gather_json(what)):
        diff = {k: (mine[k], theirs.get(k)) for k in mine if theirs.get(k) != mine[k]}
        if diff:
            raise ValueError(f"rank {dist.get_rank()} and rank {rank} differ in {diff} (this rank, that rank): "
                             "every rank of a data-parallel run needs the same TrainConfig trajectory fields "
                             "(seed, loop sampler, ...) and the same training data at the same position")
