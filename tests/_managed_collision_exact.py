"""Rank bodies for tests/test_managed_collision.py: managed-collision collections under our sharders
against one process of torch.optim (spawned; not collected by pytest).

The model: a managed-collision collection (EBC or EC) over one table ``t`` of 8 rows, row_wise on
2 ranks (4 rows each), remapped by an MCH module that evicts at every step (ids 0-39 compete for
8 slots), and an SGD head.

The reference (:class:`_Reference`) is one process that remaps and evicts as the sharded module
does, written from TorchRec's documented behaviour, not from our code:

- each id goes to the row shard of its input bucket (block bucketization: ``id // ceil(40 / 2)``),
  in the global batch's order (rank 0's samples, then rank 1's);
- each shard's MCH module is the original rebuilt with its output range
  (``rebuild_with_output_id_range``, as TorchRec's sharder does); it profiles and remaps its ids,
  then names the slots it evicts;
- an evicted slot's weight is re-initialised with the table's ``init_fn`` and its ``torch.optim``
  state set to a fresh row's (written here per optimizer: Adagrad's ``sum`` its
  ``initial_accumulator_value``, Adam's moments zero, ``step`` left to count), before the batch
  is looked up;
- the plain collection looks up the remapped ids, and ``torch.optim`` steps the whole table.
"""

from __future__ import annotations

import copy
import io
import math

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

import overlap_optim
import sharders

ROWS, DIM, INPUT = 8, 4, 40
HEAD = (torch.optim.SGD, {"lr": 0.1})
# case -> (bagged, optimizer, kwargs, dense_tables, fresh state per name (None: per-table, left alone))
SETTINGS = {
    "ebc_adagrad_fused": (True, torch.optim.Adagrad, {"lr": 0.1}, False, {"sum": 0.0, "step": None}),
    "ebc_adagrad_initial": (True, torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}, False,
                            {"sum": 0.1, "step": None}),
    "ebc_adam_dense": (True, torch.optim.Adam, {"lr": 0.05}, True,
                       {"exp_avg": 0.0, "exp_avg_sq": 0.0, "step": None}),
    "ec_adagrad_fused": (False, torch.optim.Adagrad, {"lr": 0.1}, False, {"sum": 0.0, "step": None}),
    "ec_adam_dense": (False, torch.optim.Adam, {"lr": 0.05}, True, {"exp_avg": 0.0, "exp_avg_sq": 0.0, "step": None}),
}


def reinit(weight: torch.Tensor) -> torch.Tensor:
    """The table's ``init_fn``: deterministic, so that an evicted slot's new weight is the same in
    both processes, and different per element."""
    with torch.no_grad():
        return weight.copy_(torch.linspace(-0.3, 0.3, weight.numel()).view_as(weight))


class MCModel(nn.Module):
    def __init__(self, bagged: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bagged = bagged
        if bagged:
            inner = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"], init_fn=reinit)])
            configs = inner.embedding_bag_configs()
        else:
            inner = EmbeddingCollection(tables=[EmbeddingConfig(
                name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"], init_fn=reinit)])
            configs = inner.embedding_configs()
        with torch.no_grad():
            self.table(inner).weight.normal_(0, 0.3)
        collision = ManagedCollisionCollection(
            managed_collision_modules={"t": MCHManagedCollisionModule(
                zch_size=ROWS, device=torch.device("cpu"), eviction_interval=1, input_hash_size=INPUT, buckets=2,
                eviction_policy=DistanceLFU_EvictionPolicy())},
            embedding_configs=configs,
        )
        kind = ManagedCollisionEmbeddingBagCollection if bagged else ManagedCollisionEmbeddingCollection
        self.mc = kind(inner, collision, return_remapped_features=False)
        self.head = nn.Linear(DIM, 1)

    def table(self, inner: nn.Module) -> nn.Module:
        return inner.embedding_bags["t"] if self.bagged else inner.embeddings["t"]

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.mc(kjt)
        return self.head(pooled(out, self.bagged)).squeeze(1)


def pooled(out, bagged: bool) -> torch.Tensor:
    """Per sample: the bag (EBC), or each id's embedding weighted by 1 / (1 + its position) (EC)."""
    if bagged:
        return out["f"]
    dense = out["f"].to_padded_dense(desired_length=3)  # (batch, 3, DIM)
    return (dense / torch.arange(1, 4, dtype=dense.dtype).view(1, 3, 1)).sum(1)


def batches(steps: int, world_size: int, seed: int = 5, wide: tuple[int, ...] = (0,)) -> list[list[tuple]]:
    """Per step, per rank: 3 samples of 1-3 ids in 0..39 (each step brings ids new to the slots). At the
    steps ``wide``, sample 0 holds all 40 ids: TorchRec's MCH module sizes its history buffer by the first
    batch it profiles (1.25 times its ids) and leaves out of the count the ids of a later batch beyond it,
    so the first batch after building, or after loading a checkpoint, is wide."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        parts = []
        for _ in range(world_size):
            lengths = torch.randint(1, 4, (3,), generator=generator)
            values = torch.randint(0, INPUT, (int(lengths.sum()),), generator=generator)
            if step in wide:
                values = torch.cat([torch.randperm(INPUT, generator=generator), values[lengths[0]:]])
                lengths[0] = INPUT
            parts.append((KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=values, lengths=lengths),
                          torch.randn(3, generator=generator)))
        out.append(parts)
    return out


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    kjt, target = batch
    return (model(kjt) - target).pow(2).mean()


class _Reference:
    """One process of TorchRec's remapping and torch.optim (see the module doc)."""

    def __init__(self, model: MCModel, world_size: int, case: str) -> None:
        bagged, cls, kwargs, _, self.fresh = SETTINGS[case]
        self.model, self.world_size = model, world_size
        inner = model.mc._embedding_module
        self.collection, self.weight = inner, model.table(inner).weight
        mch = model.mc._managed_collision_collection._managed_collision_modules["t"]
        per = math.ceil(ROWS / world_size)
        bounds = [min(r * per, ROWS) for r in range(world_size + 1)]
        self.shards = [mch.rebuild_with_output_id_range((bounds[r], bounds[r + 1]), output_segments=bounds,
                                                        device=torch.device("cpu")) for r in range(world_size)]
        for shard in self.shards:
            shard.train()
        self.opt = cls([self.weight], **kwargs)
        self.head_opt = HEAD[0](model.head.parameters(), **HEAD[1])
        self.evicted: list[int] = []

    def step(self, parts) -> None:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.cat([p[0].values() for p in parts]),
            lengths=torch.cat([p[0].lengths() for p in parts]))
        target = torch.cat([p[1] for p in parts])
        ids = kjt.values()
        block = math.ceil(INPUT / self.world_size)
        remapped = torch.empty_like(ids)
        for rank, shard in enumerate(self.shards):
            mine = (ids // block) == rank
            values = ids[mine]
            jt = shard.remap(shard.profile({"t": JaggedTensor(
                values=values, lengths=torch.tensor([values.numel()]), weights=torch.tensor([values.numel()]))}))
            remapped[mine] = jt["t"].values()
            evicted = shard.evict()
            if evicted is not None and evicted.numel():
                self._reset(evicted.long())
        remapped_kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=remapped, lengths=kjt.lengths())
        out = self.collection(remapped_kjt)
        loss = (self.model.head(pooled(out, self.model.bagged)).squeeze(1) - target).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.head_opt.step()
        self.opt.zero_grad()
        self.head_opt.zero_grad()

    def _reset(self, rows: torch.Tensor) -> None:
        self.evicted.extend(rows.tolist())
        with torch.no_grad():
            self.weight[rows] = reinit(self.weight[rows].clone())
            state = self.opt.state.get(self.weight, {})
            for name, value in state.items():
                if self.fresh[name] is not None:
                    value[rows] = self.fresh[name]


def build(rank: int, world_size: int, case: str):
    """Our sharded model (our planner and both our sharders, DMP), its optimizer, and the reference."""
    bagged, cls, kwargs, dense, _ = SETTINGS[case]
    model = MCModel(bagged)
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(cls, [model.table(model.mc._embedding_module).weight], kwargs)
    overlap_optim.apply_optimizer_in_backward(HEAD[0], model.head.parameters(), HEAD[1])
    inner = (sharders.EmbeddingBagCollectionSharder if bagged else sharders.EmbeddingCollectionSharder)(
        dense_tables={"t"} if dense else ())
    mc = (sharders.ManagedCollisionEmbeddingBagCollectionSharder(inner) if bagged
          else sharders.ManagedCollisionEmbeddingCollectionSharder(inner))
    topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)
    plan = sharders.EmbeddingShardingPlanner(
        topology=topology, constraints={"t": ParameterConstraints(sharding_types=["row_wise"])},
    ).collective_plan(model, [mc], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[mc],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    ref_weight = reference.table(reference.mc._embedding_module).weight
    with torch.no_grad():  # sharding re-initialises the table
        for shard in _local_shards(dmp):
            row = shard.metadata.shard_offsets[0]
            shard.tensor.copy_(ref_weight[row : row + shard.tensor.shape[0]])
    return dmp, overlap_optim.get_optimizers(dmp), _Reference(reference, world_size, case)


def _local_shards(dmp):
    key = next(k for k in dmp.state_dict() if k.endswith("t.weight") and "_managed_collision" not in k)
    return dmp.state_dict()[key].local_shards()


def _diff(dmp, ref: _Reference) -> float:
    weight = ref.weight.detach()
    diff = 0.0
    for shard in _local_shards(dmp):
        row = shard.metadata.shard_offsets[0]
        diff = max(diff, (shard.tensor - weight[row : row + shard.tensor.shape[0]]).abs().max().item())
    head = dict(dmp.named_parameters())
    for name, param in ref.model.head.named_parameters():
        ours = next(v for k, v in head.items() if k.endswith(f"head.{name}"))
        diff = max(diff, (ours.detach() - param.detach()).abs().max().item())
    return diff


def exact(rank: int, world_size: int, case: str, steps: int = 6) -> dict:
    """``steps`` steps side by side; per step the largest difference, and how far the reference moved."""
    dmp, _, ref = build(rank, world_size, case)
    start = ref.weight.detach().clone()
    diffs = _beside(dmp, ref, rank, batches(steps, world_size))
    return {"diffs": diffs, "moved": (ref.weight.detach() - start).abs().max().item(), "evicted": len(ref.evicted)}


def exact_cases(rank: int, world_size: int) -> dict:
    return {case: exact(rank, world_size, case) for case in SETTINGS}


def _beside(dmp, ref: _Reference, rank: int, data) -> list[float]:
    """A step of ours (this rank's part) and of the reference (the global batch) per entry of ``data``;
    the difference after each."""
    diffs = []
    for parts in data:
        loss_of(dmp, parts[rank]).backward()
        ref.step(parts)
        diffs.append(_diff(dmp, ref))
    return diffs


def _round_trip(dmp, opt, into=None, between=None) -> None:
    """The model's and the optimizer's state dicts through ``torch.save``, loaded into ``into`` (a
    (model, optimizer) pair; None: the same ones), after ``between()``."""
    buffer = io.BytesIO()
    torch.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, buffer)
    if between is not None:
        between()
    model, optimizer = into or (dmp, opt)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])


def checkpoint_into_a_fresh_model(rank: int, world_size: int, case: str = "ebc_adam_dense", steps: int = 3) -> dict:
    """``steps`` steps side by side; the model's and the optimizer's state dicts saved (torch.save) and
    loaded into a fresh model and optimizer on the same plan, which goes on for ``steps`` more steps
    beside the reference. Returns the differences after the load, and whether the saved state dict
    holds the remapping (the MCH module's buffers)."""
    dmp, opt, ref = build(rank, world_size, case)
    data = batches(2 * steps, world_size, wide=(0, steps))
    _beside(dmp, ref, rank, data[:steps])
    remapping = sorted(k.rsplit(".", 1)[-1] for k in dmp.state_dict() if "_managed_collision_modules" in k)
    fresh, fresh_opt, _ = build(rank, world_size, case)
    _round_trip(dmp, opt, into=(fresh, fresh_opt))
    return {"diffs": _beside(fresh, ref, rank, data[steps:]), "remapping": remapping, "evicted": len(ref.evicted)}


def _global(parts) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Every rank's samples, rank after rank: what one rank trains on in their place."""
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.cat([p[0].values() for p in parts]),
                                              lengths=torch.cat([p[0].lengths() for p in parts]))
    return kjt, torch.cat([p[1] for p in parts])


def resharded_save(rank: int, world_size: int, directory: str, case: str = "ebc_adam_dense", steps: int = 3) -> dict:
    """The first half of :func:`resharded_resume`: ``steps`` steps on ``world_size`` ranks beside the
    reference, then ``overlap_optim.checkpoint.save``."""
    from overlap_optim import checkpoint

    dmp, opt, ref = build(rank, world_size, case)
    diffs = _beside(dmp, ref, rank, batches(2 * steps, world_size, wide=(0, steps))[:steps])
    checkpoint.save(directory, dmp, opt, {})
    return {"diffs": diffs}


def resharded_resume(rank: int, world_size: int, directory: str, case: str = "ebc_adam_dense") -> dict:
    """A model sharded for ``world_size`` (1) meets what :func:`resharded_save` wrote on 2 ranks: each
    shard's module remaps into its own slots, and TorchRec would merge the saved slots (measured: the
    merged run ends 3.2-4.1 off the reference), so it is refused. Returns the error of
    ``overlap_optim.checkpoint.load`` and whether the model and the optimizer are as before; the error
    of ``dcp.load`` of the objects (which writes the model's tensors in place before its
    ``load_state_dict`` refuses), and that of the next forward."""
    import torch.distributed.checkpoint as dcp

    from overlap_optim import checkpoint

    dmp, opt, _ = build(rank, world_size, case)
    before = (_copied(dmp.state_dict()), _copied(opt.state_dict()))

    def error_of(call) -> str:
        try:
            call()
            return "no error"
        except ValueError as err:
            return str(err)
    ours = error_of(lambda: checkpoint.load(directory, dmp, opt, {}))
    unchanged = before == (_copied(dmp.state_dict()), _copied(opt.state_dict()))
    path = str(checkpoint.latest(directory))
    plain = error_of(lambda: dcp.load({"model": dmp}, checkpoint_id=path, planner=checkpoint.LoadPlanner()))
    kjt, target = _global(batches(1, 2)[0])
    forward = error_of(lambda: loss_of(dmp, (kjt, target)))
    return {"checkpoint.load": ours, "unchanged": unchanged, "dcp.load": plain, "forward": forward}


def _copied(state: dict) -> dict:
    """Comparable copies of a state dict's values (a ShardedTensor's local shards, nested dicts)."""
    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    if hasattr(state, "local_shards"):
        return tuple(s.tensor.clone().tolist() for s in state.local_shards())
    if isinstance(state, torch.Tensor):
        return state.clone().tolist()
    return state


def rolled_back_in_place(rank: int, world_size: int, case: str = "ebc_adagrad_fused", steps: int = 3) -> dict:
    """``steps`` steps beside the reference; the state dicts saved (torch.save), one step more, then
    loaded back in place, and ``steps`` more beside the reference (which never took the extra step)."""
    dmp, opt, ref = build(rank, world_size, case)
    data = batches(2 * steps, world_size)
    _beside(dmp, ref, rank, data[:steps])
    _round_trip(dmp, opt, between=lambda: loss_of(dmp, data[steps][rank]).backward())  # the step undone
    return {"diffs": _beside(dmp, ref, rank, data[steps:]), "evicted": len(ref.evicted)}
