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
