"""Rank bodies for the layer-wise optimizer tests (spawned; not collected by pytest)."""

from __future__ import annotations

import copy

import torch
from pytorch_optimizer import LARS, GaLore, Lamb
from torch.nn.parallel import DistributedDataParallel

import overlap_optim

GALORE_OPTIONS = {"rank": 2, "update_proj_gap": 2, "scale": 0.25, "projection_type": "std"}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1))


def _split(model):
    weights = [p for p in model.parameters() if p.dim() == 2]
    return weights, [p for p in model.parameters() if p.dim() != 2]


# name -> (annotate ours, build the reference optimizers as a user would)
def _muon_adam(model, ours):
    weights, biases = _split(model)
    if ours:
        overlap_optim.apply_optimizer_in_backward(torch.optim.Muon, weights, {"lr": 0.05})
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, biases, {"lr": 0.01})
        return []
    return [torch.optim.Muon(weights, lr=0.05), torch.optim.Adam(biases, lr=0.01)]


def _single(cls, kwargs, options=None):
    def annotate(model, ours):
        if ours:
            overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs, group_options=options)
            return []
        return [cls([{"params": list(model.parameters()), **(options or {})}], **kwargs)]
    return annotate


DENSE_CASES = {
    "muon+adam": _muon_adam,
    "adafactor": _single(torch.optim.Adafactor, {"lr": 0.05}),
    "lamb": _single(Lamb, {"lr": 0.02, "weight_decay": 0.01}),
    "lars": _single(LARS, {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.02}),
    "galore": _single(GaLore, {"lr": 0.02}, GALORE_OPTIONS),
}


def dense_layerwise(rank, world_size, name, steps=4):
    """Case ``name`` of DENSE_CASES through our DDP hook against the reference on the global batch,
    every step: how far the reference moved."""
    annotate = DENSE_CASES[name]
    model = _mlp()
    reference = copy.deepcopy(model)
    annotate(model, ours=True)
    ref_opts = annotate(reference, ours=False)
    ddp = DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ddp)
    start = [p.detach().clone() for p in reference.parameters()]
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        inputs = [torch.randn(4, 6, generator=generator) for _ in range(world_size)]
        ddp(inputs[rank]).pow(2).mean().backward()
        reference(torch.cat(inputs)).pow(2).mean().backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            assert diff <= 1e-5, f"{name}, step {step}, {n}: {diff:.3g} from the reference"
    return min((q.detach() - s).abs().max().item() for q, s in zip(reference.parameters(), start))


# -- layer-wise optimizers on split tables (sharders/layerwise.py) --

from came_pytorch import CAME  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharders  # noqa: E402
from _models import ManyTableModel, covering_batch, loss_of  # noqa: E402
from _sharded_parity import shard_like_reference, step_side_by_side, train_and_compare  # noqa: E402
from sharders.describe import kernel_rows  # noqa: E402

# Layer-wise optimizers with group options, (class, kwargs, group options), on split tables in a
# model of their own.
SPLIT_ONLY = {"galore": (GaLore, {"lr": 0.02, "weight_decay": 0.01}, GALORE_OPTIONS)}
SPLITTING = ("row_wise", "column_wise", "table_row_wise", "table_column_wise")
LAYERWISE = {
    "adafactor": (torch.optim.Adafactor, {"lr": 0.05}),
    "came": (CAME, {"lr": 0.05, "weight_decay": 0.05}),
    "lamb": (Lamb, {"lr": 0.05, "weight_decay": 0.01}),
    "lars": (LARS, {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.02}),
    "muon": (torch.optim.Muon, {"lr": 0.05}),
    "muon_settings": (torch.optim.Muon, {"lr": 0.05, "momentum": 0.8, "nesterov": False, "weight_decay": 0.02,
                                         "adjust_lr_fn": "match_rms_adamw", "ns_steps": 4}),
}


def split_table(rank, world_size, sharding_type, cover, settings=LAYERWISE):
    """Every layer-wise optimizer of ``settings`` on one split sharding type, 4 steps, on batches that
    touch every row (``cover``) or leave rows untouched (dense semantics either way): how far each
    reference table moved, and each table's differences from the reference after every step."""
    diffs = {}
    moved = train_and_compare(rank, world_size, list(settings), list(settings.values()), sharding_type, steps=4,
                              cover=cover, diffs=diffs)
    return {"moved": moved, "diffs": diffs}


def _sharded(names, settings, sharding_type, world_size, dense=None, seed=0):
    """(DMP, reference, reference optimizers); ``dense(model, ours)`` annotates the MLP (or
    returns the reference's optimizers for it)."""
    model = ManyTableModel(names, seed=seed)
    reference = copy.deepcopy(model)
    for name, (cls, kwargs) in zip(names, settings):
        overlap_optim.apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    ref_opts = [cls(reference.ebc.embedding_bags[n].parameters(), **kw) for n, (cls, kw) in zip(names, settings)]
    if dense is not None:
        dense(model.dense, ours=True)
        ref_opts += dense(reference.dense, ours=False)
    dmp = shard_like_reference(model, reference, names, dict.fromkeys(names, sharding_type), world_size)
    return dmp, reference, ref_opts


def _all_reduces_per_step(dmp, names, rank, world_size):
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    generator = torch.Generator().manual_seed(5)
    parts = [covering_batch(names, generator) for _ in range(world_size)]
    loss_of(dmp, parts[rank]).backward()  # the first step makes the state
    dist.all_reduce = counting
    try:
        loss_of(dmp, parts[rank]).backward()
    finally:
        dist.all_reduce = original
    return len(calls)


def round_counts(rank, world_size):
    """All-reduces in one step (row_wise): 0, 1 and 4 layer-wise tables among 4 tables, and the
    describe() rows of the last."""
    adam = (torch.optim.Adam, {"lr": 0.01})
    names = ["a", "b", "c", "d"]
    counts = {}
    for layerwise in (0, 1, 4):
        settings = list(LAYERWISE.values())[:layerwise] + [adam] * (4 - layerwise)
        dmp, _, _ = _sharded(names, settings, "row_wise", world_size)
        counts[layerwise] = _all_reduces_per_step(dmp, names, rank, world_size)
    return {"counts": counts, "rows": kernel_rows(dmp)}


def _muon_and_adam(dense, ours):
    weights = [p for p in dense.parameters() if p.dim() == 2]
    biases = [p for p in dense.parameters() if p.dim() != 2]
    if ours:
        overlap_optim.apply_optimizer_in_backward(torch.optim.Muon, weights, {"lr": 0.05})
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, biases, {"lr": 0.01})
        return []
    return [torch.optim.Muon(weights, lr=0.05), torch.optim.Adam(biases, lr=0.01)]


def mixed_model(rank, world_size, steps=4):
    """Adafactor, CAME, LAMB and Adam tables, row_wise, and an MLP with Muon on its weights and
    Adam on its biases, against the same optimizers on the unsharded model, every step."""
    names = ["adafactor", "came", "lamb", "adam"]
    settings = [LAYERWISE["adafactor"], LAYERWISE["came"], LAYERWISE["lamb"], (torch.optim.Adam, {"lr": 0.05})]
    dmp, reference, ref_opts = _sharded(names, settings, "row_wise", world_size, dense=_muon_and_adam)
    with torch.no_grad():  # the MLP too: DMP re-initialised nothing there, but be explicit
        for ours, ref in zip((p for n, p in dmp.named_parameters() if n.startswith("dense.")), reference.dense.parameters()):
            ours.copy_(ref)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for step in range(steps):
        generator = torch.Generator().manual_seed(900 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]  # every row: Adam's lazy = dense
        step_side_by_side(dmp, reference, ref_opts, names, parts, rank, step)
    return {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}


def _first_rows_batch(names, generator, rows=6):
    """Every sample's ids in the first ``rows`` rows: row_wise, the second shard sees none."""
    from torchrec import KeyedJaggedTensor

    lengths = torch.randint(1, 4, (len(names) * 4,), generator=generator)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=generator)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in names], values=values, lengths=lengths)
    return kjt, torch.randn(4, generator=generator)


def untouched_shard(rank, world_size, steps=4):
    """row_wise, batches that never reach the second row shard: that rank still takes part in
    every round, and its shard still steps (dense semantics); compared every step."""
    names = list(LAYERWISE)
    dmp, reference, ref_opts = _sharded(names, list(LAYERWISE.values()), "row_wise", world_size)
    start = {n: reference.ebc.embedding_bags[n].weight.detach().clone() for n in names}
    for step in range(steps):
        generator = torch.Generator().manual_seed(950 + step)
        parts = [_first_rows_batch(names, generator) for _ in range(world_size)]
        step_side_by_side(dmp, reference, ref_opts, names, parts, rank, step)
    rounds = sharders.plan_of(dmp.module.ebc).round.rounds
    untouched = {n: (reference.ebc.embedding_bags[n].weight.detach() - start[n])[6:].abs().max().item() for n in names}
    return {"rounds": rounds, "untouched_rows_moved": untouched}


def floor_bound(rank, world_size, steps=3):
    """Adafactor row_wise with eps1 = 0.3: at the first step its variance floor eps1**2 binds on
    touched elements (g^2 * g^2 / 0.3 < 0.09 for |g| < 0.4), where the cross-shard RMS of the
    update is not exact. The next step must raise on every rank; returns (step, message)."""
    names = ["adafactor"]
    dmp, _, _ = _sharded(names, [(torch.optim.Adafactor, {"lr": 0.05, "eps": (0.3, 1e-3)})], "row_wise", world_size)
    for step in range(steps):
        generator = torch.Generator().manual_seed(970 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        try:
            loss_of(dmp, parts[rank]).backward()
        except ValueError as error:
            return {"step": step, "error": str(error)}
    return {"step": None, "error": ""}


def galore_resharded(rank, world_size, directory, before="row_wise", after="column_wise", saved_at=2, steps=4):
    """A GaLore table (and an Adafactor one beside it) sharded ``before``, saved with
    ``overlap_optim.checkpoint`` after ``saved_at`` steps (its projector and low-rank moments), loaded
    into a model of other weights sharded ``after``, trained on: each table's differences from the
    package on the unsharded model after every step, and how far the reference moved."""
    from _sharded_parity import build, compare

    from overlap_optim import checkpoint

    names = ["galore", "adafactor"]
    settings = [SPLIT_ONLY["galore"], LAYERWISE["adafactor"]]
    dmp, reference, ref_opts = build(names, settings, before, world_size)
    start = {n: reference.tables[n].weight.detach().clone() for n in names}
    diffs: dict = {}

    def step(model, s):
        parts = [covering_batch(names, torch.Generator().manual_seed(300 + s), cover=False) for _ in range(world_size)]
        step_side_by_side(model, reference, ref_opts, names, parts, rank, s, diffs=diffs)

    for s in range(saved_at):
        step(dmp, s)
    checkpoint.save(directory, dmp, overlap_optim.get_optimizers(dmp))
    resumed, _, _ = build(names, settings, after, world_size, seed=1)
    checkpoint.load(directory, resumed, overlap_optim.get_optimizers(resumed))
    compare(resumed, reference, names, "after load", diffs=diffs)
    for s in range(saved_at, steps):
        step(resumed, s)
    return {"diffs": diffs, "moved": {n: (reference.tables[n].weight - start[n]).abs().max().item() for n in names}}
