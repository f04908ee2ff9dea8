"""Rank bodies for ``sharders.from_torchrec`` (spawned; not collected by pytest).

Stock TorchRec (its sharders; FBGEMM's fused optimizers through ``fused_params`` or through
TorchRec's ``apply_optimizer_in_backward``) trains a few steps beside one process of
torch.optim; its ``fused_optimizer.state_dict()`` is converted and loaded into ours (same plan
or another), and ours, stock and torch.optim then go on side by side.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder as StockEcSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as StockEbcSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward as torchrec_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import overlap_optim
import sharders
from _models import ManySequenceModel, ManyTableModel, concat_batches, covering_batch, loss_of
from _reshard_bodies import _local_snapshot, _same
from _sharded_parity import build, local_pieces

LR, EPS = 0.1, 1e-8
# Stock's optimizer of each table, and the torch.optim annotation of ours that computes its update.
STOCK = {"adagrad": EmbOptimType.EXACT_ADAGRAD, "rowwise": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
         "sgd": EmbOptimType.EXACT_SGD}
OURS = {"adagrad": (torch.optim.Adagrad, {"lr": LR, "eps": EPS}), "rowwise": (RowWiseAdagrad, {"lr": LR, "eps": EPS}),
        "sgd": (torch.optim.SGD, {"lr": LR})}
NAMES = list(STOCK)
# Stock's plan (row-wise Adagrad on column shards keeps a statistic per shard: not convertible),
# and another plan for ours: every table in another sharding type, row-wise Adagrad data-parallel.
PLAN = {"adagrad": "column_wise", "rowwise": "row_wise", "sgd": "table_wise"}
OTHER_PLAN = {"adagrad": "row_wise", "rowwise": "data_parallel", "sgd": "column_wise"}
EC_PLAN = {"adagrad": "row_wise", "rowwise": "table_wise", "sgd": "row_wise"}
EC_OTHER_PLAN = {"adagrad": "table_wise", "rowwise": "row_wise", "sgd": "column_wise"}
STOCK_STEPS, OUR_STEPS = 3, 4
FAMILIES = {"ebc": (ManyTableModel, StockEbcSharder), "ec": (ManySequenceModel, StockEcSharder)}


def _with_row_wise(sharder_class):
    """Stock's sharder, offering row-wise types on CPU too (FBGEMM_NOTES: exact on gloo)."""
    class Sharder(sharder_class):
        def sharding_types(self, compute_device_type):
            return [*super().sharding_types(compute_device_type), "row_wise", "table_row_wise"]
    return Sharder


def _stock(names, types, world_size, family, fused_params=None, annotations=None):
    """(stock DMP, unsharded reference, its torch.optim optimizers) from one seed. ``annotations``:
    table -> (class, kwargs) through TorchRec's own in-backward path (FBGEMM gets the kwargs as they are)."""
    model_class, sharder_class = FAMILIES[family]
    model = model_class(names)
    reference = copy.deepcopy(model)
    for name, (cls, kwargs) in (annotations or {}).items():
        torchrec_in_backward(cls, model.tables[name].parameters(), dict(kwargs))
    sharder = _with_row_wise(sharder_class)(fused_params=fused_params)
    types = types if isinstance(types, dict) else dict.fromkeys(names, types)
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=[types[n]], min_partition=4) for n in names},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    _set_tables(dmp, reference, names)
    ref_opts = [OURS[n][0](reference.tables[n].parameters(), **OURS[n][1]) for n in names if n in OURS]
    return dmp, reference, ref_opts


def _set_tables(dmp, reference, names):
    """Every local piece of ``dmp``'s tables from the unsharded ``reference`` (sharding re-initialises them;
    later, as a model checkpoint would)."""
    with torch.no_grad():
        for name in names:
            ref = reference.tables[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])


def _parts(names, world_size, step):
    """Each rank's batch: even steps touch every row, odd steps only rows below 5 (lazy rows stay)."""
    generator = torch.Generator().manual_seed(500 + step)
    full = step % 2 == 0
    return [covering_batch(names, generator, rows=12 if full else 5, cover=full) for _ in range(world_size)]


def _diff(dmp, reference, names):
    """The largest difference of any local piece of ``dmp``'s tables from ``reference``'s."""
    out = 0.0
    for name in names:
        ref = reference.tables[name].weight.detach()
        for row, col, piece in local_pieces(dmp, name):
            out = max(out, (piece - ref[row : row + piece.shape[0], col : col + piece.shape[1]]).abs().max().item())
    return out


def _step(models, reference, ref_opts, names, world_size, rank, step):
    parts = _parts(names, world_size, step)
    for model in models:
        loss_of(model, parts[rank]).backward()
        if getattr(model, "_stock_fused", False):
            model.fused_optimizer.step()  # stock applies a changed lr here; FBGEMM updated in backward
    loss_of(reference, concat_batches(parts)).backward()
    for opt in ref_opts:
        opt.step()
    reference.zero_grad()


def continue_from_stock(rank, world_size, source, family="ebc", other_plan=False):
    """Stock trains STOCK_STEPS steps (``source``: "fused_params", one stock model per optimizer,
    or "annotations", TorchRec's in-backward path with one optimizer per table); its state is
    converted into ours (same plan, or another, ``other_plan``) and ours, stock and torch.optim
    go on OUR_STEPS steps. Returns per step the largest difference of ours from torch.optim,
    of stock from torch.optim and of ours from stock, how far torch.optim moved the tables
    after the conversion, and the converted step."""
    plan = EC_PLAN if family == "ec" else PLAN
    ours_plan = (EC_OTHER_PLAN if family == "ec" else OTHER_PLAN) if other_plan else plan
    groups = [NAMES] if source == "annotations" else [[n] for n in NAMES]
    out = {"ours": [], "stock": [], "ours_vs_stock": [], "stock_before": [], "moved": {}, "step": []}
    for names in groups:
        fused = None if source == "annotations" else {"optimizer": STOCK[names[0]], "learning_rate": LR, "eps": EPS}
        annotations = {n: OURS[n] for n in names} if fused is None else None
        stock, reference, ref_opts = _stock(names, plan, world_size, family, fused, annotations)
        stock._stock_fused = True
        for step in range(STOCK_STEPS):
            _step([stock], reference, ref_opts, names, world_size, rank, step)
            out["stock_before"].append(_diff(stock, reference, names))
        saved = stock.fused_optimizer.state_dict()
        ours, _, _ = build(names, [OURS[n] for n in names], {n: ours_plan[n] for n in names}, world_size,
                           family=family, seed=1)
        _set_tables(ours, reference, names)
        with torch.no_grad():  # ours was built from another seed: the MLP as a model checkpoint would bring it
            state = ours.state_dict()
            for key, value in reference.dense.state_dict().items():
                state[f"dense.{key}"].copy_(value)
        converted = sharders.from_torchrec(saved, ours, fused, annotations=annotations, step=STOCK_STEPS)
        out["step"] += [float(s["step"]) for s in converted["state"].values() if "step" in s]
        keyed = overlap_optim.get_optimizers(ours)
        keyed.load_state_dict(converted)
        start = {n: reference.tables[n].weight.detach().clone() for n in names}
        for step in range(STOCK_STEPS, STOCK_STEPS + OUR_STEPS):
            _step([ours, stock], reference, ref_opts, names, world_size, rank, step)
            out["ours"].append(_diff(ours, reference, names))
            out["stock"].append(_diff(stock, reference, names))
            out["ours_vs_stock"].append(_diff(ours, _Tables(stock, names), names))
        out["moved"].update({n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in names})
    return out


class _Tables:
    """A stand-in for an unsharded model: ``tables[name].weight``, gathered whole from a sharded one."""

    def __init__(self, dmp, names):
        from types import SimpleNamespace

        from overlap_optim._state_schema import whole_tensor

        state = dmp.state_dict()  # a collective: every rank gathers every table
        weights = {n: state[dmp.module.table_key(n)] for n in names}
        self.tables = {n: SimpleNamespace(weight=whole_tensor(w) if hasattr(w, "local_shards") else w)
                       for n, w in weights.items()}


# -- refusals --

REFUSAL_NAMES = ["eps", "other", "sgd"]


def refused(rank, world_size):
    """Stock, table_wise (each rank holds its own tables, so each rank's state dict has other keys):
    table "eps" on FBGEMM's Adagrad with its default eps (the annotation gives none), "other" on
    row-wise Adagrad, "sgd" on SGD. Ours: Adagrad with torch's default eps, Adagrad, SGD: refused
    by table and setting. Then bad input, one case on rank 1 only, against ours annotated to match.
    Returns each error and whether ours (trained a step) was unchanged."""
    stock_settings = {"eps": (torch.optim.Adagrad, {"lr": LR}), "other": (RowWiseAdagrad, {"lr": LR}),
                      "sgd": (torch.optim.SGD, {"lr": LR})}
    stock, _, _ = _stock(REFUSAL_NAMES, "table_wise", world_size, "ebc", annotations=stock_settings)
    loss_of(stock, covering_batch(REFUSAL_NAMES, torch.Generator().manual_seed(rank))).backward()
    saved = stock.fused_optimizer.state_dict()
    out = {"keys": sorted(saved["state"])}
    mismatched, _, _ = build(REFUSAL_NAMES, [(torch.optim.Adagrad, {"lr": LR})] * 2 + [(torch.optim.SGD, {"lr": LR})],
                             "table_wise", world_size)
    matching, _, _ = build(REFUSAL_NAMES, [(torch.optim.Adagrad, {"lr": LR, "eps": EPS}),
                                           (RowWiseAdagrad, {"lr": LR, "eps": EPS}), (torch.optim.SGD, {"lr": LR})],
                           "table_wise", world_size, seed=1)
    snapshots = []
    for ours in (mismatched, matching):
        keyed = overlap_optim.get_optimizers(ours)
        loss_of(ours, covering_batch(REFUSAL_NAMES, torch.Generator().manual_seed(9))).backward()  # state to keep
        snapshots.append((ours, keyed, _local_snapshot(ours, keyed)))
    out["settings"] = _error(lambda: sharders.from_torchrec(saved, mismatched, annotations=stock_settings))
    broken = {"state": {k: dict(v) for k, v in saved["state"].items()}}
    if rank == 1:  # a check that fails on this rank only
        key = next(iter(broken["state"]))
        broken["state"][key] = {n: "not a tensor" for n in broken["state"][key]}
    out["one_rank"] = _error(lambda: sharders.from_torchrec(broken, matching, annotations=stock_settings))
    out["no_settings"] = _error(lambda: sharders.from_torchrec(saved, matching))
    out["bad_step"] = _error(lambda: sharders.from_torchrec(saved, matching, annotations=stock_settings, step=-1))
    out["not_a_dict"] = _error(lambda: sharders.from_torchrec([saved], matching, annotations=stock_settings))
    out["unsupported"] = _error(lambda: sharders.from_torchrec(saved, matching, {"optimizer": EmbOptimType.ADAM}))
    out["weight_decay"] = _error(lambda: sharders.from_torchrec(
        saved, matching, {"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.01}, annotations=stock_settings))
    out["unchanged"] = []
    for ours, keyed, before in snapshots:
        same = _same(before, _local_snapshot(ours, keyed))
        out["unchanged"].append(same)
    out["entries"] = [len(before) for _, _, before in snapshots]
    out["matching"] = _error(lambda: overlap_optim.get_optimizers(matching).load_state_dict(
        sharders.from_torchrec(saved, matching, annotations=stock_settings)))
    return out


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
