"""Rank bodies for batches with a variable batch size per feature (VBE) (spawned; not collected)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "rowwise_adagrad": ("torchrec.optim.rowwise_adagrad.RowWiseAdagrad", {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "lamb": ("pytorch_optimizer.Lamb", {"lr": 0.05, "weight_decay": 0.01}),  # cross-shard on split tables
    "adafactor": (torch.optim.Adafactor, {"lr": 0.05}),
}
ROWS, DIM, BATCH = 8, 8, 4


def _class(value):
    if isinstance(value, str):
        module, _, name = value.rpartition(".")
        return getattr(__import__(module, fromlist=[name]), name)
    return value


def _batch(step: int, rank: int, uneven: bool = False) -> tuple[KeyedJaggedTensor, torch.Tensor, list[tuple]]:
    """This rank's VBE batch: feature f has 2 distinct bags, g has 3 (``uneven``: on rank 1, 3 and
    2), expanded to BATCH samples by inverse indices; the loss weights; and, per feature, (ids,
    offsets, inverse) for the reference."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    features, lengths, values = [], [], []
    counts = (3, 2) if uneven and rank == 1 else (2, 3)
    for bags in counts:
        own = torch.randint(1, 4, (bags,), generator=generator)
        ids = torch.randint(0, ROWS, (int(own.sum()),), generator=generator)
        inverse = torch.randint(0, bags, (BATCH,), generator=generator)
        features.append((ids, torch.cat([torch.zeros(1, dtype=torch.long), own.cumsum(0)[:-1]]), inverse))
        lengths.append(own)
        values.append(ids)
    kjt = KeyedJaggedTensor(
        keys=["f", "g"], values=torch.cat(values), lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[c] for c in counts],
        inverse_indices=(["f", "g"], torch.stack([f[2] for f in features])),
    )
    return kjt, torch.randn(BATCH, 2 * DIM, generator=generator), features


def train(rank: int, world_size: int, optimizer: str, sharding_type: str, steps: int = 3,
          variable_batch: bool = False, uneven: bool = False, mean: bool = False, fp16: bool = False,
          split: str | None = None) -> dict:
    """One table, looked up by two features with different batch sizes, trained against torch.optim
    on the global batch: the first error ("Type: message") and its step ("shard" at sharding), or
    each step's largest difference and how far the reference moved. ``variable_batch``: the
    sharder's option; ``mean``: MEAN pooling; ``fp16``: the table stored in FP16 (only refusals are
    compared); ``split``: two tables instead, ``t`` for feature f and ``u`` for g, ``u`` annotated
    with the optimizer of that name at half its learning rate (two kernels in one lookup)."""
    import overlap_optim
    import sharders
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    torch.manual_seed(0)
    features = {"t": ["f"], "u": ["g"]} if split else {"t": ["f", "g"]}
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=ROWS, feature_names=names,
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM,
                           data_type=DataType.FP16 if fp16 else DataType.FP32)
        for name, names in features.items()])
    references = {name: torch.nn.EmbeddingBag(ROWS, DIM, mode="mean" if mean else "sum") for name in features}
    ref_opts = []
    for name, reference in references.items():
        with torch.no_grad():
            reference.weight.copy_(ebc.embedding_bags[name].weight)
        cls, kwargs = OPTIMIZERS[optimizer if name == "t" else split]
        kwargs = kwargs if name == "t" else {**kwargs, "lr": kwargs["lr"] / 2}
        overlap_optim.apply_optimizer_in_backward(_class(cls), ebc.embedding_bags[name].parameters(), kwargs)
        ref_opts.append(_class(cls)(reference.parameters(), **kwargs))
    table_of = {f: name for name, names in features.items() for f in names}
    sharder = sharders.EmbeddingBagCollectionSharder(variable_batch=variable_batch)
    try:
        plan = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
            constraints={n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n in features},
        ).collective_plan(ebc, [sharder], dist.group.WORLD)
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    except ValueError as err:
        return {"error": f"{type(err).__name__}: {err}", "step": "shard"}
    with torch.no_grad():
        for name, reference in references.items():
            for row, col, piece in _pieces(dmp, name):
                piece.copy_(reference.weight[row : row + piece.shape[0], col : col + piece.shape[1]])
    start, diffs = {n: r.weight.detach().clone() for n, r in references.items()}, []
    for step in range(steps):
        kjt, weights, _ = _batch(step, rank, uneven)
        try:
            out = dmp(kjt)
            out = out.wait() if hasattr(out, "wait") else out
            ((out.values() * weights).sum() / BATCH).backward()
        except (ValueError, NotImplementedError) as err:
            return {"error": f"{type(err).__name__}: {err}", "step": step}
        total = 0.0
        for r in range(world_size):  # the reference: every rank's samples; TorchRec averages over ranks
            _, w, bags = _batch(step, r, uneven)
            pooled = [references[table_of[f]](ids, offsets)[inverse] for f, (ids, offsets, inverse) in zip("fg", bags)]
            total = total + (torch.cat(pooled, dim=1) * w).sum() / BATCH / world_size
        total.backward()
        for ref_opt in ref_opts:
            ref_opt.step()
            ref_opt.zero_grad()
        pieces = [(n, *piece) for n in references for piece in _pieces(dmp, n)]
        diffs.append(max((p - references[n].weight.detach()[r : r + p.shape[0], c : c + p.shape[1]]).abs().max().item()
                         for n, r, c, p in pieces if p.numel()) if pieces else 0.0)
    return {"diffs": diffs, "moved": min((r.weight.detach() - start[n]).abs().max().item() for n, r in references.items())}


def _pieces(dmp, name="t"):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    value = dmp.state_dict()[f"embedding_bags.{name}.weight"]
    if isinstance(value, ShardedTensor):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
    return [(0, 0, value)]
