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


# The promise matrix's budgets (tests/test_promise_matrix.py). "ci": a fixed set of examples, the
# same every run (derandomized), within about 60 s here; "matrix" (make test-matrix): many more, from a
# random seed that --hypothesis-seed repeats. Registered here: pytest reads --hypothesis-profile
# before it imports a test module.
from hypothesis import HealthCheck, settings  # noqa: E402

_MATRIX = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("ci", max_examples=int(os.environ.get("MATRIX_EXAMPLES", "300")), derandomize=True, **_MATRIX)
settings.register_profile("matrix", max_examples=int(os.environ.get("MATRIX_EXAMPLES", "2000")), **_MATRIX)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
