"""The promise matrix: a whole configuration, drawn; ours sharded beside an independent reference.

A :class:`Config` names everything a user chooses: the collections and their tables (rows that
do not divide by the world size, a sharding type, an optimizer or none or frozen, dense
semantics, pooling, a table shared by two features, weighted features), the batches (every row
touched, or a third of the rows), the dense part (our DDP hook, or the user's optimizer), and the
loop (clipping by norm or by value over a set, ``no_step`` micro-batches, a scheduler, a
checkpoint mid-run in one of the forms users write), a model built on the meta device, batches
with a variable batch size per feature (VBE), on 1 or 2 ranks.

:func:`run` (a rank body, spawned) builds the reference **from the config alone**, with plain
``nn.EmbeddingBag``, ``nn.Embedding`` and ``torch.optim`` (or the optimizer's own package) in one
process on the global batch; lazy tables, whose untouched rows do not move, are held to torch's
sparse references (``SparseAdam``; SGD, Adagrad and row-wise Adagrad, whose untouched rows do not
move on a zero gradient). Nothing of ``overlap_optim`` or ``sharders`` builds it. Ours is the
TorchRec model annotated and sharded as a user would; weights are compared after every step.

The outcome is "exact", with every table's difference after every step and how far the reference
moved, or a refusal (its stage, type and message, and whether the model was left unchanged). The
parent (``tests/test_promise_matrix.py``) says which refusals the docs list
(:mod:`sharders.refusals`) and checks each outcome against that.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import math
import os
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import (
    DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor,
    PoolingType,
)

from torchrec.sparse.jagged_tensor import JaggedTensor
from torchrec.streamable import Pipelineable

from _models import without_compiled_operators

DIM = 8  # two column shards of 4 (min_partition) on column splits
BATCH = 4  # samples per rank and micro-batch
BINDING = 0.3  # a clipping bound, as a fraction of the first step's norm (or largest element)
TOL = 1e-5
# A table's data_type and the dtype it stores: the reference keeps a low-precision table as float32 values
# that the stored dtype holds exactly, and rounds it to them after every step (the stated reference).
PRECISIONS = {"fp32": (DataType.FP32, torch.float32), "fp16": (DataType.FP16, torch.float16),
              "bf16": (DataType.BF16, torch.bfloat16)}


# name -> (import path of the class, kwargs, layer-wise, lazy reference: the class torch offers for
# lazy semantics (untouched rows and their state unchanged), or None where there is none)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any], bool, str | None]] = {
    "sgd": ("torch.optim.SGD", {"lr": 0.1}, False, "torch.optim.SGD"),
    "sgd_momentum": ("torch.optim.SGD", {"lr": 0.1, "momentum": 0.9}, False, None),
    "adagrad": ("torch.optim.Adagrad", {"lr": 0.1, "eps": 1e-8}, False, "torch.optim.Adagrad"),
    "rowwise_adagrad": ("torchrec.optim.rowwise_adagrad.RowWiseAdagrad", {"lr": 0.1}, False,
                        "torchrec.optim.rowwise_adagrad.RowWiseAdagrad"),
    # decays every row under dense semantics, the touched ones under lazy: no lazy reference
    "rowwise_adagrad_wd": ("torchrec.optim.rowwise_adagrad.RowWiseAdagrad", {"lr": 0.1, "weight_decay": 0.05}, False,
                           None),
    # SparseAdam, the lazy reference, places eps outside the bias correction (_adam_eps rescales it)
    "adam": ("torch.optim.Adam", {"lr": 0.05, "eps": 1e-12}, False, "torch.optim.SparseAdam"),
    "adamw": ("torch.optim.AdamW", {"lr": 0.05, "weight_decay": 0.1}, False, None),
    "rmsprop": ("torch.optim.RMSprop", {"lr": 0.01}, False, None),
    "adafactor": ("torch.optim.Adafactor", {"lr": 0.05}, True, None),
    "lamb": ("pytorch_optimizer.Lamb", {"lr": 0.05, "weight_decay": 0.01}, True, None),  # third-party
    # third-party; its projection's settings are group options (GROUP_OPTIONS): a split table gathers its gradient
    "galore": ("pytorch_optimizer.GaLore", {"lr": 0.02, "weight_decay": 0.01}, True, None),
}
# import path -> the group options of an optimizer that reads settings from its param group
GROUP_OPTIONS = {"pytorch_optimizer.GaLore": {"rank": 2, "update_proj_gap": 2, "scale": 0.25, "projection_type": "std"}}
NO_OPTIMIZER = ("user", "frozen")  # the user's own optimizer steps it; requires_grad=False
USER_OPTIMIZER = ("torch.optim.SGD", {"lr": 0.1})
# the annotated MLP's optimizer (Config.dense_optimizer): element-wise, or layer-wise (across the pieces of a
# sharded or tensor-parallel parameter, with its cross-shard form)
DENSE_OPTIMIZERS = {"adam": ("torch.optim.Adam", {"lr": 0.02}), "adafactor": ("torch.optim.Adafactor", {"lr": 0.02}),
                    "galore": ("pytorch_optimizer.GaLore", {"lr": 0.02})}


@dataclasses.dataclass(frozen=True)
class Table:
    name: str  # TorchRec's table name: unique within its collection
    collection: str  # "ebc", "ebc_b" (a second EBC) or "ec": the model's attribute that holds it
    rows: int
    sharding: str
    optimizer: str  # a key of OPTIMIZERS, or one of NO_OPTIMIZER
    dense: bool = False  # named in the sharder's dense_tables
    mean: bool = False  # MEAN pooling (EBC)
    shared: bool = False  # looked up by two features
    precision: str = "fp32"  # a key of PRECISIONS: the table's data_type
    state_bf16: bool = False  # annotated with state_dtype=torch.bfloat16
    kernel: str | None = None  # a hand-made plan's compute kernel for it (None: the planner's)

    @property
    def key(self) -> str:
        """Unique in the model."""
        return f"{self.collection}__{self.name}"

    @property
    def bagged(self) -> bool:
        return self.collection != "ec"

    @property
    def managed(self) -> bool:
        """A table of the managed-collision collection ("mc"): row_wise, its ids remapped."""
        return self.collection == "mc"

    @property
    def fqn(self) -> str:
        inner = f"{self.collection}._embedding_module" if self.managed else self.collection
        return f"{inner}.{'embedding_bags' if self.bagged else 'embeddings'}.{self.name}.weight"

    @property
    def features(self) -> list[str]:
        return [f"{self.key}_a", f"{self.key}_b"] if self.shared else [f"{self.key}_a"]

    @property
    def lazy(self) -> bool:
        """The documented semantics: a model-parallel table not in dense_tables whose optimizer is
        row-separable (not layer-wise) is lazy; every other table is dense."""
        if self.optimizer in NO_OPTIMIZER:
            return False
        return self.sharding != "data_parallel" and not self.dense and not OPTIMIZERS[self.optimizer][2]


@dataclasses.dataclass(frozen=True)
class Config:
    tables: tuple[Table, ...]
    world_size: int = 2
    weighted: bool = False  # the EBCs' features carry weights
    qualified: bool = False  # dense_tables names tables as "<collection>.<table>"
    fused_params: tuple[tuple[str, Any], ...] = ()  # the sharders' fused_params
    cover: bool = True  # every batch touches every row (else a third of the rows)
    # "hook": the MLP annotated (Adam, our DDP hook); "fsdp": the MLP annotated (Adam), sharded by FSDP2
    # (sharders.FullyShardWrapper); "tp": the MLP annotated (Adam), then tensor-parallel over every rank
    # (parallelize_module before DMP, no data-parallel wrapper); "tp_fsdp": the same, then FSDP2 over the
    # dp dimension (of one rank) of that (dp, tp) mesh; with either, every rank reads the same batch (one
    # data-parallel replica). "user": the user's SGD (our wrapper, DDP without a hook of ours);
    # "user_ddp": the user's SGD under TorchRec's default DDP wrapper
    dense_part: str = "hook"
    dense_state_bf16: bool = False  # the annotated MLP (all but "user", "user_ddp") with state_dtype=torch.bfloat16
    dense_optimizer: str = "adam"  # the annotated MLP's, of DENSE_OPTIMIZERS
    clip: tuple[str, str] | None = None  # ("norm" | "value", "tables" | "everything")
    # with clip ("norm", "everything"): error_if_nonfinite, and step 1's targets are inf on every rank. That
    # step's norm is not finite: it raises on every rank, and the loop skips it as a torch loop skips the
    # step and zeroes the gradients; no update of the set runs, and the next steps start clean
    non_finite: bool = False
    micro: int = 1  # micro-batches per step (the first ones in no_step)
    schedule: bool = False  # a LambdaLR through get_optimizers, the same on each reference optimizer
    # mid-run: "in_place", "rollback" (torch.save, a step more, then loaded back in place),
    # "torch_save" (into fresh objects), "other_plan" (overlap_optim.checkpoint), "one_rank" (the same,
    # loaded into the model sharded for one rank, which trains on with the global batch); plain DCP:
    # "dcp" (fresh state dicts filled, then loaded), "dcp_other_plan" (dcp.load of the objects
    # themselves, under another plan), both with torch's default load planner (ours where the optimizer
    # keeps no tensor: torch's cannot read it when a table has no piece on a rank);
    # "state_dict_other_plan" (load_state_dict of the state dict
    # held in memory, under another plan)
    checkpoint: str | None = None
    # built and annotated on the meta device, then "dmp": handed to DMP as it is; "materialize":
    # overlap_optim.materialize(model, "cpu") first; "to_empty": Module.to_empty(device="cpu") first
    meta: str | None = None
    # each feature of the EBCs with its own number of bags per rank, expanded to the batch by inverse
    # indices (VBE), under EmbeddingBagCollectionSharder(variable_batch=True); the reference sees the
    # expanded batch
    vbe: bool = False
    # the compiled operators (overlap_optim/csrc) as built; False: as where they were not (every caller's
    # pure-torch path, FBGEMM's own backward for fused tables)
    compiled: bool = True
    # the loop: None (forward, backward and the step by hand), or a TorchRec train pipeline that runs them
    # ("TrainPipelineSparseDist", "TrainPipelineSparseDistLite", "TrainPipelineBase"), one per step's
    # micro-batches (the last one's backward steps; the others' in no_step, as by hand)
    pipeline: str | None = None
    steps: int = 3
    seed: int = 0

    def collections(self) -> list[str]:
        return [c for c in COLLECTIONS if any(t.collection == c for t in self.tables)]

    def features(self, collection: str | None = None) -> list[str]:
        return [f for t in self.tables if collection in (None, t.collection) for f in t.features]


class _TensorParallelOnly:
    """DMP's ``data_parallel_wrapper`` for a dense part that tensor parallelism spans over every rank:
    no data-parallel replica to reduce over, so nothing to wrap."""

    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        pass


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


# -- the models --


COLLECTIONS = ("ebc", "ebc_b", "ec", "mc")  # "mc": an EBC in a ManagedCollisionEmbeddingBagCollection


class Model(nn.Module):
    """The TorchRec model of a config: up to two EBCs and an EC, and an MLP over every feature."""

    def __init__(self, config: Config, device: str = "cpu") -> None:
        super().__init__()
        self.config = config
        for collection in config.collections():
            mine = [t for t in config.tables if t.collection == collection]
            if collection == "ec":
                module = EmbeddingCollection(tables=[
                    EmbeddingConfig(name=t.name, embedding_dim=DIM, num_embeddings=t.rows, feature_names=t.features,
                                    data_type=PRECISIONS[t.precision][0])
                    for t in mine
                ], device=torch.device(device))
            else:
                module = EmbeddingBagCollection(tables=[
                    EmbeddingBagConfig(name=t.name, embedding_dim=DIM, num_embeddings=t.rows, feature_names=t.features,
                                       pooling=PoolingType.MEAN if t.mean else PoolingType.SUM,
                                       data_type=PRECISIONS[t.precision][0],
                                       init_fn=reinit if collection == "mc" else None) for t in mine
                ], is_weighted=config.weighted, device=torch.device(device))
                if collection == "mc":
                    module = _managed(module, mine)
            setattr(self, collection, module)
        self.dense = nn.Sequential(nn.Linear(len(config.features()) * DIM, 4, device=device), nn.Tanh(),
                                   nn.Linear(4, 1, device=device))

    def tables(self) -> dict[str, nn.Module]:
        """Table key -> the module that holds its weight."""
        out = {}
        for t in self.config.tables:
            module = getattr(self, t.collection)
            module = module._embedding_module if t.managed else module
            out[t.key] = (module.embedding_bags if t.bagged else module.embeddings)[t.name]
        return out

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the prediction, as TorchRec's train pipelines take them. Written for
        ``torch.fx`` (the pipelines trace it to find what each sharded collection is given): each
        collection's KJT is read from the batch by name."""
        parts = {}
        for collection in self.config.collections():
            out = getattr(self, collection)(batch.kjts[collection])
            out = out[0] if collection == "mc" else out  # (pooled, remapped features or None)
            for f in self.config.features(collection):
                parts[f] = _position_weighted(out[f].lengths(), out[f].values()) if collection == "ec" else out[f]
        prediction = self.dense(torch.cat([parts[f] for f in self.config.features()], dim=1)).squeeze(1)
        return _loss(prediction, batch.target), prediction


class Batch(Pipelineable):
    """One rank's micro-batch as the model takes it: a KJT per collection, and the targets."""

    def __init__(self, kjts: dict[str, KeyedJaggedTensor], target: torch.Tensor) -> None:
        self.kjts, self.target = kjts, target

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch({k: v.to(device=device, non_blocking=non_blocking) for k, v in self.kjts.items()},
                     self.target.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        for kjt in self.kjts.values():
            kjt.record_stream(stream)
        self.target.record_stream(stream)

    def pin_memory(self) -> Batch:
        return self


class Reference(nn.Module):
    """The same model in plain torch: ``nn.EmbeddingBag`` (sum or mean, per-sample weights) and
    ``nn.Embedding`` (rows weighted by position), on the global batch."""

    def __init__(self, config: Config, weights: dict[str, torch.Tensor], dense: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.tables = nn.ModuleDict()
        for t in config.tables:
            table = nn.EmbeddingBag(t.rows, DIM, mode="mean" if t.mean else "sum") if t.bagged else nn.Embedding(t.rows, DIM)
            with torch.no_grad():
                table.weight.copy_(weights[t.key])
            self.tables[t.key] = table
        self.dense = copy.deepcopy(dense)

    def forward(self, batch: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        parts = []
        for t in self.config.tables:
            for feature in t.features:
                lengths, values, weights = batch[feature]
                if t.bagged:
                    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1]])
                    parts.append(self.tables[t.key](values, offsets, per_sample_weights=weights))
                else:
                    parts.append(_position_weighted(lengths, self.tables[t.key](values)))
        return self.dense(torch.cat(parts, dim=1)).squeeze(1)


def _position_weighted(lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[batch, dim]``: each sample's rows times ``1 / (1 + position)``, summed."""
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(values.shape[0]) - starts[sample]
    weighted = values / (1.0 + position.to(values.dtype))[:, None]
    return values.new_zeros(lengths.numel(), values.shape[1]).index_add(0, sample, weighted)


# -- managed collision --

BUCKETS = 2  # the input buckets of a managed-collision module: at least the world size (TorchRec's rule)


def input_size(table: Table) -> int:
    """A managed-collision table's ids: 0 .. 3 x its rows (more ids than slots), in two buckets."""
    return 6 * math.ceil(table.rows / 2)


def reinit(weight: torch.Tensor) -> torch.Tensor:
    """The managed-collision tables' ``init_fn`` (TorchRec re-initialises an evicted slot with it):
    deterministic, so the reference gives an evicted slot the same weight, and different per element."""
    with torch.no_grad():
        return weight.copy_(torch.linspace(-0.5, 0.5, weight.numel()).view_as(weight))


def _collision_module(table: Table) -> nn.Module:
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule

    return MCHManagedCollisionModule(zch_size=table.rows, device=torch.device("cpu"), eviction_interval=1,
                                     input_hash_size=input_size(table), buckets=BUCKETS,
                                     eviction_policy=DistanceLFU_EvictionPolicy())


def _managed(ebc: EmbeddingBagCollection, tables: list[Table]) -> nn.Module:
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    collision = ManagedCollisionCollection({t.name: _collision_module(t) for t in tables},
                                           embedding_configs=ebc.embedding_bag_configs())
    return ManagedCollisionEmbeddingBagCollection(ebc, collision, return_remapped_features=False)


class Remapper:
    """The reference's remapping of the managed-collision tables, written from TorchRec's documented
    behaviour (not from ours): each table's module rebuilt per row shard (``rebuild_with_output_id_range``,
    rows split as TorchRec splits them row-wise: ceil(rows / world) a shard); each id to the shard of its
    input bucket (block bucketization), where the module profiles and remaps it; then the slots it evicts,
    whose weight is re-initialised with ``init_fn`` and whose per-row optimizer state becomes a fresh row's
    (zero: every optimizer drawn here starts its per-row state at zero; ``step`` counts on) before the
    batch is looked up. A micro-batch is remapped once, and every trainer reads it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tables = [t for t in config.tables if t.managed]
        self.shards: dict[str, list[nn.Module]] = {}
        for t in self.tables:
            per = math.ceil(t.rows / config.world_size)
            bounds = [min(r * per, t.rows) for r in range(config.world_size + 1)]
            original = _collision_module(t)
            self.shards[t.key] = [original.rebuild_with_output_id_range(
                (bounds[r], bounds[r + 1]), output_segments=bounds, device=torch.device("cpu")).train()
                for r in range(config.world_size)]
        self.done: dict[tuple[int, int], dict[str, Any]] = {}

    def __call__(self, step: int, micro: int, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` (the global micro-batch) with the managed tables' ids remapped, and under
        ``"evict"`` the rows each table evicts before it is looked up; once per (step, micro)."""
        if (step, micro) in self.done:
            return self.done[(step, micro)]
        out, evict = dict(batch), {}
        for t in self.tables:
            values = torch.cat([batch[f][1] for f in t.features])
            block = math.ceil(input_size(t) / BUCKETS)
            remapped, evicted = torch.empty_like(values), []
            for rank, shard in enumerate(self.shards[t.key]):
                mine = (values // block) * self.config.world_size // BUCKETS == rank
                ids = values[mine]
                count = torch.tensor([ids.numel()])
                remapped[mine] = shard.remap(shard.profile({t.name: JaggedTensor(
                    values=ids, lengths=count, weights=count)}))[t.name].values()
                rows = shard.evict()
                if rows is not None and rows.numel():
                    evicted.append(rows.long())
            evict[t.key] = evicted
            start = 0
            for f in t.features:
                lengths, ids, weights = batch[f]
                out[f] = (lengths, remapped[start : start + ids.numel()], weights)
                start += ids.numel()
        out["evict"] = evict
        self.done[(step, micro)] = out
        return out


def evict_rows(weight: torch.Tensor, optimizers: list[torch.optim.Optimizer], rows: list[torch.Tensor]) -> None:
    """Each shard's evicted ``rows`` (in turn, as each shard does): the weight re-initialised with
    ``init_fn``, and every per-row state tensor of ``weight`` in ``optimizers`` zero there."""
    with torch.no_grad():
        for part in rows:
            weight[part] = reinit(weight[part].clone()).to(weight.dtype)
            for optimizer in optimizers:
                for value in optimizer.state.get(weight, {}).values():
                    if torch.is_tensor(value) and value.dim() and value.shape[0] == weight.shape[0]:
                        value[part] = 0


# -- batches --


def make_batch(config: Config, generator: torch.Generator) -> dict[str, Any]:
    """One rank's micro-batch: feature -> (lengths, ids, weights or None), and the targets. With
    ``cover``, sample 0 holds every row; else every id is in the first third of the rows.

    With ``vbe``, an EBC feature has 1 to BATCH distinct bags, each used by some sample:
    ``out["vbe"][feature]`` is (bag lengths, ids, weights, each sample's bag), and ``out[feature]``
    the same expanded to one bag per sample, which is what the reference sees."""
    out: dict[str, Any] = {"vbe": {}}
    for t in config.tables:
        vbe = config.vbe and t.bagged
        for feature in t.features:
            # the same on every rank (on gloo, a row-split table is refused otherwise: tests/test_variable_batch.py)
            bags = 1 + zlib.crc32(f"{config.seed}/{feature}".encode()) % BATCH if vbe else BATCH
            lengths, values = [], []
            for bag in range(bags):
                if t.managed:  # an id of each input bucket: every micro-batch sends each row shard as many ids
                    # (TorchRec's module counts only as many ids as 1.25 x its first batch's)
                    block = math.ceil(input_size(t) / BUCKETS)
                    ids = torch.cat([torch.randint(0, block, (1,), generator=generator),
                                     torch.randint(block, input_size(t), (1,), generator=generator)])
                elif config.cover and bag == 0:
                    ids = torch.randperm(t.rows, generator=generator)
                else:
                    high = t.rows if config.cover else max(1, t.rows // 3)
                    ids = torch.randint(0, high, (int(torch.randint(1, 4, (1,), generator=generator)),),
                                        generator=generator)
                lengths.append(ids.numel())
                values.append(ids)
            weighted = config.weighted and t.bagged
            weights = [torch.rand(v.numel(), generator=generator) + 0.5 if weighted else None for v in values]
            if vbe:  # every bag used, then the rest of the samples anywhere
                inverse = torch.cat([torch.arange(bags), torch.randint(0, bags, (BATCH - bags,), generator=generator)])
                inverse = inverse[torch.randperm(BATCH, generator=generator)]
                out["vbe"][feature] = (torch.tensor(lengths), torch.cat(values),
                                       torch.cat(weights) if weighted else None, inverse)
                lengths, values, weights = [lengths[i] for i in inverse], [values[i] for i in inverse], \
                    [weights[i] for i in inverse]
            out[feature] = (torch.tensor(lengths), torch.cat(values), torch.cat(weights) if weighted else None)
    out["target"] = torch.randn(BATCH, generator=generator)
    return out


def global_batch(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's samples, rank after rank."""
    out = {}
    for key in parts[0]:
        if key == "vbe":  # each rank's bags after the previous rank's; samples point into their own rank's
            out[key] = {}
            for feature in parts[0][key]:
                pieces, first = [], 0
                for part in parts:
                    lengths, values, weights, inverse = part[key][feature]
                    pieces.append((lengths, values, weights, inverse + first))
                    first += lengths.numel()
                out[key][feature] = tuple(None if p[0] is None else torch.cat(p) for p in zip(*pieces))
            continue
        if key == "target":
            out[key] = torch.cat([p[key] for p in parts])
            continue
        weights = [p[key][2] for p in parts]
        out[key] = (torch.cat([p[key][0] for p in parts]), torch.cat([p[key][1] for p in parts]),
                    None if weights[0] is None else torch.cat(weights))
    return out


def kjts(config: Config, batch: dict[str, Any]) -> dict[str, KeyedJaggedTensor]:
    """The batch as TorchRec takes it: one KJT per collection."""
    out = {}
    for collection in config.collections():
        features = config.features(collection)
        if config.vbe and collection != "ec":
            parts = [batch["vbe"][f] for f in features]
            weights = [p[2] for p in parts]
            out[collection] = KeyedJaggedTensor(
                keys=features, values=torch.cat([p[1] for p in parts]), lengths=torch.cat([p[0] for p in parts]),
                weights=None if weights[0] is None else torch.cat(weights),
                stride_per_key_per_rank=[[p[0].numel()] for p in parts],
                inverse_indices=(features, torch.stack([p[3] for p in parts])),
            )
            continue
        weights = [batch[f][2] for f in features]
        out[collection] = (KeyedJaggedTensor.from_lengths_sync(
            keys=features, values=torch.cat([batch[f][1] for f in features]),
            lengths=torch.cat([batch[f][0] for f in features]),
            weights=None if weights[0] is None else torch.cat(weights),
        ))
    return out


def _loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (prediction - target).pow(2).mean()


# -- the reference --


class ReferenceTrainer:
    """One process, the global batch: backward on each micro-batch (gradients add up), then
    torch's clipping over the set, then each optimizer's step."""

    def __init__(self, config: Config, model: Reference) -> None:
        self.config, self.model = config, model
        self.optimizers: list[torch.optim.Optimizer] = []  # those of annotated parameters
        self.users: list[torch.optim.Optimizer] = []  # the user's own (not scheduled)
        self.lazy: dict[str, torch.optim.Optimizer] = {}  # table -> its sparse reference
        self.bf16_state: list[torch.optim.Optimizer] = []  # those whose state is rounded to BF16 after each step
        for t in config.tables:
            weight = model.tables[t.key].weight
            if t.optimizer == "frozen":
                weight.requires_grad_(False)
            elif t.optimizer == "user":
                self.users.append(_class(USER_OPTIMIZER[0])([weight], **USER_OPTIMIZER[1]))
            else:
                path, kwargs, _, lazy_path = OPTIMIZERS[t.optimizer]
                if t.lazy and (not config.cover or t.managed):  # a managed table's slots are not all touched
                    assert lazy_path is not None, f"{t}: no lazy reference (the strategy must not draw it)"
                    path = lazy_path
                optimizer = _class(path)([{"params": [weight], **GROUP_OPTIONS.get(path, {})}], **kwargs)
                self.optimizers.append(optimizer)
                if t.state_bf16:
                    self.bf16_state.append(optimizer)
                if t.lazy and path == "torch.optim.SparseAdam":
                    self.lazy[t.key] = optimizer
        self.dense_optimizer = None  # the annotated MLP's
        if config.dense_part in ("user", "user_ddp"):
            self.users.append(_class(USER_OPTIMIZER[0])(model.dense.parameters(), **USER_OPTIMIZER[1]))
        else:
            path, kwargs = DENSE_OPTIMIZERS[config.dense_optimizer]
            group = {"params": list(model.dense.parameters()), **GROUP_OPTIONS.get(path, {})}
            self.dense_optimizer = _class(path)([group], **kwargs)
            self.optimizers.append(self.dense_optimizer)
            if config.dense_state_bf16:
                self.bf16_state.append(self.dense_optimizer)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers] if config.schedule else []

    def clip_set(self) -> list[torch.Tensor]:
        if self.config.clip is None:
            return []
        tables = [self.model.tables[t.key].weight for t in self.config.tables if t.optimizer != "frozen"]
        return tables + (list(self.model.dense.parameters()) if self.config.clip[1] == "everything" else [])

    def bound(self, micro_batches: list[dict[str, Any]]) -> float:
        """``BINDING`` times the first step's norm (largest element) of the clipped set: a bound that clips."""
        probe = copy.deepcopy(self)
        probe.backward(micro_batches)
        grads = [p.grad for p in probe.clip_set() if p.grad is not None]
        if self.config.clip[0] == "value":
            return BINDING * max(g.abs().max().item() for g in grads)
        return BINDING * torch.nn.utils.get_total_norm(grads).item()

    def backward(self, micro_batches: list[dict[str, Any]]) -> None:
        for batch in micro_batches:
            self.evict(batch)
            _loss(self.model(batch), batch["target"]).backward()

    def evict(self, batch: dict[str, Any]) -> None:
        """The managed tables' evictions of ``batch`` (:class:`Remapper`), before it is looked up."""
        for key, rows in batch.get("evict", {}).items():
            evict_rows(self.model.tables[key].weight, self.optimizers + self.users, rows)

    def step(self, micro_batches: list[dict[str, Any]], bound: float | None,
             grads: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """One step; ``grads`` (by parameter name) in place of this model's own backward. Returns
        the gradients it stepped on (before clipping)."""
        if grads is None:
            self.backward(micro_batches)
        else:
            for batch in micro_batches:
                self.evict(batch)
            for name, param in self.model.named_parameters():
                if name in grads:
                    param.grad = grads[name].to(param.dtype)
        used = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        if self.config.clip is not None:
            members = self.clip_set()
            if self.config.clip[0] == "norm":
                try:
                    torch.nn.utils.clip_grad_norm_(members, bound, error_if_nonfinite=self.config.non_finite)
                except RuntimeError:  # a non-finite norm: the loop skips the step
                    self.model.zero_grad(set_to_none=True)
                    return used
            else:
                torch.nn.utils.clip_grad_value_(members, bound)
        for key in self.lazy:  # the touched rows, coalesced: what a lazy table steps on
            weight = self.model.tables[key].weight
            touched = torch.unique(torch.cat([b[f][1] for b in micro_batches for t in self.config.tables
                                              if t.key == key for f in t.features]))
            weight.grad = torch.sparse_coo_tensor(touched[None], weight.grad[touched], weight.shape).coalesce()
            _adam_eps(self.lazy[key], OPTIMIZERS["adam"][1]["eps"])
        for optimizer in self.optimizers + self.users:
            optimizer.step()
        with torch.no_grad():
            for optimizer in self.bf16_state:  # low-precision state: each state tensor rounded after the step
                for state in optimizer.state.values():
                    for value in state.values():
                        if torch.is_tensor(value) and value.dim():
                            value.copy_(value.to(torch.bfloat16))
            for t in self.config.tables:  # stored in low precision: the step's one rounding
                if t.precision != "fp32":
                    weight = self.model.tables[t.key].weight
                    weight.copy_(weight.to(PRECISIONS[t.precision][1]).to(weight.dtype))
        for scheduler in self.schedulers:
            scheduler.step()
        self.model.zero_grad(set_to_none=True)
        return used


def _adam_eps(optimizer: torch.optim.SparseAdam, eps: float) -> None:
    """Set ``optimizer``'s eps for its next step to what ``torch.optim.Adam``'s ``eps`` is there.
    SparseAdam adds eps to the uncorrected ``sqrt(v)``, Adam to the corrected one: Adam's update at
    step ``t`` is SparseAdam's with ``eps * sqrt(1 - beta2**t)``. Unscaled, they differ by up to
    ``lr * 30 eps / |g|``: 9.5e-5 on an element whose terms cancel to 1.6e-8 (make test-matrix, seed 4680)."""
    for group in optimizer.param_groups:
        (param,) = group["params"]
        step = optimizer.state[param].get("step", 0) + 1
        group["eps"] = eps * math.sqrt(1 - group["betas"][1] ** step)


def _ulp_jitter(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each gradient with every element moved by up to two float32 roundings of its largest element:
    what summing its terms in another order may do to a small element (terms as large as the
    largest element, cancelling). A row that is all zeros (one no id touched) stays so: it sums
    no terms in any order (jittered, an Adagrad row would move by the whole lr)."""
    generator = torch.Generator().manual_seed(7)
    out = {}
    for name, g in grads.items():
        if g.is_sparse or not g.numel():
            out[name] = g
            continue
        noise = (torch.rand(g.shape, generator=generator, dtype=torch.float64) * 2 - 1) * 2.0**-23
        touched = g.ne(0).any(dim=-1, keepdim=True) if g.dim() > 1 else g.ne(0)
        out[name] = (g.double() + noise * g.double().abs().max() * touched).to(g.dtype)
    return out


def schedule(step: int) -> float:
    """A warm-up, then a decay: every step a new lr."""
    return (step + 1) / 3 if step < 2 else 0.6 ** (step - 1)


# -- ours --


def _sharding_types(config: Config, other_plan: bool) -> dict[str, str]:
    """Each table's sharding type; ``other_plan``: another model-parallel type for each
    model-parallel table, that keeps the table's semantics and splits it as its optimizer allows."""
    if not other_plan:
        return {t.name: t.sharding for t in config.tables}  # a second EBC's table of the same name: the same
    swap = {"table_wise": "row_wise", "row_wise": "table_wise", "column_wise": "table_wise",
            "table_row_wise": "column_wise", "table_column_wise": "row_wise"}
    out: dict[str, str] = {}
    for t in config.tables:  # tables of one name share one type (TorchRec's constraints go by name)
        new = out.get(t.name, t.sharding if t.managed else swap.get(t.sharding, t.sharding))
        if not t.bagged and new not in EC_SHARDING_TYPES:
            new = "table_wise"
        if config.vbe and t.mean and new in ("row_wise", "table_row_wise"):  # refused (docs/refusals.md)
            new = "column_wise"
        if t.optimizer == "rowwise_adagrad_wd" and new in ("column_wise", "table_column_wise"):
            new = "table_wise"
        out[t.name] = new
    return out


EBC_SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")
EC_SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "row_wise")


class Ours:
    """The TorchRec model, annotated, clipped and sharded as a user would, and its optimizers."""

    def __init__(self, config: Config, weights: dict[str, torch.Tensor], dense: nn.Module, bound: float | None,
                 other_plan: bool = False) -> None:
        import overlap_optim

        self.config, self.weights, self.dense = config, weights, dense
        model = Model(config, "meta" if config.meta else "cpu")
        if not config.meta:
            self._copy_dense(model.dense.parameters())
        self.unsharded = model
        tables = model.tables()
        for t in config.tables:
            weight = tables[t.key].weight
            if t.optimizer == "frozen":
                weight.requires_grad_(False)
            elif t.optimizer != "user":
                path, kwargs, _, _ = OPTIMIZERS[t.optimizer]
                overlap_optim.apply_optimizer_in_backward(_class(path), [weight], kwargs,
                                                          state_dtype=_state_dtype(t.state_bf16),
                                                          group_options=GROUP_OPTIONS.get(path))
        if config.dense_part not in ("user", "user_ddp"):
            path, kwargs = DENSE_OPTIMIZERS[config.dense_optimizer]
            overlap_optim.apply_optimizer_in_backward(_class(path), model.dense.parameters(), kwargs,
                                                      state_dtype=_state_dtype(config.dense_state_bf16),
                                                      group_options=GROUP_OPTIONS.get(path))
        self.clip = None
        if config.clip is not None:
            members = [tables[t.key].weight for t in config.tables if t.optimizer != "frozen"]
            members += list(model.dense.parameters()) if config.clip[1] == "everything" else []
            how = ({"max_norm": bound, "error_if_nonfinite": config.non_finite} if config.clip[0] == "norm"
                   else {"clip_value": bound})
            self.clip = overlap_optim.apply_gradient_clipping(members, **how)
        self.mesh = None
        if config.dense_part in ("tp", "tp_fsdp"):  # the user's tensor parallelism, once annotated and clipped
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            self.mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
            parallelize_module(model.dense, self.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if config.meta == "materialize":
            overlap_optim.materialize(model, "cpu")
        elif config.meta == "to_empty":
            model.to_empty(device="cpu")
        if config.meta in ("materialize", "to_empty"):  # values as a user's init would set them
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
            self._copy_dense(model.dense.parameters())
        self.other_plan = other_plan
        self.pipeline = None  # made at the first step (config.pipeline)

    def _copy_dense(self, params: Any) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for src, dst in zip(self.dense.parameters(), params):
                dst.copy_(distribute_tensor(src, dst.device_mesh, dst.placements) if isinstance(dst, DTensor) else src)

    def shard(self) -> Ours:
        """Shard the annotated model under DMP (our sharders and, with the hook, our wrapper)."""
        import overlap_optim
        import sharders
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

        config, model = self.config, self.unsharded
        def dense_tables(bagged: bool) -> list[str]:
            return [f"{t.collection}.{t.name}" if config.qualified else t.name
                    for t in config.tables if t.dense and t.bagged == bagged]
        sharder_list = []
        fused_params = dict(config.fused_params) or None
        if any(t.bagged for t in config.tables):
            sharder_list.append(sharders.EmbeddingBagCollectionSharder(fused_params, dense_tables=dense_tables(True),
                                                                       variable_batch=config.vbe))
        if any(not t.bagged for t in config.tables):
            sharder_list.append(sharders.EmbeddingCollectionSharder(fused_params, dense_tables=dense_tables(False)))
        if any(t.managed for t in config.tables):  # over the EBCs' sharder: one runs all their tables
            sharder_list.append(sharders.ManagedCollisionEmbeddingBagCollectionSharder(sharder_list[0]))
        types = _sharding_types(config, self.other_plan)
        constraints = {n: ParameterConstraints(sharding_types=[s], min_partition=4) for n, s in types.items()}
        world = dist.get_world_size()
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu", local_world_size=world), constraints=constraints,
        )
        plan = planner.collective_plan(model, sharder_list, dist.group.WORLD)
        for t in config.tables:  # a hand-made plan
            if t.kernel is not None:
                plan.plan[t.collection][t.name].compute_kernel = t.kernel
        wrapper = {"data_parallel_wrapper": sharders.DataParallelWrapper()}
        if config.dense_part == "user_ddp":
            wrapper = {}
        elif config.dense_part == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            wrapper = {"data_parallel_wrapper": sharders.FullyShardWrapper(mesh=init_device_mesh("cpu", (world,)))}
        elif config.dense_part in ("tp", "tp_fsdp"):
            wrapper = {"data_parallel_wrapper": sharders.FullyShardWrapper(mesh=self.mesh["dp"])
                       if config.dense_part == "tp_fsdp" else _TensorParallelOnly()}
        self.dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharder_list,
                                            **wrapper)
        if config.meta == "dmp":  # DMP materialized the MLP: its values are still to set
            state = self.dmp.state_dict()
            self._copy_dense(state[f"dense.{name}"] for name, _ in self.dense.named_parameters())
        with torch.no_grad():  # sharding re-initialises tables
            for t in config.tables:
                full = self.weights[t.key]
                for row, col, piece in self.pieces(t):
                    piece.copy_(full[row : row + piece.shape[0], col : col + piece.shape[1]])
        self.keyed = overlap_optim.get_optimizers(self.dmp)
        users = overlap_optim.unoptimized_parameters(self.dmp)
        self.user = _class(USER_OPTIMIZER[0])(list(users.values()), **USER_OPTIMIZER[1]) if users else None
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(self.keyed, schedule)] if config.schedule else []
        return self

    def pieces(self, table: Table) -> list[tuple[int, int, torch.Tensor]]:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        value = self.dmp.state_dict()[table.fqn]
        if isinstance(value, ShardedTensor):
            return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
        return [(0, 0, value)]

    def step(self, micro_batches: list[dict[str, Any]]) -> None:
        import overlap_optim

        batches = [Batch(kjts(self.config, b), b["target"]) for b in micro_batches]
        if self.config.pipeline is not None:
            if self.pipeline is None:
                from torchrec.distributed.train_pipeline import train_pipelines

                self.pipeline = getattr(train_pipelines, self.config.pipeline)(self.dmp, self.keyed, torch.device("cpu"))
            remaining = iter(batches)
            backward = functools.partial(self.pipeline.progress, remaining)  # forward, backward, keyed.step()
        else:
            remaining = iter(batches)
            backward = lambda: self.dmp(next(remaining))[0].backward()  # noqa: E731
        try:
            for index in range(len(batches)):
                if index < len(batches) - 1:
                    with overlap_optim.no_step(self.dmp):
                        backward()
                else:
                    backward()
        except RuntimeError as err:
            if not (self.config.non_finite and "so they cannot be clipped" in str(err)):
                raise
            # the loop skips the batch, as the reference's does: no step() (a refused step needs none), and
            # neither the user's optimizer nor a scheduler steps
            if self.user is not None:
                self.user.zero_grad()
            return
        if self.config.pipeline is None:
            self.keyed.step()
        if self.user is not None:
            self.user.step()
            self.user.zero_grad()
        for scheduler in self.schedulers:
            scheduler.step()

    def dense_state(self) -> dict[str, torch.Tensor]:
        state = self.dmp.state_dict()
        return {k[len("dense."):]: v for k, v in state.items() if k.startswith("dense.")}


def _checkpoint(ours: Ours, config: Config, weights: dict[str, torch.Tensor], dense: nn.Module,
                bound: float | None, directory: str, again: Callable[[], None]) -> Ours:
    """The checkpoint of ``config`` taken mid-run; the objects that train on from it. ``again``
    trains ``ours`` one more step (what a rollback undoes)."""
    if config.checkpoint == "in_place":
        ours.keyed.load_state_dict(ours.keyed.state_dict())
        return ours
    scheduler_state = [s.state_dict() for s in ours.schedulers]
    if config.checkpoint == "rollback":  # saved (torch.save), trained on, then loaded back in place
        model_buffer, optim_buffer = io.BytesIO(), io.BytesIO()
        torch.save(ours.dmp.state_dict(), model_buffer)
        torch.save(ours.keyed.state_dict(), optim_buffer)
        again()
        model_buffer.seek(0)
        optim_buffer.seek(0)
        ours.dmp.load_state_dict(torch.load(model_buffer, weights_only=False))
        ours.keyed.load_state_dict(torch.load(optim_buffer, weights_only=False))
        for scheduler, state in zip(ours.schedulers, scheduler_state):
            scheduler.load_state_dict(state)
        return ours
    if config.checkpoint == "torch_save":
        model_buffer, optim_buffer = io.BytesIO(), io.BytesIO()
        torch.save(ours.dmp.state_dict(), model_buffer)
        torch.save(ours.keyed.state_dict(), optim_buffer)
        fresh = Ours(config, _scrambled(weights), _scrambled_dense(dense), bound).shard()
        model_buffer.seek(0)
        optim_buffer.seek(0)
        fresh.dmp.load_state_dict(torch.load(model_buffer, weights_only=False))
        fresh.keyed.load_state_dict(torch.load(optim_buffer, weights_only=False))
    elif config.checkpoint == "other_plan":  # overlap_optim.checkpoint, loaded under another plan
        from overlap_optim import checkpoint

        checkpoint.save(directory, ours.dmp, ours.keyed, {"step": 1})
        fresh = Ours(config, _scrambled(weights), _scrambled_dense(dense), bound, other_plan=True).shard()
        checkpoint.load(directory, fresh.dmp, fresh.keyed, {})
    else:  # plain torch.distributed.checkpoint, as users write it; the optimizer held in memory
        import torch.distributed.checkpoint as dcp

        path = os.path.join(directory, "dcp-" + hashlib.sha1(repr(config).encode()).hexdigest()[:10])
        saved = ours.keyed.state_dict()
        dcp.save({"model": ours.dmp.state_dict(), "optim": saved}, checkpoint_id=path)
        other = config.checkpoint != "dcp"
        fresh = Ours(config, _scrambled(weights), _scrambled_dense(dense), bound, other_plan=other).shard()
        from overlap_optim import checkpoint

        # torch's default planner, as users write it; but where the optimizer keeps no tensor (SGD without
        # momentum, only the user's optimizer) and a table has no piece on a rank, torch's own planner cannot
        # read a nested entry without tensors (docs/checkpoints.md): ours, which keeps ShardedTensors whole
        planner = None if _holds_tensors(saved["state"]) else checkpoint.LoadPlanner()
        if config.checkpoint == "dcp":  # torch's recipe: fill fresh state dicts in place, then load them
            state = {"model": fresh.dmp.state_dict(), "optim": fresh.keyed.state_dict()}
            dcp.load(state, checkpoint_id=path, planner=planner)
            fresh.dmp.load_state_dict(state["model"])
            fresh.keyed.load_state_dict(state["optim"])
        elif config.checkpoint == "dcp_other_plan":  # the objects themselves: DCP calls load_state_dict
            dcp.load({"model": fresh.dmp, "optim": fresh.keyed}, checkpoint_id=path, planner=planner)
        else:  # "state_dict_other_plan": the weights through DCP, the optimizer's state dict from memory
            dcp.load({"model": fresh.dmp}, checkpoint_id=path, planner=checkpoint.LoadPlanner())
            fresh.keyed.load_state_dict(saved)
    for scheduler, state in zip(fresh.schedulers, scheduler_state):
        scheduler.load_state_dict(state)
    # The user's SGD keeps no state (no momentum); its parameters are listed by position, which
    # another plan changes: nothing of it to carry over.
    assert ours.user is None or not ours.user.state
    return fresh


def _holds_tensors(state: dict[str, Any]) -> bool:
    return any(isinstance(v, torch.Tensor) or hasattr(v, "local_shards") for s in state.values() for v in s.values())


def _scrambled(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.randn_like(v) for k, v in weights.items()}


def _scrambled_dense(dense: nn.Module) -> nn.Module:
    other = copy.deepcopy(dense)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    return other


# -- the rank body --


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """Weights (of meta parameters, the shape), and each parameter's annotation, of the unsharded model.
    Where ``to_empty`` replaced an annotated meta parameter, the annotation the user declared: the
    one a sharder carries over first (the one change a refused call may make)."""
    from overlap_optim import meta_params
    from overlap_optim.record import group_of

    declared = {fqn: old for fqn, old, now in meta_params.replaced(model, forget=False) if now is not None}
    return {n: (p.shape if p.is_meta else p.detach().clone(), group_of(declared.get(n, p)),
                getattr(declared.get(n, p), "_optimizer_classes", None)) for n, p in model.named_parameters()}


def _unchanged(before: dict[str, Any], model: nn.Module) -> bool:
    after = _snapshot(model)
    return before.keys() == after.keys() and all(
        type(before[n][0]) is type(after[n][0]) and (before[n][0] == after[n][0] if isinstance(before[n][0], torch.Size)
                                                     else torch.equal(before[n][0], after[n][0]))
        and before[n][1] is after[n][1] and before[n][2] == after[n][2]
        for n in before
    )


def run(rank: int, world_size: int, config: Config, directory: str, resume: bool = False) -> dict[str, Any]:
    """:func:`train`, with the compiled operators or, for ``config.compiled=False``, without them."""
    with contextlib.nullcontext() if config.compiled else without_compiled_operators():
        return train(rank, world_size, config, directory, resume)


def train(rank: int, world_size: int, config: Config, directory: str, resume: bool = False) -> dict[str, Any]:
    """Train ``config`` sharded and as the reference, side by side; compare after every step.

    Returns ``{"outcome": "exact", "diffs": {table or "dense": [max diff per step]}, "moved":
    {...}, "noise": {table: how far the float32 reference is from the same in float64}}``, or ``{"outcome": "refused", "stage": ..., "error": "Type: message", "unchanged":
    bool}`` for a ValueError, TypeError or NotImplementedError raised at annotation, sharding or
    the first step (anything else propagates: a crash is a failure).

    With ``checkpoint="one_rank"`` the run saves mid-run (``overlap_optim.checkpoint``) and returns
    ``"resume": True``; ``resume=True`` (on one rank) then replays the reference to that step, loads
    the checkpoint into a model sharded for one rank, and trains on with the global batch.
    """
    torch.manual_seed(config.seed)
    weights = {t.key: torch.randn(t.rows, DIM).to(PRECISIONS[t.precision][1]).float() for t in config.tables}
    dense = Model(config).dense
    reference = ReferenceTrainer(config, Reference(config, weights, dense))
    # The same reference in float64: how far float32 rounding alone takes the reference (an
    # ill-conditioned update, LAMB on a one-row table, moves 1e-5 from it in one step).
    exact = ReferenceTrainer(config, Reference(config, {k: v.double() for k, v in weights.items()},
                                               copy.deepcopy(dense).double()).double())
    # And in float32 on the reference's own gradients, each element moved by up to two roundings of the
    # largest (what another summation order may do): how far a gradient as accurate as the reference's
    # takes the update (LAMB in its eps regime turns a 2e-8 difference in a gradient into 1.2e-5).
    rounded = ReferenceTrainer(config, Reference(config, weights, dense))
    noise: dict[str, float] = {}
    from_exact: dict[str, float] = {}  # ours from the float64 reference
    start = {n: p.detach().clone() for n, p in reference.model.named_parameters()}

    remapper = Remapper(config)

    def globally(step: int, parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The reference's micro-batches of ``step``: every rank's samples, managed tables' ids remapped."""
        return [remapper(step, micro, global_batch(p)) for micro, p in enumerate(parts)]

    def micro_batches(step: int) -> list[list[dict[str, Any]]]:
        generator = torch.Generator().manual_seed(1000 * config.seed + 10 * step)
        out = [[make_batch(config, generator) for _ in range(config.world_size)] for _ in range(config.micro)]
        if config.dense_part in ("tp", "tp_fsdp"):  # one data-parallel replica: every rank reads the same batch
            out = [[copy.deepcopy(parts[0]) for _ in parts] for parts in out]
        if config.non_finite and step == 1:
            for parts in out:
                for batch in parts:
                    batch["target"] = torch.full_like(batch["target"], math.inf)
        return out

    bound = None
    if config.clip is not None:
        bound = reference.bound(globally(0, micro_batches(0)))
    middle = (config.steps - 1) // 2
    diffs: dict[str, list[float]] = {}
    dense_state = {"ulps": 0, "flipped": 0, "elements": 0, "dtypes": []}  # the MLP's BF16 state against the reference's
    if resume:
        for step in range(middle + 1):
            parts = micro_batches(step)
            exact.step([_double(b) for b in globally(step, parts)], bound)
            rounded.step(globally(step, parts), bound, _ulp_jitter(reference.step(globally(step, parts), bound)))
        ours = _resumed_on_one_rank(config, weights, dense, bound, directory)
        _compare(ours, reference, diffs, dense_state)
    else:
        try:
            ours = Ours(config, weights, dense, bound)
        except (ValueError, TypeError, NotImplementedError) as err:
            return _refused("annotate", err, True)
        before = _snapshot(ours.unsharded)
        try:
            ours.shard()
        except (ValueError, TypeError, NotImplementedError) as err:
            return _refused("shard", err, _unchanged(before, ours.unsharded))
    for step in range(middle + 1 if resume else 0, config.steps):
        parts = micro_batches(step)
        try:
            ours.step([global_batch(p) for p in parts] if resume else [p[rank] for p in parts])
        except (ValueError, TypeError, NotImplementedError) as err:
            if step == 0:
                _compare(ours, reference, diffs)  # the reference has not stepped: all zero if nothing changed
                return _refused("first step", err, all(d == [0.0] for d in diffs.values()))
            return _refused("later step", err, False)  # only a refusal that depends on the values may
        rounded.step(globally(step, parts), bound, _ulp_jitter(reference.step(globally(step, parts), bound)))
        exact.step([_double(b) for b in globally(step, parts)], bound)
        for t in config.tables:
            weight = reference.model.tables[t.key].weight.double()
            gap = max((weight - exact.model.tables[t.key].weight).abs().max().item(),
                      (weight - rounded.model.tables[t.key].weight.double()).abs().max().item())
            noise[t.key] = max(noise.get(t.key, 0.0), gap)
            ours_gap = max([(piece.double() - exact.model.tables[t.key].weight.detach()[r : r + piece.shape[0],
                                                                                       c : c + piece.shape[1]]).abs().max().item()
                            for r, c, piece in ours.pieces(t) if piece.numel()] or [0.0])
            from_exact[t.key] = max(from_exact.get(t.key, 0.0), ours_gap)
        # the MLP too: Adam on a gradient that micro-batches nearly cancel amplifies summation order
        gap = max(max((a.double() - b).abs().max().item(), (a - c).abs().max().item()) for a, b, c in
                  zip(reference.model.dense.parameters(), exact.model.dense.parameters(),
                      rounded.model.dense.parameters()))
        noise["dense"] = max(noise.get("dense", 0.0), gap)
        mine = ours.dense_state()
        from_exact["dense"] = max(from_exact.get("dense", 0.0), max(
            ((v.full_tensor() if hasattr(v := mine[n], "full_tensor") else v).double() - b).abs().max().item()
            for n, b in exact.model.dense.named_parameters()))
        _compare(ours, reference, diffs, dense_state)
        if config.checkpoint == "one_rank" and step == middle and not resume:
            _save_for_one_rank(ours, config, directory)
            break
        if config.checkpoint not in (None, "one_rank") and step == middle:
            ours = _checkpoint(ours, config, weights, dense, bound, directory,
                               lambda: ours.step([p[rank] for p in micro_batches(step + 1)]))
            _compare(ours, reference, diffs, dense_state)
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.model.named_parameters()}
    # one unit in the last place of the stored dtype, at the largest weight: where the float32 sums of the
    # reference and ours come in another order, the one rounding may differ by that much
    ulp = {t.key: torch.finfo(PRECISIONS[t.precision][1]).eps * 2.0 ** math.floor(math.log2(max(
        reference.model.tables[t.key].weight.abs().max().item(), 2.0**-14)))
        for t in config.tables if t.precision != "fp32"}
    for t in config.tables:  # BF16 state: a state element rounded the other way moves an update by ~ lr * 2^-8
        if t.state_bf16:
            ulp[t.key] = max(ulp.get(t.key, 0.0), _flipped_state(OPTIMIZERS[t.optimizer][1]["lr"], config))
    # A BF16-state table further from the reference than the tolerance (its own check allows it that far:
    # a state element rounded the other way, an ill-conditioned update) feeds every later forward: it moves
    # the loss's next gradients, and through them every other parameter's updates, as a flipped element of
    # the MLP's state does below (make test-matrix seed 3141: LAMB on a two-row table 8e-4 off, within its
    # own bound; then the MLP 3e-5 and an Adagrad table 1.6e-5 off).
    for t in config.tables:
        if t.state_bf16 and _largest_on_any_rank(max(diffs.get(t.key, [0.0]))) > TOL:  # its pieces may be elsewhere
            ulp = {key: max(ulp.get(key, 0.0), _flipped_state(OPTIMIZERS[t.optimizer][1]["lr"], config)) for key in diffs}
    if dense_state["flipped"]:  # the MLP's next updates, and through them every table's, moved by a flipped element
        lr = DENSE_OPTIMIZERS[config.dense_optimizer][1]["lr"]
        ulp = {key: max(ulp.get(key, 0.0), _flipped_state(lr, config)) for key in diffs}
    # the sharded collections the pipeline runs the input dist of ahead (TorchRec leaves out what it cannot trace)
    pipelined = None if ours.pipeline is None else len(ours.pipeline._pipelined_modules)
    return {"outcome": "exact", "diffs": diffs, "moved": moved, "noise": noise, "from_exact": from_exact, "ulp": ulp,
            "dense_state": dense_state, "resume": config.checkpoint == "one_rank" and not resume,
            "pipelined": pipelined}


def _largest_on_any_rank(value: float) -> float:
    """The largest of ``value`` over the ranks (a collective: every rank calls it alike)."""
    found = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.item()


def _state_dtype(bf16: bool) -> torch.dtype | None:
    return torch.bfloat16 if bf16 else None


def _flipped_state(lr: float, config: Config) -> float:
    """How far BF16 state may take a weight from the reference: a state element whose float32 value
    lies near a tie, rounded the other way here (its float32 sums come in another order), moves the
    next updates by up to ``lr`` times one BF16 unit (2^-7 of the element), every step after."""
    return lr * 2.0**-7 * config.steps


def _one_rank_directory(config: Config, directory: str) -> str:
    return os.path.join(directory, "one_rank-" + hashlib.sha1(repr(config).encode()).hexdigest()[:10])


def _save_for_one_rank(ours: Ours, config: Config, directory: str) -> None:
    from overlap_optim import checkpoint

    extra = {"scheduler": ours.schedulers[0]} if ours.schedulers else {}
    checkpoint.save(_one_rank_directory(config, directory), ours.dmp, ours.keyed, {**extra, "step": 1})


def _resumed_on_one_rank(config: Config, weights: dict[str, torch.Tensor], dense: nn.Module, bound: float | None,
                         directory: str) -> Ours:
    """A model sharded for this one rank, with the checkpoint that :func:`_save_for_one_rank` wrote."""
    from overlap_optim import checkpoint

    fresh = Ours(config, _scrambled(weights), _scrambled_dense(dense), bound).shard()
    checkpoint.load(_one_rank_directory(config, directory), fresh.dmp, fresh.keyed,
                    {"scheduler": fresh.schedulers[0]} if fresh.schedulers else {})
    return fresh


def _double(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch for the float64 reference."""
    return {k: v.double() if k == "target" else v if k == "evict" else (v[0], v[1], None if v[2] is None else v[2].double())
            for k, v in batch.items() if k != "vbe"}


def _refused(stage: str, err: BaseException, unchanged: bool) -> dict[str, Any]:
    return {"outcome": "refused", "stage": stage, "error": f"{type(err).__name__}: {err}", "unchanged": unchanged}


def _compare(ours: Ours, reference: ReferenceTrainer, diffs: dict[str, list[float]],
             dense_state: dict[str, Any] | None = None) -> None:
    """Each table's and the MLP's largest difference from the reference, appended to ``diffs``; with
    ``dense_state`` and BF16 state on the MLP, that state too (:func:`_compare_dense_state`)."""
    if dense_state is not None and reference.config.dense_state_bf16:
        _compare_dense_state(ours, reference, dense_state)
    for t in reference.config.tables:
        full = reference.model.tables[t.key].weight.detach()
        worst = 0.0
        for row, col, piece in ours.pieces(t):
            if piece.numel():
                want = full[row : row + piece.shape[0], col : col + piece.shape[1]]
                worst = max(worst, (piece - want).abs().max().item())
        diffs.setdefault(t.key, []).append(worst)
    state = ours.dense_state()
    worst = 0.0
    for name, ref in reference.model.dense.named_parameters():
        value = state[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        worst = max(worst, (value - ref.detach()).abs().max().item())
    diffs.setdefault("dense", []).append(worst)


def _compare_dense_state(ours: Ours, reference: ReferenceTrainer, out: dict[str, Any]) -> None:
    """Ours' MLP state against the reference's, rounded to BF16 after each step: in ``out``, the largest
    distance in BF16 units, how many elements differ (a float32 value near a tie, rounded the other way
    here), of how many compared, and ours' dtypes."""
    state = ours.keyed.state_dict()["state"]
    for name, param in reference.model.dense.named_parameters():
        for key, value in reference.dense_optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim():
                mine = state[f"dense.{name}"][key]
                mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
                out["dtypes"] = sorted({*out["dtypes"], str(mine.dtype)})
                theirs = value.to(torch.bfloat16)
                out["ulps"] = max(out["ulps"], _bf16_units(mine.to(torch.bfloat16), theirs))
                out["flipped"] += int(mine.to(torch.bfloat16).ne(theirs).sum())
                out["elements"] += theirs.numel()


def _bf16_units(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between two BF16 tensors in BF16 units, each element's unit taken at its
    magnitude, but never below 2^-8 of the tensors' largest (BF16's precision): an element a flip
    carried into a cancellation near zero is as far as the flip was (one unit at the magnitude it had:
    seed 3579, Adam's exp_avg at -6.0e-6 against -5.9e-6 where the largest is 0.14, four units at its own)."""
    a, b = a.float(), b.float()
    largest = max(a.abs().max().item(), b.abs().max().item(), 2.0**-126)
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), torch.full_like(a, largest * 2.0**-8))
    return ((a - b).abs() / torch.exp2(torch.floor(torch.log2(scale)) - 7)).max().item() if a.numel() else 0.0


def new_directory() -> str:
    """A scratch directory for checkpoints, made in the parent (every rank writes under it)."""
    return tempfile.mkdtemp(prefix="overlap-matrix-", dir=os.environ.get("TMPDIR"))
