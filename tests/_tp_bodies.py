"""Rank bodies for the tensor-parallel tests (spawned; not collected by pytest).

The model is the issue's: an MLP 6 -> 8 -> 4, ``ColwiseParallel`` on fc1 (its weight ``Shard(0)``, its
bias ``Shard(0)``), ``RowwiseParallel`` on fc2 (its weight ``Shard(1)``, its bias ``Replicate``), the
same input on every rank of the TP mesh. The reference is one process of the same optimizer on the
full weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import overlap_optim
from overlap_optim.record import record_of

from _fsdp_bodies import loop_without_get_optimizers

PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    return torch.randn(6, 6, generator=generator), torch.randn(6, 4, generator=generator)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _step(model, reference, ref_opts, step, mine=slice(None), whole=slice(None)) -> float:
    """One step: ours on rows ``mine`` of the step's batch, the reference on rows ``whole`` and its
    ``torch.optim`` optimizers; the largest difference of any parameter after it."""
    x, y = _batch(step)
    (model(x[mine]) - y[mine]).square().mean().backward()
    (reference(x[whole]) - y[whole]).square().mean().backward()
    for opt in ref_opts:
        opt.step()
        opt.zero_grad()
    return max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def _moved(reference, start) -> float:
    """How far the reference moved its least moved parameter from ``start``."""
    return min((p.detach() - s).abs().max().item() for p, s in zip(reference.parameters(), start))


def _setting(name: str) -> tuple:
    from _layerwise_bodies import LAYERWISE

    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    simple = {"adam": (torch.optim.Adam, {"lr": 0.05}), "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "rprop": (torch.optim.Rprop, {"lr": 0.01}), "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1})}
    if name == "lion":  # a third-party element-wise optimizer, with no virtual group
        from pytorch_optimizer import Lion

        return Lion, {"lr": 0.01, "weight_decay": 0.01}
    if name == "galore":  # its projection's settings go in its param group (_options)
        from pytorch_optimizer import GaLore

        return GaLore, {"lr": 0.02, "weight_decay": 0.01}
    return simple[name] if name in simple else LAYERWISE[name]


def _options(name: str) -> dict | None:
    """Optimizer ``name``'s group options (settings it reads from its param group), or None."""
    from _layerwise_bodies import GALORE_OPTIONS

    return GALORE_OPTIONS if name == "galore" else None


def _annotate(params: list, name: str) -> None:
    cls, kwargs = _setting(name)
    overlap_optim.apply_optimizer_in_backward(cls, params, kwargs, group_options=_options(name))


def _reference(params: list, name: str) -> torch.optim.Optimizer:
    cls, kwargs = _setting(name)
    return cls([{"params": params, **(_options(name) or {})}], **kwargs)


def train(rank, world_size, name, order="after", steps=3, biases=None, max_norm=None):
    """The weights with optimizer ``name``, the biases with ``biases`` (None: the same), annotated
    (and, with ``max_norm``, clipped by global norm) ``order`` ("before" or "after")
    ``parallelize_module``; each step's largest difference from the reference, how far the
    reference moved its least moved parameter, and with ``max_norm`` each step's norm, ours and
    ``clip_grad_norm_``'s on the reference."""
    biases = biases or name
    model = mlp()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))

    clips = []

    def annotate():
        _annotate([model.fc1.weight, model.fc2.weight], name)
        _annotate([model.fc1.bias, model.fc2.bias], biases)
        if max_norm is not None:
            clips.append(overlap_optim.apply_gradient_clipping(model.parameters(), max_norm=max_norm))

    if order == "before":
        annotate()
    parallelize_module(model, mesh, PLAN)
    if order == "after":
        annotate()
    ref_opts = [_reference([reference.fc1.weight, reference.fc2.weight], name),
                _reference([reference.fc1.bias, reference.fc2.bias], biases)]
    start = [p.detach().clone() for p in reference.parameters()]
    diffs, norms = [], []
    if max_norm is not None:  # the reference's norm, as clip_grad_norm_ returns it, before its step
        ref_opts.insert(0, _Clipping(reference, max_norm, norms, clips))
    for step in range(steps):
        diffs.append(_step(model, reference, ref_opts, step))
    return {"diffs": diffs, "moved": _moved(reference, start), "norms": norms}


class _Clipping:
    """A stand-in first optimizer of the reference: ``clip_grad_norm_`` on its gradients, the norm
    noted beside ours."""

    def __init__(self, reference, max_norm, norms, clips):
        self.reference, self.max_norm, self.norms, self.clips = reference, max_norm, norms, clips

    def step(self):
        theirs = nn.utils.clip_grad_norm_(self.reference.parameters(), self.max_norm).item()
        self.norms.append((self.clips[0].total_norm.item(), theirs))

    def zero_grad(self):
        pass


def statistics_local(rank, world_size, name="adafactor", steps=3):
    """The mutation: each rank finishes the cross-shard step on its own piece's sums, never reduced.
    Returns the differences, which must then be large."""
    model, reference = mlp(), mlp()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), PLAN)
    _annotate(list(model.parameters()), name)
    for param in model.parameters():
        step = record_of(param).piece_step
        if step is not None and step.round is not None:  # None: stepped with its own class (GaLore's biases)
            step.round.local = True
    ref_opt = _reference(list(reference.parameters()), name)
    return {"diffs": [_step(model, reference, [ref_opt], step) for step in range(steps)]}


def all_reduces(rank, world_size, name="adafactor", steps=3):
    """The all-reduces of ``steps`` steps with every parameter of the MLP under ``name``: their
    sizes, with "step" after each backward."""
    from _fsdp_bodies import _all_reduces

    cls, kwargs = _setting(name)
    model = mlp()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), PLAN)
    overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs)
    with _all_reduces() as sizes:
        for step in range(steps):
            x, y = _batch(step)
            (model(x) - y).square().mean().backward()
            sizes.append("step")
    return {"sizes": sizes}


def refused(rank, world_size, order):
    """pytorch-optimizer's Nero (separable neither by rows nor by columns, no cross-shard form) on the
    split weights, annotated ``order`` ``parallelize_module``: the error, and whether any parameter
    changed."""
    from pytorch_optimizer import Nero

    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world_size,))

    def annotate():
        overlap_optim.apply_optimizer_in_backward(Nero, [model.fc1.weight, model.fc2.weight], {"lr": 0.02})

    try:
        if order == "before":
            annotate()
        parallelize_module(model, mesh, PLAN)
        if order == "after":
            annotate()
    except ValueError as err:
        error = str(err)
    else:
        error = None
    changed = [n for n, p in model.named_parameters() if not torch.equal(_full(p.detach()), before[n])]
    return {"error": error, "changed": changed}


def _placed_2d(name, layout, shape, seed=0):
    """(the MLP of ``seed``, ``name`` on its weights and Adam on its biases, placed by ``layout`` over a
    mesh of ``shape``, that mesh): see :func:`two_dimensional`."""
    model = mlp(seed)
    _annotate([model.fc1.weight, model.fc2.weight], name)
    _annotate([model.fc1.bias, model.fc2.bias], "adam")
    names = ("replicate", "shard") if layout == "hsdp" else ("dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if layout == "hsdp":
        overlap_optim.fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh["tp"], PLAN)
        overlap_optim.fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _dp_rows(mesh, shape) -> tuple[slice, slice]:
    """(this rank's rows of each step's batch: its dp coordinate's part, the rows of the global batch)."""
    rows = _batch(0)[0].shape[0] // shape[0]
    return slice(mesh.get_local_rank(0) * rows, (mesh.get_local_rank(0) + 1) * rows), slice(rows * shape[0])


def two_dimensional(rank, world_size, name, layout, shape, steps=3, statistics=True):
    """``layout`` "hsdp": ``overlap_optim.fully_shard`` over a (replicate, shard) mesh of ``shape``;
    "dp_tp": ``parallelize_module`` over the mesh's "tp" dimension, then ``overlap_optim.fully_shard``
    over its "dp" one. Each rank's batch is its dp (or replicate) coordinate's part of the global one.
    The weights with optimizer ``name``, the biases Adam; each step's largest difference from the
    reference on the global batch, and how far the reference moved. With ``statistics`` off (a
    mutation), every round of the pieces' steps is this rank's own."""
    model, mesh = _placed_2d(name, layout, shape)
    reference = mlp()
    if not statistics:
        for param in model.parameters():
            step = record_of(param).piece_step
            for round_ in (getattr(step, "round", None), getattr(getattr(step, "shard", None), "norm_round", None)):
                if round_ is not None:
                    round_.local = True
    ref_opts = [_reference([reference.fc1.weight, reference.fc2.weight], name),
                _reference([reference.fc1.bias, reference.fc2.bias], "adam")]
    start = [p.detach().clone() for p in reference.parameters()]
    mine, whole = _dp_rows(mesh, shape)
    diffs = [_step(model, reference, ref_opts, step, mine, whole) for step in range(steps)]
    return {"diffs": diffs, "moved": _moved(reference, start)}


def two_dimensional_dcp(rank, world_size, name, shape, directory, steps=2):
    """dp x tp over a mesh of ``shape`` with ``name`` on the weights: ``steps`` steps, a save with
    ``overlap_optim.checkpoint`` (DCP), a load into the same layout of other weights, ``steps`` more.
    Each step's largest difference from the reference on the global batch, and how far it moved."""
    from overlap_optim import checkpoint

    model, mesh = _placed_2d(name, "dp_tp", shape)
    reference = mlp()
    ref_opts = [_reference([reference.fc1.weight, reference.fc2.weight], name),
                _reference([reference.fc1.bias, reference.fc2.bias], "adam")]
    start = [p.detach().clone() for p in reference.parameters()]
    mine, whole = _dp_rows(mesh, shape)
    diffs = []
    for step in range(2 * steps):
        if step == steps:
            checkpoint.save(directory, model, overlap_optim.get_optimizers(model))
            model, _ = _placed_2d(name, "dp_tp", shape, seed=1)  # other weights: all must come from the checkpoint
            checkpoint.load(directory, model, overlap_optim.get_optimizers(model))
        diffs.append(_step(model, reference, ref_opts, step, mine, whole))
    return {"diffs": diffs, "moved": _moved(reference, start)}


def dmp_with_tp(rank, world_size, steps=3):
    """TorchRec's DMP with tables sharded by our sharder (fused Adagrad table_wise, fallback Adam
    row_wise, data-parallel SGD) and the MLP tensor-parallel over the "tp" dimension of a (dp 1,
    tp 2) mesh (``parallelize_module`` before DMP, then ``sharders.FullyShardWrapper`` over "dp"),
    Adafactor on its layers. Both ranks are one data-parallel replica: they read the same batch.
    Every weight is compared with the unsharded model under torch.optim after every step (inside
    step_side_by_side); returns how far the reference moved and the dense parameters' placements."""
    import sharders
    from _models import covering_batch
    from _sharded_parity import build, step_side_by_side

    names = ["t0", "t1", "t2"]
    settings = [(torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05}), (torch.optim.SGD, {"lr": 0.1})]
    types = {"t0": "table_wise", "t1": "row_wise", "t2": "data_parallel"}
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    tp = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    dmp, reference, ref_opts = build(
        names, settings, types, world_size, dense=(torch.optim.Adafactor, {"lr": 0.05}), dense_layers=(0, 2),
        wrapper=sharders.FullyShardWrapper(mesh=mesh["dp"]),
        before_dmp=lambda model: parallelize_module(model.dense, mesh["tp"], tp))
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for step in range(steps):
        batch = covering_batch(names, torch.Generator().manual_seed(800 + step))
        step_side_by_side(dmp, reference, ref_opts, names, [batch] * world_size, rank, step)
    return {
        "moved": {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()},
        "placements": sorted({str(p.placements) for n, p in dmp.named_parameters() if ".dense." in f".{n}"}),
    }


def checkpointed(rank, world_size, name, steps=2):
    """``steps`` steps with ``name`` on the weights (Adam on the biases), then the model's and
    ``get_optimizers``' state dicts loaded into a fresh tensor-parallel model, which trains ``steps``
    more: each step's largest difference from the reference, and how far the reference moved."""
    mesh = init_device_mesh("cpu", (world_size,))
    reference = mlp()
    ref_opts = [_reference([reference.fc1.weight, reference.fc2.weight], name),
                _reference([reference.fc1.bias, reference.fc2.bias], "adam")]

    def fresh(seed):
        model = mlp(seed)
        _annotate([model.fc1.weight, model.fc2.weight], name)
        _annotate([model.fc1.bias, model.fc2.bias], "adam")
        return parallelize_module(model, mesh, PLAN)

    model, diffs = fresh(0), []
    start = [p.detach().clone() for p in reference.parameters()]
    for step in range(2 * steps):
        if step == steps:
            saved = copy.deepcopy((model.state_dict(), overlap_optim.get_optimizers(model).state_dict()))
            model = fresh(1)  # other weights, fresh state: all of it must come from the checkpoint
            model.load_state_dict(saved[0])
            overlap_optim.get_optimizers(model).load_state_dict(saved[1])
        diffs.append(_step(model, reference, ref_opts, step))
    return {"diffs": diffs, "moved": _moved(reference, start)}


def torch_fully_shard_2d(rank, world_size):
    """Annotated, then torch's own ``fully_shard`` over a (replicate, shard) mesh: ``get_optimizers``'
    refusal, and whether its advice (``overlap_optim.fully_shard`` on that mesh) then trains."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    theirs, ours = mlp(), mlp()
    for model in (theirs, ours):
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    fully_shard(theirs.fc1, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    loop = loop_without_get_optimizers(theirs, _batch(0)[0])
    try:
        overlap_optim.get_optimizers(theirs)
        error = None
    except RuntimeError as err:
        error = str(err)
    overlap_optim.fully_shard(ours, mesh=mesh)
    return {"error": error, "keys": sorted(overlap_optim.get_optimizers(ours).params), "loop": loop}



def refused_two_splits(rank, world_size, name):
    """dp x tp on a 2 x 2 mesh with ``name`` on the weights: the error, and how many FSDP modules the
    model has after it (none: refused before torch's fully_shard ran)."""
    from torch.distributed.fsdp import FSDPModule

    cls, kwargs = _setting(name)
    model = mlp()
    overlap_optim.apply_optimizer_in_backward(cls, [model.fc1.weight, model.fc2.weight], kwargs)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], PLAN)
    try:
        overlap_optim.fully_shard(model, mesh=mesh["dp"])
    except ValueError as err:
        error = str(err)
    else:
        error = None
    return {"error": error, "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules())}
