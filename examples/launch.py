"""Start a script's ranks with torchrun, for examples that a user runs with plain ``python``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["under_torchrun", "relaunch"]


def under_torchrun() -> bool:
    """True in a rank that torchrun (or torch.distributed.run) started."""
    return "LOCAL_RANK" in os.environ


def relaunch(script: str, args: list[str], world_size: int) -> int:
    """Run ``script args`` as ``world_size`` local ranks (gloo on CPU); returns torchrun's exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               str(Path(script).resolve()), *args]
    print(f"launching {world_size} ranks: torchrun --standalone --nproc-per-node={world_size} "
          f"{Path(script).name} {' '.join(args)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(command, env=env).returncode
