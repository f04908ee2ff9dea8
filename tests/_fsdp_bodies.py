"""Rank bodies for the FSDP2 tests (spawned; not collected by pytest)."""

from __future__ import annotations

import contextlib
import copy
import gc

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap_optim
from overlap_optim.record import group_of, record_of

BIASES = (torch.optim.Adam, {"lr": 0.02})
BATCH = 4  # per rank


def mlp(seed: int = 0) -> nn.Sequential:
    """Rows 5, 3 and 1: no layer divides by 2 ranks, and the last leaves rank 1 an empty shard."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def _linears(model: nn.Sequential) -> list[nn.Linear]:
    return [m for m in model if isinstance(m, nn.Linear)]


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(400 + step)
    return torch.randn(world_size * BATCH, 6, generator=generator), torch.randn(world_size * BATCH, 1, generator=generator)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def sharded_pair(weights: tuple, seed: int = 0, biases: tuple = BIASES):
    """(ours: annotated and sharded by overlap_optim.fully_shard, the reference, its optimizers). The
    weights get ``weights`` = (class, kwargs) with one learning rate per layer (a setting each); the
    biases ``biases`` (Adam)."""
    cls, kwargs = weights
    model = mlp(seed)
    reference = copy.deepcopy(model)
    ref_opts = []
    for i, (ours, ref) in enumerate(zip(_linears(model), _linears(reference))):
        layer_kwargs = {**kwargs, "lr": kwargs["lr"] * (1 + i)}
        overlap_optim.apply_optimizer_in_backward(cls, [ours.weight], layer_kwargs)
        ref_opts.append(cls([ref.weight], **layer_kwargs))
    overlap_optim.apply_optimizer_in_backward(biases[0], [m.bias for m in _linears(model)], biases[1])
    ref_opts.append(biases[0]([m.bias for m in _linears(reference)], **biases[1]))
    return model, reference, ref_opts


def train(model, reference, ref_opts, rank, world_size, steps, before_step=None, ref_clip=None, by_name=None):
    """Each step: ours on this rank's part of the batch, the reference on the whole batch and
    ``torch.optim`` (after ``ref_clip()``, if given); the largest difference of any parameter after
    each step (and of each parameter, appended to ``by_name[fqn]``, if given)."""
    diffs = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x, y = _batch(step, world_size)
        _loss(model, x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]).backward()
        _loss(reference, x, y).backward()
        if ref_clip is not None:
            ref_clip()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
        each = {n: (_full(p) - q).abs().max().item() for (n, p), q in zip(model.named_parameters(), reference.parameters())}
        diffs.append(max(each.values()))
        if by_name is not None:
            for n, diff in each.items():
                by_name.setdefault(n, []).append(diff)
    return diffs


def parity(rank, world_size, weights, steps=4):
    """Every step against one process; also: how far the reference moved, whether a gradient is left,
    how many of the replaced (unsharded) parameters outlived ``fully_shard`` (no garbage collection)."""
    import weakref

    model, reference, ref_opts = sharded_pair(weights)
    start = [p.detach().clone() for p in reference.parameters()]
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = [weakref.ref(p) for p in model.parameters()]
    overlap_optim.fully_shard(model, mesh=mesh)
    outlived = sum(ref() is not None for ref in unsharded)
    diffs = train(model, reference, ref_opts, rank, world_size, steps)
    return {
        "diffs": diffs,
        "moved": min((p.detach() - s).abs().max().item() for p, s in zip(reference.parameters(), start)),
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
        "local_rows": [p.to_local().shape[0] for p in model.parameters()],
        "unsharded_outlived": outlived,
    }


def scheduled(rank, world_size, steps=5):
    """A LambdaLR on get_optimizers(model) against the same on the reference's optimizers; the keys."""
    model, reference, ref_opts = sharded_pair((torch.optim.Adam, {"lr": 0.05}))
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    keyed = overlap_optim.get_optimizers(model)

    def decay(step):
        return 0.5**step

    schedules = [torch.optim.lr_scheduler.LambdaLR(keyed, decay)]
    schedules += [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in ref_opts]

    def after_first(step):
        if step:
            for schedule in schedules:
                schedule.step()

    diffs = train(model, reference, ref_opts, rank, world_size, steps, before_step=after_first)
    state = keyed.state_dict()["state"]
    return {"diffs": diffs, "keys": sorted(keyed.params), "state_types": sorted({type(v["exp_avg"]).__name__
                                                                                for v in state.values()})}


def torch_fully_shard(rank, world_size):
    """Annotated, then torch's own fully_shard: get_optimizers must refuse that model, and accept one
    sharded by overlap_optim.fully_shard in the same process meanwhile (the check is per model)."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    theirs, ours = mlp(), mlp()
    for model in (theirs, ours):
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    for layer in _linears(theirs):
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    overlap_optim.fully_shard(ours, mesh=mesh)
    gc.collect()  # the replaced parameters and their annotation group are garbage: the check must not need them
    x = torch.randn(4, 6)
    found = {"ours": sorted(overlap_optim.get_optimizers(ours).params), "theirs": "",
             "loop": loop_without_get_optimizers(theirs, x), "ours_loop": loop_without_get_optimizers(ours, x)}
    try:
        overlap_optim.get_optimizers(theirs)
    except RuntimeError as error:
        found["theirs"] = str(error)
    return found


def loop_without_get_optimizers(model: nn.Module, x: torch.Tensor) -> dict:
    """Two steps of a loop that never calls ``get_optimizers``: the error of each, and whether any
    parameter of ``model`` changed."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    errors = []
    for _ in range(2):
        try:
            model(x).square().sum().backward()
            errors.append(None)
        except RuntimeError as err:
            errors.append(str(err))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    return {"errors": errors, "changed": changed}


def accumulated(rank, world_size, steps=3, micro=3, weights=(torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1})):
    """Each step: 2 micro-batches in no_step, the last outside; the reference: the 3 losses' gradients
    summed, then torch.optim. Returns the differences after each step and the reduce-scatters per step."""
    import torch.distributed as dist

    model, reference, ref_opts = sharded_pair(weights_of(weights) if isinstance(weights, str) else weights)
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    calls, original = [], dist.reduce_scatter_single  # what FSDP2 calls in torch 2.13
    diffs = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        for step in range(steps):
            x, y = _batch(step, world_size * micro)
            parts = x.view(micro, world_size, BATCH, 6), y.view(micro, world_size, BATCH, 1)
            for m in range(micro):
                with overlap_optim.no_step(model) if m < micro - 1 else contextlib.nullcontext():
                    (_loss(model, parts[0][m, rank], parts[1][m, rank]) / micro).backward()
            for m in range(micro):
                (_loss(reference, parts[0][m].reshape(-1, 6), parts[1][m].reshape(-1, 1)) / micro).backward()
            for opt in ref_opts:
                opt.step()
                opt.zero_grad()
            diffs.append(max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())))
    finally:
        dist.reduce_scatter_single = original
    return {"diffs": diffs, "reduce_scatters_per_step": len(calls) / steps}


CHECKPOINTED = (torch.optim.Adam, {"lr": 0.05, "amsgrad": True})


def weights_of(name: str) -> tuple:
    """The weights' (class, kwargs) of a checkpoint case "<weights>" or "<weights>+<biases>": "adam", or a
    layer-wise optimizer's name."""
    from _layerwise_bodies import LAYERWISE

    weights = name.split("+")[0]
    return CHECKPOINTED if weights == "adam" else LAYERWISE[weights]


def biases_of(name: str) -> tuple:
    """The biases' (class, kwargs) of a checkpoint case: Adam, or for "<weights>+<biases>" the layer-wise
    optimizer ``biases`` (of VECTORS; :func:`vector_setting`)."""
    return vector_setting(name.split("+")[1]) if "+" in name else BIASES


def reference_after(steps: int, world_size: int, weights: tuple = CHECKPOINTED, biases: tuple = BIASES):
    """(the unsharded reference, its optimizers) after ``steps`` steps on the global batches."""
    _, reference, ref_opts = sharded_pair(weights, biases=biases)
    for step in range(steps):
        x, y = _batch(step, world_size)
        _loss(reference, x, y).backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
    return reference, ref_opts


def _continue(model, reference, ref_opts, rank, world_size, step) -> tuple[float, float]:
    """(difference from the reference now, after one more step of both)."""
    loaded = max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    x, y = _batch(step, world_size)
    _loss(model, x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]).backward()
    _loss(reference, x, y).backward()
    for opt in ref_opts:
        opt.step()
        opt.zero_grad()
    return loaded, max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def checkpoint_to_ddp(rank, world_size, directory, weights="adam", steps=2):
    """Train under FSDP2, save with overlap_optim.checkpoint; load into the same MLP (another start)
    under DDP and, again, under FSDP2; after each load, one more step of it and of a copy of the
    reference: the differences after the load and after that step."""
    from torch.nn.parallel import DistributedDataParallel

    setting, biases = weights_of(weights), biases_of(weights)
    model, reference, ref_opts = sharded_pair(setting, biases=biases)
    mesh = init_device_mesh("cpu", (world_size,))
    overlap_optim.fully_shard(model, mesh=mesh)
    train(model, reference, ref_opts, rank, world_size, steps)
    overlap_optim.checkpoint.save(directory, model, overlap_optim.get_optimizers(model), {"step": steps})
    found = {}
    for target in ("ddp", "fsdp"):
        other, _, _ = sharded_pair(setting, seed=1, biases=biases)
        if target == "ddp":
            other = DistributedDataParallel(other)
            overlap_optim.register_optimizer_hook(other)
        else:
            overlap_optim.fully_shard(other, mesh=mesh)
        extra = overlap_optim.checkpoint.load(directory, other, overlap_optim.get_optimizers(other), {"step": None})
        ref, opts = reference_after(steps, world_size, setting, biases)  # the same run, again
        found[target] = (*_continue(other, ref, opts, rank, world_size, steps), extra["step"])
        if target == "ddp":  # and back: saved under DDP after that step, loaded under FSDP2
            back = f"{directory}/from_ddp"
            overlap_optim.checkpoint.save(back, other, overlap_optim.get_optimizers(other), {"step": steps + 1})
            sharded, _, _ = sharded_pair(setting, seed=2, biases=biases)
            overlap_optim.fully_shard(sharded, mesh=mesh)
            extra = overlap_optim.checkpoint.load(back, sharded, overlap_optim.get_optimizers(sharded), {"step": None})
            found["ddp_to_fsdp"] = (*_continue(sharded, ref, opts, rank, world_size, steps + 1), extra["step"] - 1)
    return found


def grouped(rank, world_size, steps=2):
    """Adam weights (a learning rate per layer) and Adam biases (another): per step, the sizes of the
    multi-tensor updates, and the differences from the reference."""
    from overlap_optim import update

    model, reference, ref_opts = sharded_pair((torch.optim.Adam, {"lr": 0.05}))
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    sizes, original = [], update.multi_tensor_step

    def counting(spec, params, *args):
        sizes.append(len(params))
        return original(spec, params, *args)

    update.multi_tensor_step = counting
    try:
        diffs = train(model, reference, ref_opts, rank, world_size, steps)
    finally:
        update.multi_tensor_step = original
    return {"diffs": diffs, "sizes": sizes}


class _HalfUsed(nn.Module):
    """One FSDP group of two parameters, of which forward uses one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.used, self.unused = nn.Parameter(torch.randn(5, 6)), nn.Parameter(torch.randn(5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.used.t()).sum(1, keepdim=True)


def unused(rank, world_size, steps=2):
    """A parameter with no gradient in its FSDP group: the other steps at the end of backward, and the
    unused one is left as torch.optim leaves it."""
    model = _HalfUsed()
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return {"diffs": train(model, reference, [torch.optim.Adam(reference.parameters(), lr=0.05)], rank, world_size,
                           steps)}


def dmp_with_fsdp(rank, world_size, steps=3):
    """Tables sharded by our sharder (fused Adagrad table_wise, fallback Adam row_wise, data-parallel
    SGD) and the MLP sharded by FSDP2 (sharders.FullyShardWrapper, AdamW): every weight compared with
    the unsharded model under torch.optim after every step (inside step_side_by_side); the keys of the
    one get_optimizers(model) and whether the MLP's parameters are sharded."""
    import sharders
    from _models import covering_batch
    from _sharded_parity import build, step_side_by_side

    names = ["t0", "t1", "t2"]
    settings = [(torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05}), (torch.optim.SGD, {"lr": 0.1})]
    types = {"t0": "table_wise", "t1": "row_wise", "t2": "data_parallel"}
    wrapper = sharders.FullyShardWrapper(mesh=init_device_mesh("cpu", (world_size,)))
    dmp, reference, ref_opts = build(names, settings, types, world_size, dense=(torch.optim.AdamW, {"lr": 0.02,
                                     "weight_decay": 0.1}), dense_layers=(0, 2), wrapper=wrapper)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for step in range(steps):
        generator = torch.Generator().manual_seed(800 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        step_side_by_side(dmp, reference, ref_opts, names, parts, rank, step)
    return {
        "keys": sorted(overlap_optim.get_optimizers(dmp).params),
        "dense_types": sorted({type(p).__name__ for n, p in dmp.named_parameters() if ".dense." in f".{n}"}),
        "moved": {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()},
    }


def layerwise(rank, world_size, name, steps=4, statistics=True):
    """The weights with a layer-wise optimizer (tests/_layerwise_bodies.LAYERWISE), the biases Adam, each
    step against the package on one process; the all-reduces of one backward; with ``statistics`` off
    (a mutation: each shard keeps its own sums), the same differences, which must then be large."""
    from _layerwise_bodies import GALORE_OPTIONS, LAYERWISE

    if name == "galore":  # the settings of its projection go in its param group
        from pytorch_optimizer import GaLore

        cls, kwargs, options = GaLore, {"lr": 0.02, "weight_decay": 0.01}, GALORE_OPTIONS
    else:
        (cls, kwargs), options = LAYERWISE[name], {}
    model, reference, ref_opts = mlp(), None, []
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(cls, [m.weight for m in _linears(model)], kwargs,
                                              group_options=options or None)
    overlap_optim.apply_optimizer_in_backward(BIASES[0], [m.bias for m in _linears(model)], BIASES[1])
    ref_opts = [cls([{"params": [m.weight for m in _linears(reference)], **options}], **kwargs),
                BIASES[0]([m.bias for m in _linears(reference)], **BIASES[1])]
    start = [p.detach().clone() for p in reference.parameters()]
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    if not statistics:
        _make_rounds_local(model)
    with _all_reduces() as reduces:
        diffs = train(model, reference, ref_opts, rank, world_size, steps)
    return {"diffs": diffs, "all_reduces_per_step": len(reduces) / steps, "floats": sorted(set(reduces)),
            "moved": min((p.detach() - s).abs().max().item() for p, s in zip(reference.parameters(), start))}


def _make_rounds_local(model: nn.Module) -> None:
    """The mutation: each shard finishes its cross-shard step on its own sums."""
    for param in model.parameters():
        step = getattr(record_of(param), "piece_step", None)
        if step is not None:
            step.round.local = True


@contextlib.contextmanager
def _all_reduces():
    """The sizes of the all-reduces run inside, in a list."""
    import torch.distributed as dist

    reduces, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield reduces
    finally:
        dist.all_reduce = original


# The layer-wise optimizers that step vectors (torch's Muon steps matrices only).
VECTORS = ("adafactor", "came", "lamb", "lars")


def vector_setting(name: str) -> tuple:
    """(class, kwargs) of tests/_layerwise_bodies.LAYERWISE[name], with a weight decay where it has none
    (LARS, as its package does, decays and scales no vector)."""
    from _layerwise_bodies import LAYERWISE

    cls, kwargs = LAYERWISE[name]
    return cls, {"weight_decay": 0.05, **kwargs}


def layerwise_vectors(rank, world_size, name, steps=4, statistics=True, state_dtype=None):
    """Every parameter of the MLP with the layer-wise optimizer ``name`` (of VECTORS), its biases of 5, 3
    and 1 elements included (rank 1 holds 2, 1 and none of them), against the package on one process,
    every step. Returns the differences after each step (of any parameter, of the biases), how far the
    reference moved its parameters, the all-reduces per step, the local sizes of the biases, and the
    state against the reference's (:func:`_state_against`); with ``statistics`` off, the mutation. With
    ``state_dtype`` (the annotation's), the reference rounds each state tensor to it after each step, and
    ``"state_dtypes"`` are those of our state tensors."""
    from _precision_bodies import round_state

    cls, kwargs = vector_setting(name)
    model = mlp()
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs, state_dtype=state_dtype)
    ref_opt = cls(reference.parameters(), **kwargs)
    start = [p.detach().clone() for p in reference.parameters()]
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    if not statistics:
        _make_rounds_local(model)
    by_name = {}
    with _all_reduces() as reduces:  # the reference's state rounded after each step: before the next, and at the end
        diffs = train(model, reference, [ref_opt], rank, world_size, steps, by_name=by_name,
                      before_step=lambda step: round_state(ref_opt, state_dtype))
    round_state(ref_opt, state_dtype)
    state = overlap_optim.get_optimizers(model).state_dict()["state"]
    dtypes = sorted({str(v.dtype) for entry in state.values() for v in entry.values() if torch.is_tensor(v) and v.dim()})
    biases = [n for n, p in model.named_parameters() if p.dim() == 1]
    return {"diffs": diffs, "bias_diffs": [max(step) for step in zip(*(by_name[n] for n in biases))],
            "moved": min((p.detach() - s).abs().max().item() for p, s in zip(reference.parameters(), start)),
            "all_reduces_per_step": len(reduces) / steps,
            "bias_rows": [model.get_parameter(n).to_local().shape[0] for n in biases], "state_dtypes": dtypes,
            **_state_against(model, reference, ref_opt)}


def _state_against(model, reference, ref_opt) -> dict:
    """``get_optimizers(model).state_dict()`` against the reference optimizer's state: the parameters whose
    state names are not the reference's (plus the counters the optimizer keeps in its param group), the
    entries of another global shape, the largest difference of any entry, and (vector, name, type) of
    each vector's per-element entries."""
    state = overlap_optim.get_optimizers(model).state_dict()["state"]
    counters = set(group_of(next(model.parameters())).spec.group_state)
    names, shapes, largest, kinds = [], [], 0.0, set()
    for fqn, ref_param in reference.named_parameters():
        ours, theirs = state[fqn], ref_opt.state[ref_param]
        if set(ours) != set(theirs) | counters:
            names.append((fqn, sorted(ours), sorted(theirs)))
            continue
        for key, want in theirs.items():
            got = ours[key]
            if isinstance(want, torch.Tensor) and want.dim():
                if ref_param.dim() == 1:
                    kinds.add((fqn, key, type(got).__name__))
                got = _full(got)
                if got.shape != want.shape:
                    shapes.append((fqn, key, tuple(got.shape), tuple(want.shape)))
                    continue
            largest = max(largest, (torch.as_tensor(got, dtype=torch.float64) - torch.as_tensor(
                want, dtype=torch.float64)).abs().max().item())
    return {"state_names": names, "state_shapes": shapes, "state_diff": largest, "vector_state": sorted(kinds)}


def clipped(rank, world_size, how, weights=(torch.optim.Adam, {"lr": 0.05}), steps=3):
    """Every parameter in one clipping set (``how``: {"max_norm": ...} or {"clip_value": ...}), declared
    before fully_shard; the reference clips with torch.nn.utils before torch.optim. The differences after
    each step, and ours' and torch's global norms."""
    from _layerwise_bodies import LAYERWISE

    if isinstance(weights, str):
        weights = LAYERWISE[weights]
    model = mlp()
    reference = copy.deepcopy(model)
    overlap_optim.apply_optimizer_in_backward(weights[0], [m.weight for m in _linears(model)], weights[1])
    overlap_optim.apply_optimizer_in_backward(BIASES[0], [m.bias for m in _linears(model)], BIASES[1])
    ref_opts = [weights[0]([m.weight for m in _linears(reference)], **weights[1]),
                BIASES[0]([m.bias for m in _linears(reference)], **BIASES[1])]
    clip = overlap_optim.apply_gradient_clipping(model.parameters(), **how)
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    norms = {"ours": [], "torch": []}

    def ref_clip():
        if "max_norm" in how:
            norms["torch"].append(torch.nn.utils.clip_grad_norm_(reference.parameters(), how["max_norm"]).item())
            norms["ours"].append(clip.total_norm.item())
        else:
            norms["torch"].append(max(p.grad.abs().max().item() for p in reference.parameters()))  # before
            torch.nn.utils.clip_grad_value_(reference.parameters(), how["clip_value"])

    diffs = train(model, reference, ref_opts, rank, world_size, steps, ref_clip=ref_clip)
    return {"diffs": diffs, "norms": norms}
