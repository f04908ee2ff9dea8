"""Rank bodies of the low-precision table tests (spawned; not collected by pytest).

The stated reference, in plain torch: each table is kept as stored (FP16 or BF16); every step
reads a float32 copy of it, runs forward and backward on the global batch in float32, steps
``torch.optim`` (float32 state) on that copy, and rounds the result once to the stored dtype,
to nearest even. Ours is sharded on 2 ranks and compared with it, ulp by ulp, after every step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec import KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import DataType
from pytorch_optimizer import Lamb
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import overlap_optim
import sharders
from overlap_optim import apply_optimizer_in_backward

ROWS, DIM, BATCH = 16, 16, 4  # 16 columns: column_wise makes several shards
DATA_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.2}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "adafactor": (torch.optim.Adafactor, {"lr": 0.05}),
    "lamb": (Lamb, {"lr": 0.02, "weight_decay": 0.01}),  # pytorch-optimizer's, as a user would build it
}
# The reference's own torch.optim options, where they matter: ours steps AdamW's rows with torch's fused
# CPU kernel (what AdamW(fused=True) calls), whose decoupled decay rounds in float32 otherwise than the
# single-tensor AdamW (1 FP16 ulp at the first step, measured here, then fed back through the loss).
REFERENCE_OPTIONS = {"adamw": {"fused": True}}
# Untouched rows do not move under these (a zero gradient, no momentum yet, no weight decay): lazy and
# dense torch.optim agree, so batches that touch some rows have a plain-torch reference too.
LAZY_IS_DENSE = ("sgd", "adagrad", "rowwise_adagrad")
NAMES = ("t0", "t1")


def _batch(generator: torch.Generator, cover: bool) -> KeyedJaggedTensor:
    """One rank's batch: per table a feature of BATCH bags; with ``cover``, bag 0 holds every row,
    else every bag 2 ids from the first half of the rows (the second half untouched)."""
    lengths, values = [], []
    for _ in NAMES:
        for sample in range(BATCH):
            if cover and sample == 0:
                ids = torch.randperm(ROWS, generator=generator)
            else:
                ids = torch.randint(0, ROWS if cover else ROWS // 2, (2,), generator=generator)
            lengths.append(ids.numel())
            values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in NAMES], values=torch.cat(values), lengths=torch.tensor(lengths))


def _collection(dtype: torch.dtype, pooled: bool) -> nn.Module:
    if pooled:
        return EmbeddingBagCollection(device=torch.device("meta"), tables=[
            EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{n}"],
                               data_type=DATA_TYPES[dtype]) for n in NAMES])
    return EmbeddingCollection(device=torch.device("meta"), tables=[
        EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{n}"],
                        data_type=DATA_TYPES[dtype]) for n in NAMES])


def _outputs(out, pooled: bool) -> list[torch.Tensor]:
    """Each table's output: ``[bags, dim]`` pooled, ``[ids, dim]`` not."""
    return [out[f"f_{n}"] if pooled else out[f"f_{n}"].values() for n in NAMES]


def _reference_outputs(tables: list[torch.Tensor], kjt: KeyedJaggedTensor, pooled: bool) -> list[torch.Tensor]:
    outs = []
    for name, table in zip(NAMES, tables):
        feature = kjt[f"f_{name}"]
        if pooled:
            outs.append(nn.functional.embedding_bag(feature.values(), table, feature.offsets()[:-1], mode="sum"))
        else:
            outs.append(table.index_select(0, feature.values()))
    return outs


def _loss(outputs: list[torch.Tensor], heads: list[torch.Tensor]) -> torch.Tensor:
    return sum((out.float() @ head).square().sum() for out, head in zip(outputs, heads))


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units in the last place between two tensors of one dtype (FP16,
    BF16 or FP32; their bit patterns as ordered integers)."""
    def ordered(x):
        wide = x.element_size() == 4
        bits = x.contiguous().view(torch.int32 if wide else torch.int16).long()
        sign = 0x7FFFFFFF if wide else 0x7FFF
        return torch.where(bits < 0, -(bits & sign), bits)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _shard(dmp: nn.Module, name: str, pooled: bool):
    """This rank's shards of table ``name``: (offsets, tensor); a data-parallel table's is the whole."""
    held = dmp.state_dict()[f"embedding{'_bags' if pooled else 's'}.{name}.weight"]
    if _replicated(held):
        return [((0, 0), held)]
    return [(s.metadata.shard_offsets, s.tensor) for s in held.local_shards()]


def _replicated(held) -> bool:
    """A data-parallel table's state-dict entry: a plain tensor every rank holds (no ShardedTensor)."""
    return not hasattr(held, "local_shards")


def _whole(dmp: nn.Module, name: str, pooled: bool, dtype: torch.dtype) -> torch.Tensor:
    """Our table ``name`` whole, from every rank's shards (each element from one shard: exact); a
    data-parallel table's from this rank, and it must be the same on every rank."""
    whole = torch.zeros(ROWS, DIM)
    for (row, col), local in _shard(dmp, name, pooled):
        whole[row : row + local.shape[0], col : col + local.shape[1]] = local.float()
    if _replicated(dmp.state_dict()[f"embedding{'_bags' if pooled else 's'}.{name}.weight"]):  # the ranks agree
        other = whole.clone()
        dist.broadcast(other, 0)
        assert torch.equal(other, whole), f"table {name}: the ranks hold different weights"
        return whole.to(dtype)
    dist.all_reduce(whole)
    return whole.to(dtype)


def round_state(optimizer: torch.optim.Optimizer, state_dtype: torch.dtype | None) -> None:
    """The reference of low-precision state: each state tensor (step counters aside) rounded to
    ``state_dtype`` after the step, to nearest even, kept as float32 values."""
    if state_dtype is None:
        return
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim():
                    value.copy_(value.to(state_dtype))


class _Reference:
    """The stated reference: float32 copies of the stored tables, torch.optim on them, one rounding."""

    def __init__(self, stored: list[torch.Tensor], optimizer: str, state_dtype: torch.dtype | None = None) -> None:
        cls, kwargs = OPTIMIZERS[optimizer]
        self.state_dtype = state_dtype
        self.stored = [t.clone() for t in stored]
        self.copies = [nn.Parameter(t.float()) for t in stored]
        self.optimizer = cls(self.copies, **kwargs, **REFERENCE_OPTIONS.get(optimizer, {}))

    def step(self, parts: list[KeyedJaggedTensor], heads: list[torch.Tensor], pooled: bool) -> None:
        with torch.no_grad():
            for copy, table in zip(self.copies, self.stored):
                copy.copy_(table.float())  # re-read from the stored precision every step
        outputs = [_reference_outputs(self.copies, part, pooled) for part in parts]
        (sum(_loss(out, heads) for out in outputs) / len(parts)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        round_state(self.optimizer, self.state_dtype)
        self.stored = [copy.detach().to(self.stored[0].dtype) for copy in self.copies]  # one rounding, to nearest even


def train(rank, world_size, dtype, optimizer, sharding_type, pooled=True, steps=4, mutant=None, state_dtype=None,
          reload=False, split=False, dense=False, fallback=False, frozen=False):
    """Ours against the stated reference; ``{"ulps": worst per step, "step_ulps": the same against a
    reference that reads our weights at the start of each step (one step's own difference, not fed
    back through the loss), "moved": ulps the reference moved, "state": dtypes of the optimizer
    state}``. ``mutant``: "round_gradient" (the gradient rounded to the stored dtype before the
    update) or "master_copy" (a float32 copy kept between steps: the final rounding skipped), on touched rows, or
    "dense_master_copy" on whole-shard and cross-shard tables. ``state_dtype``: the annotation's. ``reload``:
    mid-run, the optimizer's state_dict() loaded into a fresh model. ``split``: column_wise in two shards of 8
    columns (else TorchRec keeps 16 columns in one). ``dense``: the tables in ``dense_tables``;
    ``fallback``: in ``fallback_tables``. Also ``"runs_as"``: describe()'s "runs as" of each kernel."""
    torch.manual_seed(0)
    init = [(torch.randn(ROWS, DIM) * 0.5).to(dtype) for _ in NAMES]
    heads = [torch.randn(DIM) for _ in NAMES]
    restore = _mutate(mutant)
    try:
        options = {"split": split, "dense": dense, "fallback": fallback, "frozen": frozen}
        dmp = _sharded(world_size, dtype, optimizer, sharding_type, pooled, init, state_dtype, **options)
        reference, synced = _Reference(init, optimizer, state_dtype), _Reference(init, optimizer, state_dtype)
        worst, step_worst = [], []
        for step in range(steps):
            # dense semantics (data_parallel): every optimizer sees half-touched batches
            cover = (optimizer not in LAZY_IS_DENSE and sharding_type != "data_parallel") or step % 2 == 0
            generator = torch.Generator().manual_seed(100 + step)
            parts = [_batch(generator, cover) for _ in range(world_size)]
            if reload and step == steps // 2:  # into a fresh model and optimizer, mid-run
                saved = overlap_optim.get_optimizers(dmp).state_dict()
                weights = [_whole(dmp, name, pooled, dtype) for name in NAMES]
                dmp = _sharded(world_size, dtype, optimizer, sharding_type, pooled, weights, state_dtype, **options)
                overlap_optim.get_optimizers(dmp).load_state_dict(saved)
            synced.stored = [_whole(dmp, name, pooled, dtype) for name in NAMES]
            synced.optimizer.load_state_dict(copy.deepcopy(reference.optimizer.state_dict()))  # its state, our weights
            _loss(_outputs(dmp(parts[rank]), pooled), heads).backward()
            reference.step(parts, heads, pooled)
            synced.step(parts, heads, pooled)
            for out, against in ((worst, reference), (step_worst, synced)):
                out.append(max(ulps(local, table[row : row + local.shape[0], col : col + local.shape[1]])
                               for name, table in zip(NAMES, against.stored)
                               for (row, col), local in _shard(dmp, name, pooled)))
        stored = reference.stored
        state = overlap_optim.get_optimizers(dmp).state_dict()["state"]
        dtypes = sorted({str(v.dtype) for entry in state.values() for v in entry.values() if torch.is_tensor(v)
                         and v.dim() > 0})
        return {"ulps": worst, "step_ulps": step_worst, "moved": max(ulps(s, t) for s, t in zip(stored, init)),
                "state": dtypes, "memory": _held_and_planned(dmp), "runs_as": _runs_as(dmp)}
    finally:
        restore()


def _runs_as(dmp: nn.Module) -> list[str]:
    """``describe()``'s "runs as" cell of each kernel of every rank."""
    from sharders.describe import kernel_rows
    return [row[6] for row in kernel_rows(dmp)]


def _held_and_planned(dmp: nn.Module) -> list[tuple[float, float]]:
    """``describe()``'s memory column, per kernel of every rank: (bytes held, bytes planned)."""
    units = {"B": 1, "KiB": 1024, "MiB": 1024**2}
    rows = sharders.describe(dmp).splitlines()[2:]
    cells = [row.strip(" |").split(" | ")[-1].split(" / ") for row in rows]
    return [tuple(float(v.split()[0]) * units[v.split()[1]] for v in pair) for pair in cells]


def _sharded(world_size, dtype, optimizer, sharding_type, pooled, init, state_dtype=None, split=False, dense=False,
             fallback=False, frozen=False):
    """The collection of ``dtype`` tables sharded by ours, each table set to ``init``; ``split``: column
    shards of 8 columns; ``dense``: every table in ``dense_tables``; ``fallback``: in ``fallback_tables``;
    ``optimizer="user"``: not annotated; ``frozen``: requires_grad=False."""
    collection = _collection(dtype, pooled)
    if optimizer != "user":
        cls, kwargs = OPTIMIZERS[optimizer]
        apply_optimizer_in_backward(cls, collection.parameters(), kwargs, state_dtype=state_dtype)
    for weight in collection.parameters() if frozen else ():
        weight.requires_grad_(False)
    sharder = (sharders.EmbeddingBagCollectionSharder if pooled else sharders.EmbeddingCollectionSharder)(
        dense_tables=NAMES if dense else (), fallback_tables=NAMES if fallback else ())
    partition = {"min_partition": DIM // 2} if split else {}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=[sharding_type], **partition) for n in NAMES})
    plan = planner.collective_plan(collection, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(collection, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    _set(dmp, init, pooled)
    return dmp


def _set(dmp, tables, pooled=True):
    with torch.no_grad():
        for name, start in zip(NAMES, tables):
            for (row, col), local in _shard(dmp, name, pooled):
                local.copy_(start[row : row + local.shape[0], col : col + local.shape[1]])


def checkpoint_dtypes(rank, world_size, directory, saved, loaded):
    """Adagrad tables of dtype ``saved``, trained a step and saved, loaded into fresh ``loaded``
    ones (zeros) by every load form. Per form, ``{"refused": the message without asking for the cast
    (None if it loaded), "unchanged": the tables still zero after it, "ulps": ours after the cast (or
    the load) against the saved weights rounded once by ``.to(loaded)`` (FP32: elements that differ),
    "state": the optimizer state loaded equals the saved one}``. Forms: ``checkpoint`` (row_wise saved,
    table_wise loaded; ``checkpoint.load``, then ``cast=True``), ``state_dict`` (plain ``torch.save`` /
    ``load_state_dict`` of the model and ``get_optimizers``, then the dict's tensors cast by
    ``.to(loaded)``), ``plain_tensors`` (whole tensors, refusal only) and ``dcp`` (``dcp.load`` with
    ``checkpoint.LoadPlanner()``, then ``LoadPlanner(cast=True)``)."""
    from overlap_optim import checkpoint

    torch.manual_seed(1)
    source = _sharded(world_size, saved, "adagrad", "row_wise", True, [torch.randn(ROWS, DIM).to(saved) for _ in NAMES])
    _loss(_outputs(source(_batch(torch.Generator().manual_seed(7 + rank), True)), True),
          [torch.randn(DIM) for _ in NAMES]).backward()
    weights = [_whole(source, n, True, saved) for n in NAMES]
    path = checkpoint.save(f"{directory}/{saved}-{loaded}", source, overlap_optim.get_optimizers(source))
    target = _sharded(world_size, loaded, "adagrad", "table_wise", True, [torch.zeros(ROWS, DIM, dtype=loaded)] * 2)
    forms = {
        "checkpoint": lambda cast: checkpoint.load(path, target, overlap_optim.get_optimizers(target), cast=cast),
        "state_dict": _plain_load(f"{directory}/{saved}-{loaded}-rank{rank}.pt", source, weights, target, loaded),
        "dcp": lambda cast: _dcp_load(path, target, cast),
    }
    out = {name: _refused_then_cast(target, load, source, weights, loaded) for name, load in forms.items()}
    if saved != loaded:
        wholes = {f"embedding_bags.{n}.weight": w for n, w in zip(NAMES, weights)}
        out["plain_tensors"] = {"refused": _refusal(lambda: target.load_state_dict(wholes)),
                                "unchanged": all(_whole(target, n, True, loaded).eq(ours.to(loaded)).all().item()
                                                 for n, ours in zip(NAMES, weights))}
    return out


def _refused_then_cast(target, load, source, weights, loaded):
    """``load(cast=False)`` on zero tables, then ``load(cast=True)`` (see :func:`checkpoint_dtypes`)."""
    _set(target, [torch.zeros(ROWS, DIM, dtype=loaded)] * 2)
    message = _refusal(lambda: load(False))
    unchanged = all(_whole(target, n, True, loaded).eq(0).all().item() for n in NAMES)
    if message is not None:
        load(True)
    ours = [_whole(target, n, True, loaded) for n in NAMES]
    cast = max(ulps(o, w.to(loaded)) if loaded != torch.float32 else int((o != w.float()).sum())
               for o, w in zip(ours, weights))
    return {"refused": message, "unchanged": unchanged, "ulps": cast,
            "state": _same_state(overlap_optim.get_optimizers(source), overlap_optim.get_optimizers(target))}


def _refusal(load):
    """The message of ``load()``'s refusal, None if it loads. ``dcp.load`` raises each rank's error
    inside its ``CheckpointException``: there, every rank's message, which must be one."""
    from torch.distributed.checkpoint.api import CheckpointException

    from overlap_optim.checkpoint import CheckpointError

    try:
        load()
    except CheckpointError as error:
        return str(error)
    except CheckpointException as error:
        messages = {str(exc) for exc, _ in error.failures.values() if isinstance(exc, CheckpointError)}
        assert len(messages) == 1 and sorted(error.failures) == list(range(dist.get_world_size())), error
        return messages.pop()
    return None


def _plain_load(file, source, weights, target, loaded):
    """The plain torch form: the model saved under the target's plan (table_wise: TorchRec loads a
    ShardedTensor's local shards as they are), and ``get_optimizers``' state dict."""
    twin = _sharded(dist.get_world_size(), weights[0].dtype, "adagrad", "table_wise", True, weights)
    torch.save({"model": twin.state_dict(), "optim": overlap_optim.get_optimizers(source).state_dict()}, file)

    def load(cast):
        state = torch.load(file, weights_only=False)
        model = {k: v.to(loaded) for k, v in state["model"].items()} if cast else state["model"]
        target.load_state_dict(model)
        overlap_optim.get_optimizers(target).load_state_dict(state["optim"])
    return load


def _dcp_load(path, target, cast):
    """The documented recipe, with ``checkpoint.LoadPlanner(cast=cast)``."""
    import torch.distributed.checkpoint as dcp

    from overlap_optim import checkpoint

    opt = overlap_optim.get_optimizers(target)
    state = {"model": target.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=str(path), planner=checkpoint.LoadPlanner(cast=cast))
    target.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _same_state(ours, theirs) -> bool:
    """Whether two keyed optimizers hold equal state (whole tensors, gathered: a collective)."""
    from overlap_optim._private import ShardedTensor
    from overlap_optim._state_schema import whole_tensor

    def whole(value):
        return whole_tensor(value) if isinstance(value, ShardedTensor) else value
    a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
    return sorted(a) == sorted(b) and all(
        sorted(a[k]) == sorted(b[k]) and all(torch.equal(whole(a[k][n]), whole(b[k][n])) for n in sorted(a[k]))
        for k in sorted(a))


def refused(rank, world_size, dtype, optimizer, sharding_type, pooled=True, state_dtype=None, split=False,
            frozen=False):
    """The message of the refusal when sharding (None if it shards). ``optimizer="user"``: no
    annotation (the user's optimizer steps it); ``frozen``: requires_grad=False."""
    try:
        train(rank, world_size, dtype, optimizer, sharding_type, pooled, steps=1, state_dtype=state_dtype, split=split,
              frozen=frozen)
    except (NotImplementedError, ValueError) as error:
        return str(error)
    return None


def _mutate(mutant):
    from overlap_optim.table_optimizer import DenseTableOptimizer, RowOptimizer

    if mutant == "dense_master_copy":
        return _keep_master_copy(DenseTableOptimizer)
    prepare, finish = RowOptimizer.prepare, RowOptimizer.finish
    if mutant in _REPLICATED_MUTANTS:
        return _REPLICATED_MUTANTS[mutant]()
    if mutant == "round_gradient":
        def rounded(self, ids, grads):
            rows, grad, state = prepare(self, ids, grads)
            return rows, grad.to(self.weight.dtype).float(), state
        RowOptimizer.prepare = rounded
    elif mutant == "master_copy":
        def from_master(self, ids, grads):
            rows, grad, state = prepare(self, ids, grads)
            master = self.__dict__.setdefault("_master", self.weight.float())
            return master.index_select(0, ids), grad, state

        def to_master(self, ids, rows, stepped):
            self.__dict__["_master"].index_copy_(0, ids, rows)
            finish(self, ids, rows, stepped)
        RowOptimizer.prepare, RowOptimizer.finish = from_master, to_master
    else:
        assert mutant is None, mutant

    def restore():
        RowOptimizer.prepare, RowOptimizer.finish = prepare, finish
    return restore


def _keep_master_copy(cls):
    """Mutate ``cls`` (DenseTableOptimizer, and so the cross-shard forms) to step a float32 master copy kept
    between steps instead of the stored weights: the final rounding skipped. Returns the undo."""
    ready, close = cls.ready, cls.close

    def from_master(self):
        state = ready(self)
        if "_master" in self.__dict__:
            self.stepped.data = self.__dict__["_master"]
        return state

    def to_master(self):
        self.__dict__["_master"] = self.stepped.detach().clone()
        close(self)
    cls.ready, cls.close = from_master, to_master

    def restore():
        cls.ready, cls.close = ready, close
    return restore


def _replicated_mutant(cls, name, mutated):
    """Replace ``cls.name`` with ``mutated(original)``; returns the restore."""
    original = getattr(cls, name)
    setattr(cls, name, mutated(original))
    return lambda: setattr(cls, name, original)


def _summed_not_averaged():
    """A data-parallel table stepped on the sum of the ranks' gradients (not divided by their number)."""
    import torch.distributed as dist
    from sharders.replicated import ReplicatedRows

    return _replicated_mutant(ReplicatedRows, "_averaged", lambda averaged: (
        lambda self, rows, summed: averaged(self, rows, summed * dist.get_world_size())))


def _replicated_round_gradient():
    """A data-parallel table's averaged gradient rounded to the stored dtype before the step."""
    from sharders.replicated import ReplicatedTableOptimizer

    return _replicated_mutant(ReplicatedTableOptimizer, "step_whole", lambda step_whole: (
        lambda self, grad: step_whole(self, grad.to(self.weight.dtype).float())))


_REPLICATED_MUTANTS = {"dp_summed": _summed_not_averaged, "dp_round_gradient": _replicated_round_gradient}


def ddp_state(rank, world_size, state_dtype, steps=4):
    """An MLP annotated with Adam and ``state_dtype`` state, stepped in our DDP hook, against one
    process of ``torch.optim`` on the global batch with each state tensor rounded after each step,
    the reference starting each step from our weights and state. ``{"diffs": largest weight
    difference per step, "state_ulps": largest state difference per step, "state": state dtypes}``."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.01}, state_dtype=state_dtype)
    ours = DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ours)
    keyed = overlap_optim.get_optimizers(ours)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    names = [n for n, _ in reference.named_parameters()]
    diffs, state_ulps = [], []
    for step in range(steps):
        with torch.no_grad():  # the reference starts from our weights and state
            for mine, theirs in zip(model.parameters(), reference.parameters()):
                theirs.copy_(mine)
        saved = keyed.state_dict()["state"] if step else {}  # before the first step: placeholders
        for name, param in reference.named_parameters():
            if name in saved:
                ref_opt.state[param] = {k: v.float().clone() if v.dim() else v.clone() for k, v in saved[name].items()}
        generator = torch.Generator().manual_seed(50 + step)
        inputs = torch.randn(world_size * 8, 16, generator=generator)
        ours(inputs[rank * 8 : (rank + 1) * 8]).square().mean().backward()
        reference(inputs).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        round_state(ref_opt, state_dtype)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())))
        mine = keyed.state_dict()["state"]
        state_ulps.append(max(ulps(mine[n][k], ref_opt.state[p][k].to(state_dtype))
                              for n, p in zip(names, reference.parameters()) for k in ("exp_avg", "exp_avg_sq")))
    state = keyed.state_dict()["state"]
    dtypes = sorted({str(v.dtype) for entry in state.values() for v in entry.values() if torch.is_tensor(v)
                     and v.dim() > 0})
    return {"diffs": diffs, "state_ulps": state_ulps, "state": dtypes}


def clipped_window(rank, world_size, micro=2, steps=3, bound=1.0, mutant=False):
    """An FP16 data-parallel table (t0) beside a float32 one (t1, our DDP hook), both SGD with
    momentum (whose step scales with the gradient: the clipping shows), in one clipping set by
    norm, ``micro`` micro-batches a step (all but the last in ``no_step``), against plain torch on
    the global batch: float32 copies, each micro-batch's mean loss over the ranks backward,
    ``clip_grad_norm_`` over both, SGD, t0 rounded once to FP16. ``mutant``: t0's kernel blind to
    the window (it reduces and steps at every micro-batch).
    ``{"ulps": t0 per step, "diffs": t1 per step, "norms": (reference, ours) per step, "moved": t0's ulps}``."""
    from sharders import replicated

    if mutant:
        window_of_module, replicated.window_of_module = replicated.window_of_module, lambda module: None
    try:
        return _clipped_window(rank, world_size, micro, steps, bound)
    finally:
        if mutant:
            replicated.window_of_module = window_of_module


def _clipped_window(rank, world_size, micro, steps, bound):
    settings = {"lr": 0.5, "momentum": 0.9}
    torch.manual_seed(0)
    dtypes = {"t0": torch.float16, "t1": torch.float32}
    init = [(torch.randn(ROWS, DIM) * 0.5).to(dtypes[n]) for n in NAMES]
    heads = [torch.randn(DIM) for _ in NAMES]
    collection = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{n}"],
                           data_type=DATA_TYPES[dtypes[n]]) for n in NAMES])
    apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), settings)
    clip = overlap_optim.apply_gradient_clipping(collection.parameters(), max_norm=bound)
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=["data_parallel"]) for n in NAMES})
    plan = planner.collective_plan(collection, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(collection, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    _set(dmp, init)
    copies = [nn.Parameter(t.float()) for t in init]
    reference = torch.optim.SGD(copies, **settings)
    ulps_t0, diffs_t1, norms = [], [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(300 + step)
        batches = [[_batch(generator, cover=step % 2 == 0) for _ in range(world_size)] for _ in range(micro)]
        for m, parts in enumerate(batches):
            with overlap_optim.no_step(dmp) if m < micro - 1 else contextlib.nullcontext():
                _loss(_outputs(dmp(parts[rank]), True), heads).backward()
            outputs = [_reference_outputs(copies, part, True) for part in parts]
            (sum(_loss(out, heads) for out in outputs) / world_size).backward()
        norms.append((torch.nn.utils.clip_grad_norm_(copies, bound).item(), clip.total_norm.item()))
        reference.step()
        reference.zero_grad()
        with torch.no_grad():
            copies[0].copy_(copies[0].to(torch.float16))  # the stored table: one rounding a step
        ulps_t0.append(ulps(_whole(dmp, "t0", True, torch.float16), copies[0].detach().to(torch.float16)))
        diffs_t1.append((_whole(dmp, "t1", True, torch.float32) - copies[1].detach()).abs().max().item())
    return {"ulps": ulps_t0, "diffs": diffs_t1, "norms": norms,
            "moved": ulps(copies[0].detach().to(torch.float16), init[0])}


class _DenseFirst(nn.Module):
    """A dense layer registered before the tables: DMP loads it first."""

    def __init__(self, tables: nn.Module) -> None:
        super().__init__()
        self.dense = nn.Linear(2, 2)
        self.tables = tables


def dense_first(rank, world_size):
    """A state dict with FP32 tables loaded into the FP16 tables of a model whose dense layer DMP loads
    first: ``{"refused": the message, "unchanged": the dense layer and the tables as they were}``."""
    torch.manual_seed(2)
    model = _DenseFirst(_collection(torch.float16, True))
    sharder = sharders.EmbeddingBagCollectionSharder()
    apply_optimizer_in_backward(torch.optim.SGD, model.tables.parameters(), {"lr": 0.1})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in NAMES})
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    before = _snapshot(dmp)
    state = dict(dmp.state_dict())
    state["dense.weight"] = state["dense.weight"] + 1
    state["tables.embedding_bags.t0.weight"] = state["tables.embedding_bags.t0.weight"].to(torch.float32)
    message = _refusal(lambda: dmp.load_state_dict(state))
    after = _snapshot(dmp)
    unchanged = sorted(before) == sorted(after) and all(
        all(torch.equal(a, b) for a, b in zip(before[k], after[k])) for k in before)
    return {"refused": message, "unchanged": unchanged}


def _snapshot(dmp):
    """Copies of this rank's part of every entry of ``dmp.state_dict()``."""
    from overlap_optim._private import ShardedTensor

    return {k: [s.tensor.clone() for s in v.local_shards()] if isinstance(v, ShardedTensor) else [v.clone()]
            for k, v in dmp.state_dict().items()}


def frozen_lookup(rank, world_size, dtype, sharding_type, pooled=True, steps=2):
    """Frozen ``dtype`` tables (requires_grad=False when sharded): ``{"diff": the largest difference of
    our lookup from embedding_bag on the stored weights read in float32, "unchanged": the tables
    bitwise as set}``; a backward runs where the output requires grad (it changes nothing)."""
    torch.manual_seed(0)
    init = [(torch.randn(ROWS, DIM) * 0.5).to(dtype) for _ in NAMES]
    heads = [torch.randn(DIM) for _ in NAMES]
    dmp = _sharded(world_size, dtype, "adam", sharding_type, pooled, init, frozen=True)
    diff = 0.0
    for step in range(steps):
        generator = torch.Generator().manual_seed(200 + step)
        parts = [_batch(generator, cover=True) for _ in range(world_size)]
        outputs = _outputs(dmp(parts[rank]), pooled)
        expected = _reference_outputs([t.float() for t in init], parts[rank], pooled)
        diff = max(diff, *((o.float() - e).abs().max().item() for o, e in zip(outputs, expected)))
        loss = _loss(outputs, heads)
        if loss.requires_grad:
            loss.backward()
    unchanged = all(torch.equal(_whole(dmp, n, pooled, dtype), t) for n, t in zip(NAMES, init))
    return {"diff": diff, "unchanged": unchanged}
