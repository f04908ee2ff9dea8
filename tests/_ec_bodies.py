"""Rank bodies for tests/test_ec_features.py (spawned; not collected by pytest).

EmbeddingCollection tables through everything the EBC sharder gives: clipping, accumulation,
frozen tables, describe(), shared tables, TrainPipelineSparseDist, and a model with both an
EBC and an EC resharded from plan A to plan B and from 2 ranks to 1. Every check is against
one process of plain torch.optim on the global batch, after every step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch

import overlap_optim
import sharders
from _models import ManySequenceModel, concat_batches, covering_batch, loss_of, position_weighted
from _sharded_parity import build, compare, local_pieces, shard_like_reference
from overlap_optim import checkpoint, no_step

# Every kind of table kernel, in one EC.
KINDS = {
    "fused": ((torch.optim.Adagrad, {"lr": 0.1}), "row_wise"),  # FBGEMM EXACT_ADAGRAD
    "sgd": ((torch.optim.SGD, {"lr": 0.1}), "column_wise"),  # FBGEMM EXACT_SGD
    "adam": ((torch.optim.Adam, {"lr": 0.05}), "table_wise"),  # the lazy fallback
    "factor": ((torch.optim.Adafactor, {"lr": 0.05}), "row_wise"),  # cross-shard
    "dp": ((torch.optim.Adam, {"lr": 0.05}), "data_parallel"),  # the DDP hook
    "frozen": (None, "table_wise"),  # requires_grad=False
    "frozen_dp": (None, "data_parallel"),
}
FROZEN = ("frozen", "frozen_dp")
DENSE = (torch.optim.Adam, {"lr": 0.02})


def _every_kind(world_size, clip_fraction=None, first_parts=None, how="norm"):
    """(ours, reference, reference optimizers, clipping set or None, bound) for the KINDS model;
    ``how``: clip by "norm" (the bound a fraction of the first step's norm) or "value" (of its
    largest gradient element)."""
    names = list(KINDS)
    model = ManySequenceModel(names, seed=3)
    for name in FROZEN:
        model.tables[name].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    ref_opts = []
    for name, (setting, _) in KINDS.items():
        if setting is not None:
            overlap_optim.apply_optimizer_in_backward(setting[0], [model.tables[name].weight], setting[1])
            ref_opts.append(setting[0]([reference.tables[name].weight], **setting[1]))
    overlap_optim.apply_optimizer_in_backward(DENSE[0], model.dense.parameters(), DENSE[1])
    ref_opts.append(DENSE[0](reference.dense.parameters(), **DENSE[1]))
    clip, bound = None, None
    if clip_fraction is not None:
        probe = copy.deepcopy(reference)
        loss_of(probe, concat_batches(first_parts)).backward()
        grads = [p.grad for p in probe.parameters() if p.grad is not None]
        members = [p for p in model.parameters() if p.requires_grad]
        if how == "norm":
            bound = clip_fraction * torch.nn.utils.get_total_norm(grads).item()
            clip = overlap_optim.apply_gradient_clipping(members, max_norm=bound)
        else:
            bound = clip_fraction * max(g.abs().max().item() for g in grads)
            clip = overlap_optim.apply_gradient_clipping(members, clip_value=bound)
    types = {n: t for n, (_, t) in KINDS.items()}
    dmp = shard_like_reference(model, reference, names, types, world_size, sharders.EmbeddingCollectionSharder())
    return dmp, reference, ref_opts, clip, bound


def _parts(step, world_size, names):
    generator = torch.Generator().manual_seed(700 + step)
    return [covering_batch(names, generator) for _ in range(world_size)]


def clipped(rank, world_size, how="norm", steps=3):
    """Clipping ``how`` ("norm" or "value") over every table and the MLP: the norm and the weights
    against ``clip_grad_norm_`` (``clip_grad_value_``) then torch.optim, after every step."""
    names = list(KINDS)
    dmp, reference, ref_opts, clip, bound = _every_kind(world_size, 0.3, _parts(0, world_size, names), how)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    norms = []
    for step in range(steps):
        parts = _parts(step, world_size, names)
        loss_of(dmp, parts[rank]).backward()
        loss_of(reference, concat_batches(parts)).backward()
        members = [p for p in reference.parameters() if p.requires_grad]
        if how == "norm":
            norms.append((torch.nn.utils.clip_grad_norm_(members, bound).item(), clip.total_norm.item()))
        else:
            norms.append((max(p.grad.abs().max().item() for p in members), None))
            torch.nn.utils.clip_grad_value_(members, bound)
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, names, step, atol=2e-5)
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    kinds = {n: t.kind.value for n, t in sharders.plan_of(dmp.module.ec).tables.items()}
    return {"norms": norms, "bound": bound, "moved": moved, "kinds": kinds}


def accumulated(rank, world_size, k=2, windows=2):
    """``no_step`` windows of k micro-batches: one torch.optim step on the summed gradient."""
    names = list(KINDS)
    dmp, reference, ref_opts, _, _ = _every_kind(world_size)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for window in range(windows):
        for micro in range(k):
            parts = _parts(10 * window + micro, world_size, names)
            if micro < k - 1:
                with no_step(dmp):
                    loss_of(dmp, parts[rank]).backward()
            else:
                loss_of(dmp, parts[rank]).backward()
            loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, names, f"window {window}", atol=2e-5)
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    return {"moved": moved, "describe": sharders.describe(dmp)}


def shared_table_in_pipeline(rank, world_size, steps=3, clip=False, micro=1, torchrec_accumulation=False,
                             cut_short=False, reload_at=None):
    """One EC table looked up by two features (one shared, fallback Adam; one fused Adagrad),
    trained through TorchRec's ``TrainPipelineSparseDist`` against torch.optim. ``clip``: both
    tables and the head clipped by a global norm that binds; ``micro``: micro-batches per step,
    all but the last run through ``pipeline.progress`` inside ``overlap_optim.no_step``, or, with
    ``torchrec_accumulation``, every one through TorchRec's ``GradientAccumulationWrapper``
    (``num_steps=micro``) and no ``no_step``. ``cut_short``: then one micro-batch more, where the data
    ends: the wrapper's flush, whose error is returned. ``reload_at``: after that step, the keyed
    optimizer's state dict through ``torch.save`` and loaded back in place."""
    import io

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.gradient_accumulation import (
        GradientAccumulationConfig, GradientAccumulationWrapper,
    )

    model = _SharedModel()
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, [model.ec.embeddings["shared"].weight], {"lr": 0.05})
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adagrad, [model.ec.embeddings["own"].weight], {"lr": 0.1})
    overlap_optim.apply_optimizer_in_backward(torch.optim.SGD, model.head.parameters(), {"lr": 0.1})
    ref_opts = [torch.optim.Adam([reference.ec.embeddings["shared"].weight], lr=0.05),
                torch.optim.Adagrad([reference.ec.embeddings["own"].weight], lr=0.1),
                torch.optim.SGD(reference.head.parameters(), lr=0.1)]
    batches = [[_shared_batches(micro * step + m, world_size) for m in range(micro)] for step in range(steps)]
    bound = None
    if clip:  # 0.3 of the first step's norm: it binds
        probe = copy.deepcopy(reference)
        for parts in batches[0]:
            probe(_global_batch(parts))[0].backward()
        bound = 0.3 * torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()]).item()
        overlap_optim.apply_gradient_clipping(model.parameters(), max_norm=bound)
    dmp = shard_like_reference(model, reference, ["shared", "own"], dict.fromkeys(["shared", "own"], "row_wise"),
                               world_size, sharders.EmbeddingCollectionSharder())
    keyed = overlap_optim.get_optimizers(dmp)
    pipeline = TrainPipelineSparseDist(dmp, keyed, torch.device("cpu"))
    if torchrec_accumulation:
        pipeline = GradientAccumulationWrapper(pipeline, keyed, dmp, GradientAccumulationConfig(num_steps=micro))
    start = {n: reference.ec.embeddings[n].weight.detach().clone() for n in ("shared", "own")}
    diffs = []
    extra = [_shared_batches(micro * steps, world_size)[rank]] if cut_short else []
    local = iter([parts[rank] for step in batches for parts in step] + extra)
    for step in range(steps):
        for m in range(micro):
            held = m < micro - 1 and not torchrec_accumulation
            with overlap_optim.no_step(dmp) if held else contextlib.nullcontext():
                pipeline.progress(local)
            reference(_global_batch(batches[step][m]))[0].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), bound)
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        diffs.append(max(
            (piece - reference.ec.embeddings[n].weight.detach()[r : r + piece.shape[0], c : c + piece.shape[1]])
            .abs().max().item()
            for n in ("shared", "own") for r, c, piece in local_pieces(dmp, n) if piece.numel()
        ))
        state = dmp.state_dict()
        diffs[-1] = max(diffs[-1], *((state[f"head.{n}"] - p).abs().max().item()
                                     for n, p in reference.head.named_parameters()))
        if step == reload_at:
            buffer = io.BytesIO()
            torch.save(keyed.state_dict(), buffer)
            buffer.seek(0)
            keyed.load_state_dict(torch.load(buffer, weights_only=False))
    moved = {n: (reference.ec.embeddings[n].weight.detach() - start[n]).abs().max().item() for n in start}
    if not cut_short:
        return {"diffs": diffs, "moved": moved}
    pipeline.progress(local)  # the extra micro-batch: a window opens
    try:
        pipeline.progress(local)  # the data has ended: the wrapper flushes
        flush = "no error"
    except StopIteration:
        flush = "StopIteration"
    except RuntimeError as err:
        flush = str(err)
    return {"diffs": diffs, "moved": moved, "flush": flush}


class _SharedModel(torch.nn.Module):
    """Table "shared" looked up by features a and b, table "own" by c; the loss is a linear
    read-out of each sample's position-weighted rows, against its label. Takes TorchRec's
    ``Batch`` and returns ``(loss, (loss, prediction, labels))``, as the pipeline expects."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="shared", embedding_dim=8, num_embeddings=12, feature_names=["a", "b"]),
            EmbeddingConfig(name="own", embedding_dim=8, num_embeddings=12, feature_names=["c"]),
        ], device=torch.device("cpu"))
        self.head = torch.nn.Linear(24, 1)

    @property
    def tables(self) -> torch.nn.ModuleDict:
        return self.ec.embeddings

    @staticmethod
    def table_key(name: str) -> str:
        return f"ec.embeddings.{name}.weight"

    def forward(self, batch: Batch):
        sequences = self.ec(batch.sparse_features)
        prediction = self.head(torch.cat([position_weighted(sequences[k]) for k in ("a", "b", "c")], dim=1)).squeeze(1)
        loss = (prediction - batch.labels).pow(2).mean()
        return loss, (loss.detach(), prediction.detach(), batch.labels)


def _shared_batches(step, world_size):
    parts = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(900 + 10 * step + rank)
        lengths = torch.randint(1, 5, (3 * 4,), generator=generator)
        values = torch.randint(0, 12, (int(lengths.sum()),), generator=generator)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=values, lengths=lengths)
        parts.append(Batch(dense_features=torch.zeros(4, 1), sparse_features=kjt,
                           labels=torch.randn(4, generator=generator)))
    return parts


def _global_batch(parts):
    kjt, _ = concat_batches([(p.sparse_features, p.labels) for p in parts])
    return Batch(dense_features=torch.zeros(4 * len(parts), 1), sparse_features=kjt,
                 labels=torch.cat([p.labels for p in parts]))


# A model with an EBC and an EC, resharded: tables named ec_... are the EC's.
MIXED = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
    "ec_rowwise": (__import__("torchrec.optim.rowwise_adagrad", fromlist=["RowWiseAdagrad"]).RowWiseAdagrad,
                   {"lr": 0.1}),
    "ec_adam": (torch.optim.Adam, {"lr": 0.02}),
    "ec_sgd_m": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "ec_factor": (torch.optim.Adafactor, {"lr": 0.05}),
}
MIXED_DENSE = (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1})
PLAN_A = {"adagrad": "table_wise", "adam": "row_wise", "ec_rowwise": "row_wise", "ec_adam": "column_wise",
          "ec_sgd_m": "data_parallel", "ec_factor": "row_wise"}
PLAN_B = {"adagrad": "row_wise", "adam": "data_parallel", "ec_rowwise": "table_wise", "ec_adam": "row_wise",
          "ec_sgd_m": "column_wise", "ec_factor": "column_wise"}
SAVED_AT, STEPS = 3, 5


def _mixed(plan, world_size, seed=0):
    names = list(MIXED)
    dmp, reference, ref_opts = build(names, list(MIXED.values()), plan, world_size, dense=MIXED_DENSE,
                                     family="mixed", seed=seed)
    keyed = overlap_optim.get_optimizers(dmp)
    return dmp, keyed, torch.optim.lr_scheduler.StepLR(keyed, 2, 0.5), reference, ref_opts


def _mixed_batch(step, world_size):
    generator = torch.Generator().manual_seed(1300 + step)
    return [covering_batch(list(MIXED), generator) for _ in range(world_size)]


def _mixed_train(dmp, keyed, sched, reference, ref_opts, ref_scheds, rank, world_size, steps, parts_world=2):
    for step in steps:
        parts = _mixed_batch(step, parts_world)
        loss_of(dmp, parts[rank] if world_size == parts_world else concat_batches(parts)).backward()
        keyed.step()
        sched.step()
        loss_of(reference, concat_batches(parts)).backward()
        for opt, ref_sched in zip(ref_opts, ref_scheds):
            opt.step()
            ref_sched.step()
        reference.zero_grad()
        compare(dmp, reference, list(MIXED), step, atol=1e-6)


def _state_layout(keyed):
    return sorted((k, n, tuple(v.size()) if torch.is_tensor(v) else type(v).__name__)
                  for k, s in keyed.state_dict()["state"].items() for n, v in s.items())


def mixed_reshard(rank, world_size, directory):
    """Plan A trains and saves at SAVED_AT; plan B (another seed) loads and trains on: (the state
    layout under each plan, how far the reference moved)."""
    dmp, keyed, sched, reference, ref_opts = _mixed(PLAN_A, world_size)
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in ref_opts]
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    _mixed_train(dmp, keyed, sched, reference, ref_opts, ref_scheds, rank, world_size, range(SAVED_AT))
    layout_a = _state_layout(keyed)
    checkpoint.save(directory, dmp, keyed, {"scheduler": sched})
    resumed, keyed_b, sched_b, _, _ = _mixed(PLAN_B, world_size, seed=1)
    checkpoint.load(directory, resumed, keyed_b, {"scheduler": sched_b})
    compare(resumed, reference, list(MIXED), "after load", atol=1e-6)
    layout_b = _state_layout(keyed_b)
    _mixed_train(resumed, keyed_b, sched_b, reference, ref_opts, ref_scheds, rank, world_size, range(SAVED_AT, STEPS))
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    return {"layout_a": layout_a, "layout_b": layout_b, "moved": moved, "describe_b": sharders.describe(resumed)}


def mixed_on_one_rank(rank, world_size, directory):
    """The 2-rank checkpoint of plan A, loaded on one rank (every table table_wise), trained on."""
    dmp, keyed, sched, _, _ = _mixed(dict.fromkeys(MIXED, "table_wise"), world_size, seed=2)
    _, _, _, reference, ref_opts = _mixed(dict.fromkeys(MIXED, "table_wise"), world_size)  # plan A's start
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in ref_opts]
    for step in range(SAVED_AT):
        loss_of(reference, concat_batches(_mixed_batch(step, 2))).backward()
        for opt, ref_sched in zip(ref_opts, ref_scheds):
            opt.step()
            ref_sched.step()
        reference.zero_grad()
    checkpoint.load(directory, dmp, keyed, {"scheduler": sched})
    compare(dmp, reference, list(MIXED), "after load", atol=1e-6)
    _mixed_train(dmp, keyed, sched, reference, ref_opts, ref_scheds, rank, world_size, range(SAVED_AT, STEPS))
    return {"layout": _state_layout(keyed)}

