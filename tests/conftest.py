"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world_of_one():
    """A world-size-1 gloo group in this process, for tests that shard or wrap in DDP."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
