"""Run a function on N gloo ranks in spawned processes: for tests and benchmarks.

Each rank runs ``fn(rank, world_size, *args)``. A rank's exception comes back to
the parent with its traceback; ranks that outlive the timeout are killed.
"""

from __future__ import annotations

import os
import queue
import socket
import time
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
    ok = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
        ok = True
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    # The result must be on the pipe before anything else can go wrong, and the
    # teardown of gloo and DDP at interpreter exit has been seen to abort (SIGABRT)
    # now and then: wait for every rank, then leave without that teardown.
    results.close()
    results.join_thread()
    try:
        if ok:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer died; the parent reports it
        ok = False
    os._exit(0 if ok else 1)


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
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for i, p in enumerate(procs) if i not in outcome):
                    break  # a rank died without a word (a crash, not an exception): stop waiting
                continue
            outcome[rank] = (status, value)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    missing = sorted(set(range(world_size)) - set(outcome))
    assert not missing, (
        f"ranks {missing} gave no result (exit codes {[p.exitcode for p in procs]}; "
        f"waited {timeout - max(deadline - time.monotonic(), 0):.0f}s of {timeout}s)"
    )
    return [outcome[r][1] for r in range(world_size)]
