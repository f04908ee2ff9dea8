"""Rank bodies for the harness's own tests (spawned; not collected by pytest)."""

import os

import torch
import torch.distributed as dist


def summed(rank, world_size):
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    return value.item()


def raises_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def aborts_on_one(rank, world_size):
    if rank == 1:
        os.abort()
    return rank


def raises_on_both(rank, world_size):
    raise RuntimeError(f"rank {rank} fails this case on purpose")


def waits_for_one_that_fails(rank, world_size):
    """Rank 1 fails before the collective; rank 0 waits in it for rank 1."""
    if rank == 1:
        raise ValueError("rank 1 fails before the all-reduce")
    return summed(rank, world_size)


def unpicklable(rank, world_size):
    return lambda: rank


def pid(rank, world_size):
    return os.getpid()
