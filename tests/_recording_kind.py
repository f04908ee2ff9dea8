"""A table kind that only the tests define: its lookups are recorded, its weights never updated.

It shows what a new kind costs: this module (the class) and one registry line,
``Kind(RecordingTable, lambda t: t.table == "recorded")`` (:func:`recording_kind`), handed to the
sharder as ``kinds=[...]``, which tries it before the built-in kinds. Nothing in the library names it.

Also the rank body of ``tests/test_new_kind.py`` (spawned; not collected by pytest).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

import overlap_optim
import sharders
from _models import ManyTableModel, covering_batch, loss_of
from _sharded_parity import local_pieces
from sharders.frozen import FrozenRows
from sharders.kernels import BuildContext, TableKernel
from sharders.kinds import Kind


class RecordingTable(TableKernel):
    """A table whose lookups are recorded (the ids each of this rank's shards received, by
    feature, as rows of the whole table) and whose weights never change: its kernel's backward
    drops the gradient."""

    kind = "recording"
    semantics = "frozen"  # never stepped
    family = "recording"
    sharded_state = False

    def __init__(self, decision: Any) -> None:
        super().__init__(decision)
        self.lookups: list[dict[str, torch.Tensor]] = []

    def batch_key(self) -> Hashable:
        return (self.kind,)

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        FrozenRows.adopt(kernel)  # the lookup, and a backward that drops the gradient

        configs = kernel.config.embedding_tables

        def record(module: nn.Module, args: tuple, output: Any) -> None:
            features = args[0].to_dict()
            for table, config in zip(tables, configs):  # a row shard sees its ids less its first row
                first = config.local_metadata.shard_offsets[0] if config.local_metadata is not None else 0
                table.lookups.append({f: features[f].values() + first for f in config.feature_names if f in features})
        kernel.register_forward_hook(record)

    def runs_as(self) -> str:
        return "recording: looked up and recorded, never updated"


def recording_kind(table: str = "recorded") -> Kind:
    """The kind's registry line: ``table`` runs as a :class:`RecordingTable`."""
    return Kind(RecordingTable, lambda t: t.table == table)


NAMES = ["recorded", "trained"]


def _sharded(world_size: int, sharding_type: str, cls: type, kwargs: dict) -> DistributedModelParallel:
    """The model with its ``recorded`` table (no annotation) and its ``trained`` one (``cls``), under DMP."""
    model = ManyTableModel(NAMES, seed=0)
    overlap_optim.apply_optimizer_in_backward(cls, model.tables["trained"].parameters(), kwargs)
    sharder = sharders.EmbeddingBagCollectionSharder(kinds=[recording_kind()])
    constraints = {n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n in NAMES}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def recorded_and_unchanged(rank: int, world_size: int, sharding_type: str, steps: int = 3) -> dict:
    """Shard a model with a ``recorded`` table (no annotation) and a ``trained`` one (SGD,
    fused) under DMP, train ``steps`` steps on this rank's own batches, and return what the test
    asserts: the ids each rank sent and recorded for ``f_recorded``, how far each table moved,
    the kinds, and the describe() rows of the recorded table."""
    dmp = _sharded(world_size, sharding_type, torch.optim.SGD, {"lr": 0.5})
    start = {n: [p.clone() for _, _, p in local_pieces(dmp, n)] for n in NAMES}
    sent = []
    for step in range(steps):
        kjt, target = covering_batch(NAMES, torch.Generator().manual_seed(100 * rank + step), cover=False)
        sent.append(kjt["f_recorded"].values())
        loss_of(dmp, (kjt, target)).backward()
    tables = sharders.plan_of(dmp.module.ebc).tables
    recorded = [ids["f_recorded"] for ids in tables["recorded"].lookups]
    moved = {n: max((p - s).abs().max().item() for (_, _, p), s in zip(local_pieces(dmp, n), start[n]))
             for n in NAMES if start[n]}
    return {
        "sent": torch.cat(sent).tolist(),
        "recorded": torch.cat(recorded).tolist() if recorded else [],
        "moved": moved,
        "kinds": {n: str(t.kind) for n, t in tables.items()},
        "grads": [n for n, p in dmp.named_parameters() if "recorded" in n and p.grad is not None],
        "describe": [line for line in sharders.describe(dmp).splitlines() if "recording" in line],
    }


def variable_batch_beside_the_fallback(rank: int, world_size: int) -> dict:
    """The ``recorded`` table beside a fallback (Adam) table, both table_wise, and a batch with a
    variable batch size per feature (VBE): the error each rank raises at that batch's lookup."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dmp = _sharded(world_size, "table_wise", torch.optim.Adam, {"lr": 0.1})
    counts = (2, 3)  # bags of f_recorded, f_trained on this rank
    kjt = KeyedJaggedTensor(
        keys=["f_recorded", "f_trained"], values=torch.arange(7) % 4, lengths=torch.tensor([1, 2, 1, 2, 1]),
        stride_per_key_per_rank=[[c] for c in counts],
        inverse_indices=(["f_recorded", "f_trained"], torch.tensor([[0, 1, 0, 1], [0, 1, 2, 2]])),
    )
    try:
        dmp.module.ebc(kjt)
    except Exception as err:  # what the user would see
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}
