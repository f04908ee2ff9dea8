"""A training job for the deterministic-resume test, launched by torchrun (not collected by pytest).

It trains the model of ``_reshard_bodies`` under plan A, saving a checkpoint
after every step, and resumes from the latest complete one if there is any.
``--kill-rank R --kill-step S``: rank R SIGKILLs itself at the start of step S.
At the end, every rank saves the final state to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import overlap_optim  # noqa: E402
from _models import loss_of  # noqa: E402
from _reshard_bodies import DENSE, NAMES, PLAN_A, SETTINGS, global_batch, schedules  # noqa: E402
from _sharded_parity import build  # noqa: E402
from overlap_optim import checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, _, _ = build(NAMES, SETTINGS, PLAN_A, world_size, dense=DENSE)
    optimizer = overlap_optim.get_optimizers(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules())
    start = 0
    if checkpoint.latest(args.ckpt) is not None:
        start = checkpoint.load(args.ckpt, model, optimizer, {"scheduler": scheduler})["step"]
    for step in range(start, args.steps):
        if rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        loss_of(model, global_batch(step)[rank]).backward()
        optimizer.step()
        scheduler.step()
        checkpoint.save(args.ckpt, model, optimizer, {"scheduler": scheduler, "step": step + 1})
    checkpoint.save(args.out, model, optimizer, {"scheduler": scheduler, "step": args.steps})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # join gloo's worker threads before the interpreter exits: see examples/launch.py run_rank
