"""Run a function on N gloo ranks in spawned processes: for tests and benchmarks.

Each rank runs ``fn(rank, world_size, *args)``. A rank's exception comes back to
the parent with its traceback; ranks that outlive the timeout are killed.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """``[fn(0, world_size, *args), fn(1, ...), ...]``, each from its own process.

    Raises:
        AssertionError: a rank raised (its traceback is in the message), exited
            without a result, or did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            outcome[rank] = (status, value)
            if status == "error":
                break
    except Exception:  # queue.Empty: someone hung
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    missing = sorted(set(range(world_size)) - set(outcome))
    assert not missing, f"ranks {missing} gave no result within {timeout}s (exit codes {[p.exitcode for p in procs]})"
    return [outcome[r][1] for r in range(world_size)]
