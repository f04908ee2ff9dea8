"""Rank bodies for the gradient clipping tests (spawned; not collected by pytest).

One model holds every kind of kernel: two tables FBGEMM fuses (Adagrad row-wise, SGD column-wise), a lazy fallback
table (Adam, row-wise), a dense fallback table (RMSprop, column-wise), a cross-shard table (Adafactor, row-wise), a data-parallel table (Adam,
in the DDP hook), and the MLP: its first layer annotated (Adam, DDP hook), its last one left to a
user SGD. The reference is one process on the global batch: backward, then torch's
``clip_grad_norm_`` or ``clip_grad_value_`` over the same set, then each optimizer's step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import overlap_optim
import sharders
import sharders.fused_rows
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from _sharded_parity import compare, local_pieces, shard_like_reference

NAMES = ["fused", "sgd", "adam", "dense", "factor", "dp"]
SETTINGS = {
    "fused": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "sgd": (torch.optim.SGD, {"lr": 0.1}),  # fused EXACT_SGD on column shards
    # eps=1e-12: SparseAdam, the lazy reference, places eps outside the bias correction (see test_lazy_reference)
    "adam": (torch.optim.Adam, {"lr": 0.05, "eps": 1e-12}),
    "dense": (torch.optim.RMSprop, {"lr": 0.01}),  # dense_tables: every row steps
    "factor": (torch.optim.Adafactor, {"lr": 0.05}),
    "dp": (torch.optim.Adam, {"lr": 0.05}),
}
SHARDING = {"fused": "row_wise", "sgd": "column_wise", "adam": "row_wise", "dense": "column_wise", "factor": "row_wise",
            "dp": "data_parallel"}
DENSE = (torch.optim.Adam, {"lr": 0.02})
BINDING = 0.3  # the bound, as a fraction of the first step's norm (or largest element)


def _members(model, over):
    tables = [model.ebc.embedding_bags[n].weight for n in NAMES]
    dense = list(model.dense.parameters())
    return {"everything": tables + dense, "tables": tables, "dense": dense}[over]


def _bound(reference, parts, over, how, norm_type):
    """``BINDING`` times the first step's norm (or largest gradient element) of the set, from a
    copy of the reference: a bound that really clips."""
    probe = copy.deepcopy(reference)
    loss_of(probe, concat_batches(parts)).backward()
    grads = [p.grad for p in _members(probe, over)]
    if how == "value":
        return BINDING * max(g.abs().max().item() for g in grads)
    return BINDING * torch.nn.utils.get_total_norm(grads, norm_type).item()


def _build(rank, world_size, over, how, norm_type, first_parts, lazy_adam=False, error_if_nonfinite=False):
    model = ManyTableModel(NAMES, seed=3)
    reference = copy.deepcopy(model)
    for name in NAMES:
        cls, kwargs = SETTINGS[name]
        overlap_optim.apply_optimizer_in_backward(cls, [model.ebc.embedding_bags[name].weight], kwargs)
    overlap_optim.apply_optimizer_in_backward(DENSE[0], model.dense[0].parameters(), DENSE[1])
    bound, clip = None, None  # how=None: no clipping (the accumulation tests reuse this model)
    if how is not None:
        bound = _bound(reference, first_parts, over, how, norm_type)
    if how == "value":
        clip = overlap_optim.apply_gradient_clipping(_members(model, over), clip_value=bound)
    elif how == "norm":
        clip = overlap_optim.apply_gradient_clipping(_members(model, over), max_norm=bound, norm_type=norm_type,
                                                     error_if_nonfinite=error_if_nonfinite)
    ref_opts = []
    for name in NAMES:
        cls, kwargs = SETTINGS[name]
        if lazy_adam and name == "adam":  # lazy semantics: the reference is SparseAdam on the coalesced rows
            cls = torch.optim.SparseAdam
        ref_opts.append(cls([reference.ebc.embedding_bags[name].weight], **kwargs))
    ref_opts.append(DENSE[0](reference.dense[0].parameters(), **DENSE[1]))
    sharder = sharders.EmbeddingBagCollectionSharder(dense_tables=["dense"])
    dmp = shard_like_reference(model, reference, NAMES, SHARDING, world_size, sharder)
    return dmp, reference, ref_opts, clip, bound


def _reference_clip(reference, over, how, bound, norm_type, lazy_adam):
    """torch's clipping on the reference's gradients; the lazy table's gradient then becomes the
    coalesced sparse gradient of its touched rows (untouched rows counted as zero in the norm)."""
    members = _members(reference, over)
    if how == "value":
        torch.nn.utils.clip_grad_value_(members, bound)
        norm = None
    else:
        norm = torch.nn.utils.clip_grad_norm_(members, bound, norm_type)
    if lazy_adam:
        weight = reference.ebc.embedding_bags["adam"].weight
        weight.grad = weight.grad.to_sparse(sparse_dim=1)
    return norm


def clipped_training(rank, world_size, over, how, norm_type=2.0, steps=3, cover=True, mutate=None):
    """Train with clipping ``over`` ("everything", "tables", "dense") ``how`` ("norm", "value"):
    weights and the norm compared with the reference after every step.

    ``mutate``: break the implementation on purpose ("no_all_reduce": each rank's norm from its
    own shards only; "replicated_twice": DDP-averaged gradients counted on every rank;
    "drop_shard_partial": rank 1's fused shards leave their partial out of the norm) and return
    the largest differences instead of asserting them.
    """
    lazy_adam = not cover
    parts_of = [
        [covering_batch(NAMES, torch.Generator().manual_seed(100 + s), cover=cover) for _ in range(world_size)]
        for s in range(steps)
    ]
    dmp, reference, ref_opts, clip, bound = _build(rank, world_size, over, how, norm_type, parts_of[0], lazy_adam)
    if mutate == "no_all_reduce":
        clip.round.local = True
    if mutate == "replicated_twice":
        clip._counts_on_this_rank = lambda replicated: True
    if mutate == "drop_shard_partial":  # the fused tables' shards on rank 1 add nothing
        if not sharders.fused_rows.applies(EmbOptimType.EXACT_SGD, "cpu"):
            return {"not_built": True}
        if rank == 1:
            _drop_fused_partials(dmp)
    ours_user = torch.optim.SGD([p for n, p in dmp.named_parameters() if n.startswith("dense.2.")], lr=0.1)
    ref_user = torch.optim.SGD(reference.dense[2].parameters(), lr=0.1)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    kinds = {n: t.kind.value for n, t in sharders.plan_of(dmp.module.ebc).tables.items()}
    norms, worst_norm, worst_weight = [], 0.0, 0.0
    for step, parts in enumerate(parts_of):
        loss_of(dmp, parts[rank]).backward()
        ours_user.step()
        ours_user.zero_grad()
        loss_of(reference, concat_batches(parts)).backward()
        ref_norm = _reference_clip(reference, over, how, bound, norm_type, lazy_adam)
        for opt in ref_opts + [ref_user]:
            opt.step()
        reference.zero_grad()
        if how == "value":
            assert clip.total_norm is None
        else:
            norms.append((ref_norm.item(), clip.total_norm.item()))
            worst_norm = max(worst_norm, abs(ref_norm.item() - clip.total_norm.item()) / ref_norm.item())
        if mutate is None:
            assert worst_norm < 1e-5, f"step {step}: total_norm {norms[-1][1]} against torch's {norms[-1][0]}"
            compare(dmp, reference, NAMES, step, atol=2e-5)
        else:
            worst_weight = max(worst_weight, _largest_difference(dmp, reference))
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    return {"moved": moved, "norms": norms, "bound": bound, "kinds": kinds,
            "worst_norm": worst_norm, "worst_weight": worst_weight}


def _drop_fused_partials(dmp):
    """Each fused kernel of this rank hands the round a zero partial norm (its rows still step)."""
    from sharders._private import kernels_of
    from sharders.fused_backward import held_backward_of

    for _lookup, kernel in kernels_of(dmp.module.ebc):
        held = held_backward_of(getattr(kernel, "emb_module", None) or kernel)
        if held is None:
            continue
        partial_norm = held.compiled.partial_norm

        def dropped(*args, _partial_norm=partial_norm, **kwargs):
            return torch.zeros_like(_partial_norm(*args, **kwargs))

        held.compiled.partial_norm = dropped


def _largest_difference(dmp, reference):
    state = dmp.state_dict()
    worst = max((state[f"dense.{n}"] - p.detach()).abs().max().item() for n, p in reference.dense.named_parameters())
    for name in NAMES:
        ref = reference.ebc.embedding_bags[name].weight.detach()
        for row, col, piece in local_pieces(dmp, name):
            if piece.numel():
                worst = max(worst, (piece - ref[row : row + piece.shape[0], col : col + piece.shape[1]]).abs().max().item())
    worst = torch.tensor(worst)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def non_finite_step(rank, world_size, over, steps=3, bad_step=1):
    """Clipping ``over`` "dense" (the MLP) or "everything" with ``error_if_nonfinite``; at ``bad_step``
    the MLP's first layer's gradient is inf (on every rank, and in the reference). That step raises on
    every rank, and the user skips it, as a torch loop skips the step and zeroes the gradients; no
    update of the set runs, and whatever is outside it steps as torch.optim's (over "dense": every
    table, the cross-shard one's second half included, which runs in a round after the failing one).
    The next steps start clean: nothing the refused step held is stepped or added later. Weights
    compared after every step."""
    parts_of = [
        [covering_batch(NAMES, torch.Generator().manual_seed(100 + s), cover=True) for _ in range(world_size)]
        for s in range(steps)
    ]
    dmp, reference, ref_opts, clip, bound = _build(rank, world_size, over, "norm", 2.0, parts_of[0],
                                                   error_if_nonfinite=True)
    ours_user = torch.optim.SGD([p for n, p in dmp.named_parameters() if n.startswith("dense.2.")], lr=0.1)
    ref_user = torch.optim.SGD(reference.dense[2].parameters(), lr=0.1)
    outside, inside = (ref_opts[:-1], ref_opts[-1:] + [ref_user]) if over == "dense" else ([], ref_opts + [ref_user])
    ours_first = next(p for n, p in dmp.named_parameters() if n == "dense.0.weight")
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    raised = []
    for step, parts in enumerate(parts_of):
        handles = []
        if step == bad_step:
            infinite = lambda grad: grad * float("inf")  # noqa: E731
            handles = [ours_first.register_hook(infinite), reference.dense[0].weight.register_hook(infinite)]
        try:
            loss_of(dmp, parts[rank]).backward()
            ours_user.step()
        except RuntimeError as err:
            raised.append((step, str(err)))
        ours_user.zero_grad()
        loss_of(reference, concat_batches(parts)).backward()
        try:
            torch.nn.utils.clip_grad_norm_(_members(reference, over), bound, error_if_nonfinite=True)
            stepped = outside + inside
        except RuntimeError:
            stepped = outside  # the user skips the set's step
        for opt in stepped:
            opt.step()
        reference.zero_grad()
        for handle in handles:
            handle.remove()
        compare(dmp, reference, NAMES, step, atol=2e-5)
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    return {"raised": raised, "moved": moved, "kinds": {n: t.kind.value for n, t in
                                                        sharders.plan_of(dmp.module.ebc).tables.items()}}


def declared_after_sharding(rank, world_size):
    """``apply_gradient_clipping(dmp.parameters(), ...)`` after DMP: the error users who port
    ``clip_grad_norm_(dmp.parameters(), ...)`` will meet."""
    parts = [covering_batch(NAMES, torch.Generator().manual_seed(100), cover=True) for _ in range(world_size)]
    dmp, *_ = _build(rank, world_size, "dense", "norm", 2.0, parts)
    try:
        overlap_optim.apply_gradient_clipping(dmp.parameters(), max_norm=1.0)
    except ValueError as err:
        return str(err)
    return "no error"
