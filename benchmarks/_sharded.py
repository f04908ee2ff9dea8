"""One table sharded by our sharder on a world of one (gloo): the real path, input dist included."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from overlap_optim import apply_optimizer_in_backward

DIM = 64


class Tower(nn.Module):
    """One table ``t`` (feature ``f``) and a linear head; built on meta, materialised by DMP."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=rows, feature_names=["f"])
        self.ebc = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
        self.head = nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt)["f"]).sum()


def batch(rows: int, bags: int, pooling: int, seed: int, zipf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, offsets) of ``bags`` bags of ``pooling`` ids; uniform, or Zipf-like when ``zipf``."""
    generator = torch.Generator().manual_seed(seed)
    if zipf:
        ids = (torch.rand(bags * pooling, generator=generator).pow(2) * rows).long()
    else:
        ids = torch.randint(0, rows, (bags * pooling,), generator=generator)
    return ids, torch.arange(0, bags * pooling, pooling)


@contextlib.contextmanager
def fbgemm_backward() -> Iterator[None]:
    """Fused tables sharded inside the block run FBGEMM's own backward, as where the compiled
    extension is not built (the peer that shows what ``sharders.fused_rows`` changes)."""
    from sharders import fused_rows

    kept, fused_rows._STEP = fused_rows._STEP, None
    try:
        yield
    finally:
        fused_rows._STEP = kept


def ensure_world_of_one() -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)


def sharded_step(rows: int, batches: list, optimizer: type, kwargs: dict[str, Any],
                 own_backward: bool = True) -> Callable[[], None]:
    """A step (forward, backward, in-backward update) of a Tower sharded table_wise by our sharder;
    ``own_backward=False``: a fused table runs FBGEMM's backward (:func:`fbgemm_backward`)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import sharders

    ensure_world_of_one()
    model = Tower(rows)
    apply_optimizer_in_backward(optimizer, model.ebc.parameters(), kwargs)
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={"t": ParameterConstraints(sharding_types=["table_wise"])},
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    with contextlib.nullcontext() if own_backward else fbgemm_backward():
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    kjts = [
        KeyedJaggedTensor.from_offsets_sync(keys=["f"], values=ids, offsets=torch.cat([offs, torch.tensor([ids.numel()])]))
        for ids, offs in batches
    ]
    state = {"i": 0}

    def step() -> None:
        kjt = kjts[state["i"] % len(kjts)]
        state["i"] += 1
        dmp(kjt).backward()

    return step
