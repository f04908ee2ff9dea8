"""Start a script's ranks with torchrun, for examples that a user runs with plain ``python``."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["under_torchrun", "relaunch", "run_rank"]


def under_torchrun() -> bool:
    """True in a rank that torchrun (or torch.distributed.run) started."""
    return "LOCAL_RANK" in os.environ


def run_rank(fn: Callable[[Any], None], args: Any) -> int:
    """Run one rank's ``fn(args)`` (which ends with ``dist.destroy_process_group()``); returns 0.

    Then it collects the reference cycles that still hold gloo's process group
    (DMP and DDP keep it), so that the group's worker threads are joined while
    the interpreter is alive. Left to interpreter shutdown, a worker that drops
    the last collective's tensors a moment late needs the GIL during
    finalization, and the rank aborts with "terminate called without an
    active exception" (seen about once in 13 demo runs before this).
    """
    fn(args)
    gc.collect()
    return 0


def relaunch(script: str, args: list[str], world_size: int) -> int:
    """Run ``script args`` as ``world_size`` local ranks (gloo on CPU); returns torchrun's exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               str(Path(script).resolve()), *args]
    print(f"launching {world_size} ranks: torchrun --standalone --nproc-per-node={world_size} "
          f"{Path(script).name} {' '.join(args)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(command, env=env).returncode
