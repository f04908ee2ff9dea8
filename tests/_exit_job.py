"""A one-rank job for the clean-exit test (run as a script, not collected by pytest).

It builds a DMP model with every kind of table and dense update the library
runs (fused, fallback, layer-wise, and a dense part under local SGD), trains a
few steps through ``get_optimizers``, destroys the process group, and prints one
JSON line: how many gloo threads were alive while training, after
``destroy_process_group`` and after ``gc.collect()``.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import overlap_optim  # noqa: E402
import sharders  # noqa: E402
from _models import ManyTableModel, covering_batch, loss_of  # noqa: E402


def gloo_threads() -> int:
    """Threads of this process that gloo's process group started (named by torch and gloo)."""
    tasks = Path("/proc/self/task")
    return sum((tasks / t / "comm").read_text().startswith(("pt_gloo", "gloo")) for t in os.listdir(tasks))


def train() -> int:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    names = ["fused", "fallback", "layerwise"]
    settings = [(torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05}), (torch.optim.Adafactor, {"lr": 0.01})]
    model = ManyTableModel(names)
    for name, (cls, kwargs) in zip(names, settings):
        overlap_optim.apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    overlap_optim.apply_optimizer_in_backward(torch.optim.SGD, model.dense.parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu", local_world_size=1),
        constraints={n: ParameterConstraints(sharding_types=["row_wise"]) for n in names},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    sync = overlap_optim.QSR(alpha=0.0, base_period=2)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper(local_sgd=sync))
    optimizer = overlap_optim.get_optimizers(dmp)
    for step in range(4):
        loss_of(dmp, covering_batch(names, torch.Generator().manual_seed(step))).backward()
        optimizer.step()
    dist.all_gather_object([None], torch.ones(3))  # as the demo ends: tensors on gloo's worker threads
    training = gloo_threads()
    dist.destroy_process_group()
    return training


if __name__ == "__main__":
    counts = {"training": train(), "destroyed": gloo_threads()}
    gc.collect()
    counts["collected"] = gloo_threads()
    print(json.dumps(counts))
