"""Where this process sits: distributed rank / world size and DataLoader worker."""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["agree_min", "current_worker", "distributed_world_size", "resolve_ranks"]


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Return ``(rank, world_size)``: explicit values, else ``torch.distributed``'s, else (0, 1).

    Both or neither must be given. Explicit values are checked against each other only.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError("pass both rank and world_size, or neither")
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return int(rank), int(world_size)


def current_worker() -> tuple[int, int]:
    """Return ``(worker_id, num_workers)`` of the calling DataLoader worker, or ``(0, 1)``."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)


def distributed_world_size() -> int:
    """World size of ``torch.distributed``'s default group, or 0 when it is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 0


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks of the default process group (one all-reduce MIN;
    every rank must call it). Without a process group, or with one rank, ``value`` itself."""
    if distributed_world_size() <= 1:
        return int(value)
    import torch
    import torch.distributed as dist

    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
