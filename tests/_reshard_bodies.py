"""Rank bodies for the sharded checkpoint tests (spawned; not collected by pytest).

One model, eight tables and an annotated MLP, each table annotated in its own
call (nine param groups, nine LR schedules). Plan A and plan B put every table in
a different sharding type, and plan B pins a fusable table to the fallback. The
layer-wise tables go from row shards to column shards (Adafactor's factors change
from sharded to whole and back) and then to one rank.
"""

from __future__ import annotations

import copy

import torch
from came_pytorch import CAME
from pytorch_optimizer import Lamb
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import overlap_optim
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from _sharded_parity import build, compare
from overlap_optim import apply_optimizer_in_backward, checkpoint

NAMES = ["adagrad", "rowwise", "adam", "sgd_m", "sgd", "adafactor", "lamb", "came"]
SETTINGS = [
    (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-10}),
    (RowWiseAdagrad, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.02}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adafactor, {"lr": 0.05}),  # factored state: row_var (R, 1), col_var (1, C)
    (Lamb, {"lr": 0.05, "weight_decay": 0.01}),  # its step counter lives in the param group
    (CAME, {"lr": 0.05}),  # factored state as vectors: (R,) and (C,)
]
DENSE = (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1})
PLAN_A = {"adagrad": "table_wise", "rowwise": "row_wise", "adam": "column_wise", "sgd_m": "data_parallel",
          "sgd": "table_row_wise", "adafactor": "row_wise", "lamb": "column_wise", "came": "row_wise"}
PLAN_B = {"adagrad": "row_wise", "rowwise": "table_wise", "adam": "row_wise", "sgd_m": "table_wise",
          "sgd": "data_parallel", "adafactor": "column_wise", "lamb": "row_wise", "came": "column_wise"}
PINNED_B = ("adagrad",)  # fused in plan A, fallback in plan B
SAVED_AT, STEPS, WORLD = 3, 6, 2
ATOL = 1e-6


def schedules():
    """One schedule per param group: tables in order, then the MLP; warmup then decay, each its own."""
    return [
        (lambda s, i=i: min(1.0, (s + 1) / (2 + i)) * (0.9 - 0.05 * i) ** s) for i in range(len(NAMES) + 1)
    ]


def global_batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return [covering_batch(NAMES, generator) for _ in range(WORLD)]


class _Reference:
    """The unsharded model under plain torch.optim with the same schedules, on the global batch."""

    def __init__(self, reference, ref_opts):
        self.model, self.opts = reference, ref_opts
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(ref_opts, schedules())]
        self.start = {n: p.detach().clone() for n, p in reference.named_parameters()}

    def step(self, step):
        loss_of(self.model, concat_batches(global_batch(step))).backward()
        for opt, sched in zip(self.opts, self.scheds):
            opt.step()
            sched.step()
        self.model.zero_grad()

    def moved(self):
        return min(  # every annotated parameter moved (dense.2 has no optimizer)
            (p.detach() - self.start[n]).abs().max().item()
            for n, p in self.model.named_parameters()
            if not n.startswith("dense.2.")
        )


def _sharded(plan, world_size, pinned=(), seed=0):
    dmp, reference, ref_opts = build(NAMES, SETTINGS, plan, world_size, dense=DENSE, pinned_dense=pinned, seed=seed)
    keyed = overlap_optim.get_optimizers(dmp)
    return dmp, keyed, torch.optim.lr_scheduler.LambdaLR(keyed, schedules()), _Reference(reference, ref_opts)


def _train(dmp, keyed, sched, reference, rank, world_size, steps):
    for step in steps:
        parts = global_batch(step)
        batch = parts[rank] if world_size == WORLD else concat_batches(parts)
        loss_of(dmp, batch).backward()
        keyed.step()
        sched.step()
        reference.step(step)
        compare(dmp, reference.model, NAMES, step, atol=ATOL)


def layout(keyed):
    """{(key, state name): shape, or type for a plain value (LAMB's step count)} of a keyed
    optimizer's state dict, and its param groups' keys."""
    state = keyed.state_dict()
    shapes = {(k, n): tuple(v.size()) if torch.is_tensor(v) else type(v).__name__
              for k, s in state["state"].items() for n, v in s.items()}
    return shapes, [g["params"] for g in state["param_groups"]]


def unsharded_layout():
    """The same layout for the unsharded model under apply_optimizer_in_backward, after one step."""
    model = ManyTableModel(NAMES)
    for name, (cls, kwargs) in zip(NAMES, SETTINGS):
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    apply_optimizer_in_backward(DENSE[0], model.dense[0].parameters(), DENSE[1])
    loss_of(model, concat_batches(global_batch(0))).backward()
    return layout(overlap_optim.get_optimizers(model))


def save_then_reshard(rank, world_size, directory):
    """Plan A trains, saves at SAVED_AT; plan B (other seed) loads and continues; both
    compared with the reference after every step."""
    dmp, keyed, sched, reference = _sharded(PLAN_A, world_size)
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT))
    layout_a = layout(keyed)
    checkpoint.save(directory, dmp, keyed, {"scheduler": sched, "step": SAVED_AT})
    del dmp
    resumed, keyed_b, sched_b, _ = _sharded(PLAN_B, world_size, pinned=PINNED_B, seed=1)
    extras = checkpoint.load(directory, resumed, keyed_b, {"scheduler": sched_b})
    compare(resumed, reference.model, NAMES, "after load", atol=ATOL)
    layout_b = layout(keyed_b)
    _train(resumed, keyed_b, sched_b, reference, rank, world_size, range(SAVED_AT, STEPS))
    return {
        "refusal": _refused_without_change(directory, world_size),
        "layout_a": layout_a, "layout_b": layout_b, "unsharded": unsharded_layout(), "step": extras["step"],
        "moved": reference.moved(), "describe_b": __import__("sharders").describe(resumed),
    }


def load_on_one_rank(rank, world_size, directory):
    """The 2-rank checkpoint, loaded on 1 rank (all tables table_wise) and into the unsharded model."""
    dmp, keyed, sched, _ = _sharded(dict.fromkeys(NAMES, "table_wise"), world_size, seed=1)
    reference = _reference_at(SAVED_AT)
    unsharded = ManyTableModel(NAMES, seed=2)
    for name, (cls, kwargs) in zip(NAMES, SETTINGS):
        apply_optimizer_in_backward(cls, unsharded.ebc.embedding_bags[name].parameters(), kwargs)
    apply_optimizer_in_backward(DENSE[0], unsharded.dense[0].parameters(), DENSE[1])
    unsharded_opt = overlap_optim.get_optimizers(unsharded)
    unsharded_sched = torch.optim.lr_scheduler.LambdaLR(unsharded_opt, schedules())
    checkpoint.load(directory, unsharded, unsharded_opt, {"scheduler": unsharded_sched})
    checkpoint.load(directory, dmp, keyed, {"scheduler": sched})
    compare(dmp, reference.model, NAMES, "after load", atol=ATOL)
    twin = copy.deepcopy(reference.model.state_dict())
    unsharded_diff = max((unsharded.state_dict()[k] - v).abs().max().item() for k, v in twin.items())
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT, STEPS))
    return {"unsharded_diff": unsharded_diff, "layout": layout(keyed), "moved": reference.moved()}


def _reference_at(step):
    """The reference of a run from plan A's seed, trained ``step`` steps."""
    model = ManyTableModel(NAMES)
    ref_opts = [cls(model.ebc.embedding_bags[n].parameters(), **kw) for n, (cls, kw) in zip(NAMES, SETTINGS)]
    reference = _Reference(model, ref_opts + [DENSE[0](model.dense[0].parameters(), **DENSE[1])])
    for done in range(step):
        reference.step(done)
    return reference


def _refused_without_change(directory, world_size):
    """Table "adam" now has Adagrad: the load is refused, naming it, and nothing changes."""
    settings = [(torch.optim.Adagrad, {"lr": 0.1}) if n == "adam" else st for n, st in zip(NAMES, SETTINGS)]
    dmp, _, _ = build(NAMES, settings, PLAN_B, world_size, dense=DENSE, seed=3)
    keyed = overlap_optim.get_optimizers(dmp)
    loss_of(dmp, global_batch(0)[0]).backward()  # some state to compare
    before = _local_snapshot(dmp, keyed)
    try:
        checkpoint.load(directory, dmp, keyed)
    except checkpoint.CheckpointError as err:
        message = str(err)
    else:
        message = "no error"
    same = _same(before, _local_snapshot(dmp, keyed))
    return {"message": message, "unchanged": same, "entries": len(before)}


def _local_snapshot(dmp, keyed):
    """Every local piece of every weight and optimizer state tensor, copied, and the hyperparameters."""
    def pieces(value):
        if hasattr(value, "local_shards"):
            return [s.tensor.clone() for s in value.local_shards()]
        return [value.clone()] if torch.is_tensor(value) else []

    out = {f"hypers.{i}": {k: v for k, v in g.items() if k != "params"} for i, g in enumerate(keyed.param_groups)}
    for key, value in dmp.state_dict().items():
        out.update({f"model.{key}.{i}": t for i, t in enumerate(pieces(value))})
    for key, state in keyed.state_dict()["state"].items():
        for name, value in state.items():
            out.update({f"optim.{key}.{name}.{i}": t for i, t in enumerate(pieces(value))})
    return out


def _weights_from(dmp, reference):
    """Set every local piece of ``dmp``'s tables and its MLP from the unsharded ``reference``."""
    from _sharded_parity import local_pieces

    with torch.no_grad():
        for name in NAMES:
            ref = reference.ebc.embedding_bags[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
        state = dmp.state_dict()
        for key, value in reference.dense.state_dict().items():
            state[f"dense.{key}"].copy_(value)


def state_dict_then_reshard(rank, world_size, directory=None):
    """Plan A trains; its keyed optimizer's ``state_dict()``, held in memory, is loaded with
    ``load_state_dict`` into plan B (another seed; weights set from the reference, as a model
    checkpoint would); B trains on, compared with the reference after every step. Then a state
    dict that fails a check on rank 1 only: both ranks refuse it alike, and nothing changes."""
    dmp, keyed, sched, reference = _sharded(PLAN_A, world_size)
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT))
    saved, saved_sched = keyed.state_dict(), sched.state_dict()
    resumed, keyed_b, sched_b, _ = _sharded(PLAN_B, world_size, pinned=PINNED_B, seed=1)
    loss_of(resumed, global_batch(0)[rank]).backward()  # state of its own, to be replaced
    _weights_from(resumed, reference.model)
    keyed_b.load_state_dict(saved)
    sched_b.load_state_dict(saved_sched)
    _train(resumed, keyed_b, sched_b, reference, rank, world_size, range(SAVED_AT, STEPS))
    broken = {"state": dict(saved["state"]), "param_groups": saved["param_groups"]}
    if rank == 1:  # a check that fails on this rank only
        broken["state"]["dense.0.weight"] = {**saved["state"]["dense.0.weight"], "exp_avg": torch.zeros(3)}
    message, same = _refused_load(resumed, keyed_b, broken)
    return {"moved": reference.moved(), "refusal": message, "unchanged": same}


def _refused_load(dmp, keyed, state_dict):
    """``keyed.load_state_dict(state_dict)``: its ValueError's message ("no error" if none), and
    whether every local piece of every weight and state tensor is as it was."""
    before = _local_snapshot(dmp, keyed)
    try:
        keyed.load_state_dict(state_dict)
        message = "no error"
    except ValueError as err:
        message = str(err)
    return message, _same(before, _local_snapshot(dmp, keyed))


def plain_dcp(rank, world_size, directory):
    """Plan A trains and saves with plain DCP, as TorchRec users write it: ``dcp.save({"model":
    dmp.state_dict(), "optim": keyed.state_dict(), "sched": sched.state_dict()})``. Fresh objects
    (another seed) load it three ways, and each trains on, compared with the reference after every
    step: under plan A by torch's recipe (fill fresh state dicts in place, then ``load_state_dict``);
    under plan B through DCP's Stateful protocol (``dcp.load`` of the objects themselves); and under
    plan A filled in place but never loaded, which the next forward refuses with nothing trained,
    then loaded. On the main of 2026-11-26 the fresh state dict had no lazy state to fill, and SGD's
    momentum came back 0.0875 off, Adam's 0.026, Adafactor's 0.033."""
    import os

    import torch.distributed.checkpoint as dcp

    dmp, keyed, sched, reference = _sharded(PLAN_A, world_size)
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT))
    path = os.path.join(directory, "plain-dcp")
    dcp.save({"model": dmp.state_dict(), "optim": keyed.state_dict(), "sched": sched.state_dict()}, checkpoint_id=path)
    planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False)  # tables held by the other rank
    out = {}
    for form, plan, pinned in (("recipe", PLAN_A, ()), ("stateful", PLAN_B, PINNED_B), ("unloaded", PLAN_A, ())):
        twin = _reference_at(SAVED_AT)
        resumed, keyed_b, sched_b, _ = _sharded(plan, world_size, pinned=pinned, seed=1)
        if form == "stateful":
            dcp.load({"model": resumed, "optim": keyed_b, "sched": sched_b}, checkpoint_id=path, planner=planner)
        else:
            state = {"model": resumed.state_dict(), "optim": keyed_b.state_dict(), "sched": sched_b.state_dict()}
            dcp.load(state, checkpoint_id=path, planner=planner)
            resumed.load_state_dict(state["model"])
            sched_b.load_state_dict(state["sched"])
            if form == "unloaded":
                before = _local_snapshot(resumed, keyed_b)
                try:
                    loss_of(resumed, global_batch(SAVED_AT)[rank]).backward()
                    out["refusal"] = "no error"
                except RuntimeError as err:
                    out["refusal"] = str(err)
                out["unchanged"] = _same(before, _local_snapshot(resumed, keyed_b))
            keyed_b.load_state_dict(state["optim"])
        _train(resumed, keyed_b, sched_b, twin, rank, world_size, range(SAVED_AT, STEPS))
        out[form] = twin.moved()
    return out


PLAN_TABLE_WISE = dict.fromkeys(NAMES, "table_wise")


def plain_dcp_same_plan(rank, world_size, directory):
    """Every table table_wise (each rank holds some tables whole, and no piece of the others): plan
    A trains and saves with plain DCP, ``dcp.save({"model": dmp.state_dict(), "optim":
    keyed.state_dict(), "sched": ...})``. Fresh objects under the same plan (another seed) load it
    with torch's default planner, as users write it, two ways: torch's recipe (fill fresh state
    dicts in place, then ``load_state_dict``) and DCP's Stateful protocol (``dcp.load`` of the
    objects themselves). Each trains on, compared with the reference after every step. On the main
    of 2026-11-27 both raised "Missing key in checkpoint state_dict: optim.param_groups" on both
    ranks: torch's default planner drops a ShardedTensor with no piece on the rank, takes the
    missing key for a checkpoint written before torch 2.4, and re-reads the template in that
    layout, where a list of param-group dicts is one entry.

    Then a checkpoint in the layout written before this fix (``param_groups`` a list: one entry per
    hyperparameter), loaded into fresh state dicts with ``overlap_optim.checkpoint.LoadPlanner``,
    which reads it in its own layout; and torch's ``get_state_dict`` of the model and optimizer,
    whose error is returned."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dmp, keyed, sched, reference = _sharded(PLAN_TABLE_WISE, world_size)
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT))
    assert any(not v.local_shards() for v in dmp.state_dict().values() if hasattr(v, "local_shards")), \
        "every table has a piece on this rank: the case proves nothing"
    paths = {"now": os.path.join(directory, "plain-dcp-same-plan"), "before": os.path.join(directory, "list-groups")}
    saved, saved_sched = keyed.state_dict(), sched.state_dict()
    dcp.save({"model": dmp.state_dict(), "optim": saved, "sched": saved_sched}, checkpoint_id=paths["now"])
    old_layout = {**saved, "param_groups": list(saved["param_groups"])}
    dcp.save({"model": dmp.state_dict(), "optim": old_layout, "sched": sched.state_dict()}, checkpoint_id=paths["before"])
    out = {}
    for form in ("recipe", "stateful", "before"):
        twin = _reference_at(SAVED_AT)
        resumed, keyed_b, sched_b, _ = _sharded(PLAN_TABLE_WISE, world_size, seed=1)
        # torch's default planner re-reads the template in the pre-2.4 layout here, where a nested
        # entry without tensors (the scheduler's) is one key: it cannot read "sched" (its bug, not
        # ours), so those forms take the scheduler's state from memory.
        if form == "stateful":
            sched_b.load_state_dict(saved_sched)
            dcp.load({"model": resumed, "optim": keyed_b}, checkpoint_id=paths["now"])
        elif form == "recipe":
            sched_b.load_state_dict(saved_sched)
            state = {"model": resumed.state_dict(), "optim": keyed_b.state_dict()}
            dcp.load(state, checkpoint_id=paths["now"])
            resumed.load_state_dict(state["model"])
            keyed_b.load_state_dict(state["optim"])
        else:  # our planner keeps whole ShardedTensors: no layout guessing, the scheduler read too
            state = {"model": resumed.state_dict(), "optim": keyed_b.state_dict(), "sched": sched_b.state_dict()}
            dcp.load(state, checkpoint_id=paths["before"], planner=checkpoint.LoadPlanner())
            resumed.load_state_dict(state["model"])
            keyed_b.load_state_dict(state["optim"])
            sched_b.load_state_dict(state["sched"])
        _train(resumed, keyed_b, sched_b, twin, rank, world_size, range(SAVED_AT, STEPS))
        out[form] = twin.moved()
    try:
        get_state_dict(dmp, keyed)
        out["get_state_dict"] = "no error"
    except Exception as err:  # torch's own, before it reaches the optimizer
        out["get_state_dict"] = f"{type(err).__name__}: {err}"
    return out


def interrupted_load(rank, world_size, directory=None):
    """``load_state_dict`` of plan A's state dict into plan B, interrupted (KeyboardInterrupt) while it
    copies: at the third table (the param groups and two tables already copied),
    or at the MLP (every table copied). Every weight, state tensor and hyperparameter is as before;
    then the same load, uninterrupted, trains on exactly."""
    import sharders.table_state
    from overlap_optim import keyed as keyed_module

    dmp, keyed, sched, reference = _sharded(PLAN_A, world_size)
    _train(dmp, keyed, sched, reference, rank, world_size, range(SAVED_AT))
    saved, saved_sched = keyed.state_dict(), sched.state_dict()
    resumed, keyed_b, sched_b, _ = _sharded(PLAN_B, world_size, pinned=PINNED_B, seed=1)
    loss_of(resumed, global_batch(0)[rank]).backward()  # state of its own, to be put back
    for group in keyed_b.param_groups:
        group["lr"] *= 0.5  # hyperparameters of its own too
    out = {}
    for where, owner, name in (("third table", sharders.table_state.ShardedTables, "load"),
                               ("MLP", keyed_module, "load_param_state")):
        original, calls = getattr(owner, name), []

        def interrupting(*args, original=original, calls=calls, at=3 if where == "third table" else 1):
            calls.append(1)
            if len(calls) == at:
                raise KeyboardInterrupt
            return original(*args)

        before = _local_snapshot(resumed, keyed_b)
        setattr(owner, name, interrupting)
        try:
            keyed_b.load_state_dict(saved)
            out[where] = "not interrupted"
        except KeyboardInterrupt:
            out[where] = _same(before, _local_snapshot(resumed, keyed_b))
        finally:
            setattr(owner, name, original)
    _weights_from(resumed, reference.model)
    keyed_b.load_state_dict(saved)
    sched_b.load_state_dict(saved_sched)
    _train(resumed, keyed_b, sched_b, reference, rank, world_size, range(SAVED_AT, STEPS))
    out["moved"] = reference.moved()
    return out


def _same(before, after):
    return before.keys() == after.keys() and all(
        torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k] for k, v in before.items())


EC_NAMES = ["adam", "adagrad", "sgd_m", "lamb"]
EC_SETTINGS = [SETTINGS[2], SETTINGS[0], SETTINGS[3], SETTINGS[6]]
EC_PLAN_A = {"adam": "row_wise", "adagrad": "table_wise", "sgd_m": "column_wise", "lamb": "row_wise"}
EC_PLAN_B = {"adam": "table_wise", "adagrad": "data_parallel", "sgd_m": "row_wise", "lamb": "column_wise"}


def ec_state_dict_then_reshard(rank, world_size, directory=None, steps=4, saved_at=2):
    """The EmbeddingCollection's tables, each into another sharding type (a fused table into
    data_parallel, LAMB's row shards into column shards), through ``state_dict()`` and
    ``load_state_dict`` held in memory; compared with torch.optim after every step."""
    from _sharded_parity import local_pieces, step_side_by_side

    def parts(step):
        generator = torch.Generator().manual_seed(100 + step)
        return [covering_batch(EC_NAMES, generator) for _ in range(world_size)]

    dmp, reference, ref_opts = build(EC_NAMES, EC_SETTINGS, EC_PLAN_A, world_size, family="ec")
    keyed = overlap_optim.get_optimizers(dmp)
    start = {n: reference.tables[n].weight.detach().clone() for n in EC_NAMES}
    for step in range(saved_at):
        step_side_by_side(dmp, reference, ref_opts, EC_NAMES, parts(step), rank, step)
    saved = keyed.state_dict()
    resumed, _, _ = build(EC_NAMES, EC_SETTINGS, EC_PLAN_B, world_size, family="ec", seed=1)
    with torch.no_grad():  # the weights, as a model checkpoint would bring them
        for name in EC_NAMES:
            for row, col, piece in local_pieces(resumed, name):
                piece.copy_(reference.tables[name].weight[row : row + piece.shape[0], col : col + piece.shape[1]])
        state = resumed.state_dict()
        for key, value in reference.dense.state_dict().items():
            state[f"dense.{key}"].copy_(value)
    overlap_optim.get_optimizers(resumed).load_state_dict(saved)
    for step in range(saved_at, steps):
        step_side_by_side(resumed, reference, ref_opts, EC_NAMES, parts(step), rank, step)
    return {"moved": min((reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in EC_NAMES)}


def stock_state_dict_refused(rank, world_size, directory=None):
    """Stock TorchRec (its sharder, FBGEMM's Adagrad through fused_params, table_wise: one table per
    rank) steps once; its ``fused_optimizer.state_dict()`` (FBGEMM's names, plan-dependent keys) is
    handed to ``load_state_dict`` of ours. On the main of 2026-11-26 one rank raised and the other
    waited in a collective. Returns each rank's error."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as StockSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    import torch.distributed as dist

    names = ["a", "b"]
    model = ManyTableModel(names)
    stock = StockSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8})
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in names},
    ).collective_plan(model, [stock], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[stock])
    loss_of(dmp, covering_batch(names, torch.Generator().manual_seed(rank))).backward()
    saved = dmp.fused_optimizer.state_dict()
    ours, _, _ = build(names, [(torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8})] * 2, "table_wise", world_size)
    message, same = _refused_load(ours, overlap_optim.get_optimizers(ours), saved)
    return {"error": message, "unchanged": same}
