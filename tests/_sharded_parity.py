"""Rank bodies for the sharder parity tests (spawned; not collected by pytest)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

import overlap_optim
import sharders
from _models import ManySequenceModel, ManyTableModel, MixedModel, concat_batches, covering_batch, loss_of
from overlap_optim import apply_optimizer_in_backward

COLUMN_SPLITTING = ("column_wise", "table_column_wise")

def _both_sharders(**kwargs):
    """The EBC and EC sharders, for a model with both; each is given only its own tables."""
    def own(table_names, ec):
        return [n for n in table_names if n.startswith("ec_") == ec]
    return [sharders.EmbeddingBagCollectionSharder(**{k: own(v, False) for k, v in kwargs.items()}),
            sharders.EmbeddingCollectionSharder(**{k: own(v, True) for k, v in kwargs.items()})]


# A collection family: its test model and our sharder(s) of it.
FAMILIES = {
    "ebc": (ManyTableModel, sharders.EmbeddingBagCollectionSharder),
    "ec": (ManySequenceModel, sharders.EmbeddingCollectionSharder),
    "mixed": (MixedModel, _both_sharders),  # tables named ec_... in the EC
}


def build(names, settings, sharding_type, world_size, sharder=None, dense=None, comm=None, together=False,
          pinned_dense=(), seed=0, dense_layers=(0,), dim=8, family="ebc", dense_tables=(), wrapper=None,
          before_dmp=None):
    """(sharded DMP model, unsharded reference, reference optimizers) from one seed.

    ``settings``: each table's ``(class, kwargs)``, or ``(class, kwargs, group_options)``.
    ``sharding_type``: one for every table, or a dict table -> type.
    ``dense=(cls, kwargs)`` also annotates the MLP and wraps it with our DataParallelWrapper.
    ``together``: annotate all tables in one call (one param group; settings must agree).
    ``pinned_dense``: tables the sharder pins to the fallback (``fallback_tables``).
    ``dim``: the tables' width; shards are at least 4 rows or columns (16: four column shards).
    ``family``: "ebc" (an EmbeddingBagCollection) or "ec" (an EmbeddingCollection, see ``FAMILIES``).
    ``dense_tables``: tables the sharder runs with dense semantics.
    ``wrapper``: DMP's data_parallel_wrapper for the dense part (default, with ``dense``: ours for DDP).
    ``before_dmp``: called with the annotated model before DMP wraps it (tensor parallelism).
    """
    model_class, sharder_class = FAMILIES[family]
    model = model_class(names, seed=seed, dim=dim)
    reference = copy.deepcopy(model)
    if together:
        apply_optimizer_in_backward(*settings[0][:1], [model.tables[n].weight for n in names], settings[0][1])
    for name, (cls, kwargs, *options) in zip(names, settings):  # options: its group_options, if any
        if not together:
            apply_optimizer_in_backward(cls, model.tables[name].parameters(), kwargs, group_options=(options or [None])[0])
    ref_opts = [cls([{"params": list(reference.tables[n].parameters()), **((options or [None])[0] or {})}], **kw)
                for n, (cls, kw, *options) in zip(names, settings)]
    data_parallel_wrapper, wrapper = wrapper, {}
    if dense is not None:  # the MLP's dense_layers annotated (dense[2] left to a user optimizer by default)
        apply_optimizer_in_backward(dense[0], [p for i in dense_layers for p in model.dense[i].parameters()], dense[1])
        ref_opts.append(dense[0]([p for i in dense_layers for p in reference.dense[i].parameters()], **dense[1]))
        wrapper = {"data_parallel_wrapper": data_parallel_wrapper or sharders.DataParallelWrapper(allreduce_comm_precision=comm)}
    sharder = sharder or sharder_class(fallback_tables=pinned_dense, dense_tables=dense_tables)
    types = sharding_type if isinstance(sharding_type, dict) else dict.fromkeys(names, sharding_type)
    constraints = {n: ParameterConstraints(sharding_types=[types[n]], min_partition=4) for n in names}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    sharder_list = sharder if isinstance(sharder, list) else [sharder]
    plan = planner.collective_plan(model, sharder_list, dist.group.WORLD)
    if before_dmp is not None:
        before_dmp(model)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharder_list, **wrapper)
    with torch.no_grad():  # sharding re-initialises tables: start both from the reference's weights
        for name in names:
            ref = reference.tables[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
    return dmp, reference, ref_opts


def shard_like_reference(model, reference, names, types, world_size, sharder=None):
    """``model`` under DMP (our sharder, ``types``: table -> sharding type, our DataParallelWrapper),
    its table pieces set from the unsharded ``reference``'s weights."""
    sharder = sharder or sharders.EmbeddingBagCollectionSharder()
    constraints = {n: ParameterConstraints(sharding_types=[types[n]], min_partition=4) for n in names}
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    with torch.no_grad():  # sharding re-initialises tables
        for name in names:
            ref = reference.tables[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
    return dmp


def local_pieces(dmp, name):
    """[(row offset, col offset, local tensor)] of table ``name`` held by this rank."""
    value = dmp.state_dict()[dmp.module.table_key(name)]
    if isinstance(value, ShardedTensor):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
    return [(0, 0, value)]


def compare(dmp, reference, names, step, atol=1e-5, diffs=None):
    """Assert every weight matches; returns the largest dense difference.

    ``diffs``: a dict to append each table's difference to (table -> one per call) instead of
    asserting it, so that one table's divergence does not hide the others'; the caller asserts.
    """
    state = dmp.state_dict()
    dense_diff = 0.0
    for name, ref in reference.dense.named_parameters():
        value = state[f"dense.{name}"]
        value = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2: every rank gathers
        diff = (value - ref.detach()).abs().max().item()
        dense_diff = max(dense_diff, diff)
        assert diff <= atol, f"step {step}, dense.{name}: max diff {diff:.3g} from torch.optim"
    for name in names:
        ref = reference.tables[name].weight.detach()
        for row, col, piece in local_pieces(dmp, name):
            want = ref[row : row + piece.shape[0], col : col + piece.shape[1]]
            diff = (piece - want).abs().max().item() if piece.numel() else 0.0
            if diffs is None:
                assert diff <= atol, f"step {step}, table {name}: max diff {diff:.3g} from torch.optim"
            else:
                diffs.setdefault(name, []).append(diff)
    return dense_diff


def assert_table_exact(per_rank, name, atol, label):
    """In the parent: table ``name`` within ``atol`` of torch.optim at every comparison on every
    rank, from each rank's ``diffs`` (``train_and_compare(diffs=...)``); some rank holds a piece."""
    assert any(name in out["diffs"] for out in per_rank), f"{label}: no rank holds a piece of {name}"
    for rank, out in enumerate(per_rank):
        bad = [(i, d) for i, d in enumerate(out["diffs"].get(name, [])) if not d <= atol]
        assert not bad, (f"{label}, rank {rank}, table {name}: max diff {bad[0][1]:.3g} from torch.optim "
                         f"(comparison {bad[0][0]})")


def step_side_by_side(dmp, reference, ref_opts, names, parts, rank, step, user=None, diffs=None):
    """One step: ours on this rank's part (then ``user``'s optimizer, if any), the reference on the
    global batch with its torch.optim optimizers; then every weight compared (``diffs``: as
    :func:`compare` takes it)."""
    loss_of(dmp, parts[rank]).backward()
    if user is not None:
        user.step()
        user.zero_grad()
    loss_of(reference, concat_batches(parts)).backward()
    for opt in ref_opts:
        opt.step()
    reference.zero_grad()
    compare(dmp, reference, names, step, diffs=diffs)


def warmup_then_decay(step: int) -> float:
    return (step + 1) / 4 if step < 4 else 0.7 ** (step - 3)


def train_and_compare(
    rank, world_size, names, settings, sharding_type, steps=3, cover=True, dense=None, comm=None, schedule=None,
    change=None, pinned=(), dim=8, diffs=None, family="ebc", dense_tables=(), sharder=None,
):
    """Train sharded and reference side by side; compare after every step. Returns how far
    the reference moved, per table (and ``"dense"``: the MLP).

    ``diffs``: a dict that gets each table's differences from torch.optim (table -> one per step
    and local piece), for the caller to assert, instead of asserting them here.

    ``schedule``: a LambdaLR function, or a factory ``optimizer -> scheduler``, applied through
    ``get_optimizers`` and to each reference optimizer. ``change(step, groups)``: called after
    each step with our param groups and then the reference's, in the same order (tables, then
    the MLP), to change settings by hand. ``pinned``: tables pinned to the fallback.
    """
    dmp, reference, ref_opts = build(names, settings, sharding_type, world_size, dense=dense, comm=comm,
                                     pinned_dense=pinned, dim=dim, family=family, dense_tables=dense_tables,
                                     sharder=sharder)
    atol, dense_diff = (1e-3 if comm else 1e-5), 0.0  # compression costs precision everywhere
    start = {n: reference.tables[n].weight.detach().clone() for n in names}
    dense_start = [p.detach().clone() for p in reference.dense.parameters()]
    schedulers, keyed = [], None
    if schedule is not None or change is not None:
        keyed = overlap_optim.get_optimizers(dmp)
    if schedule is not None:  # one schedule through get_optimizers; the same on each reference optimizer
        factory = schedule if isinstance(schedule, type) or getattr(schedule, "is_factory", False) else (
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        schedulers = [factory(keyed)] + [factory(o) for o in ref_opts]
    users = []
    if dense is not None:
        ours = [p for n, p in dmp.named_parameters() if n.startswith("dense.2.")]
        users = [torch.optim.SGD(ours, lr=0.1), torch.optim.SGD(reference.dense[2].parameters(), lr=0.1)]
    compare(dmp, reference, names, "before training", atol=0.0)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        parts = [covering_batch(names, generator, cover=cover) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        loss_of(reference, concat_batches(parts)).backward()
        if keyed is not None:
            keyed.step()
        for opt in ref_opts + users:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        if change is not None:
            change(step, keyed.param_groups)
            change(step, [o.param_groups[0] for o in ref_opts])
        reference.zero_grad()
        if users:
            users[0].zero_grad()
        dense_diff = max(dense_diff, compare(dmp, reference, names, step, atol=atol, diffs=diffs))
    moved = {n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in names}
    moved["dense_diff"] = dense_diff
    moved["dense"] = min((p.detach() - s).abs().max().item() for p, s in zip(reference.dense.parameters(), dense_start))
    return moved


SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")


def parity(rank, world_size, cases, sharding_type, family="ebc", steps=3):
    """Every case as its own table of one EBC on ``sharding_type``: how far each reference table
    moved, each table's differences from torch.optim after every step, and, for each case whose
    optimizer the optimizer model finds not separable along the axis ``sharding_type`` splits,
    the refusal message of that case built alone."""
    kept = [c for c in cases if _accepted_on(c, sharding_type)]
    diffs = {}
    moved = train_and_compare(rank, world_size, [c[0] for c in kept], [(c[1], c[2]) for c in kept], sharding_type,
                              diffs=diffs, family=family, steps=steps)
    refused = {c[0]: _refusal(c, sharding_type, world_size, family) for c in cases if c not in kept}
    return {"moved": moved, "diffs": diffs, "refused": refused}


def parity_on_partial_batches(rank, world_size, cases, sharding_type, family="ebc"):
    """The cases that are not row-separable (dense semantics: lazy ones differ here) again, on
    batches that touch only some rows: how far each moved, and each one's differences."""
    dense = [c for c in cases if not _row_separable(c)]
    diffs = {}
    moved = train_and_compare(rank, world_size, [c[0] for c in dense], [(c[1], c[2]) for c in dense], sharding_type,
                              cover=False, steps=4, diffs=diffs, family=family)
    return {"moved": moved, "diffs": diffs}


def _accepted_on(case, sharding_type) -> bool:
    """Separable along the axis ``sharding_type`` splits, or with a cross-shard form."""
    from overlap_optim.spec import describe_optimizer
    from overlap_optim.cross_shard import cross_shard_class

    spec = describe_optimizer(case[1], case[2])
    axis = 0 if sharding_type in ("row_wise", "table_row_wise") else 1 if sharding_type in COLUMN_SPLITTING else None
    if axis is None or (spec.row_separable, spec.column_separable)[axis]:
        return True
    implementation = cross_shard_class(case[1])
    return implementation is not None and implementation.unsupported(spec, axis) is None


def _row_separable(case) -> bool:
    from overlap_optim.spec import describe_optimizer

    return describe_optimizer(case[1], case[2]).row_separable


def _refusal(case, sharding_type, world_size, family="ebc") -> str:
    try:
        build([case[0]], [(case[1], case[2])], sharding_type, world_size, family=family)
    except ValueError as err:
        return str(err)
    return "accepted"


def count_collectives(dmp, batch) -> int:
    """How many collectives one forward and backward of ``dmp`` issue."""
    names = ("all_to_all_single", "all_to_all", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
    calls = []
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        loss_of(dmp, batch).backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return len(calls)


def grouping_and_describe(rank, world_size):
    """Kernels per setting, collectives per step, describe() and get_optimizers() coverage."""
    import overlap_optim

    names = [f"t{i}" for i in range(6)]
    distinct = [
        (torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.2}), (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.Adam, {"lr": 0.05}), (torch.optim.Adam, {"lr": 0.1}), (torch.optim.RMSprop, {"lr": 0.01}),
    ]
    same = [(torch.optim.SGD, {"lr": 0.1})] * 6
    out = {}
    for label, settings in (("one", same), ("six", distinct)):
        dmp, _, _ = build(names, settings, "table_wise", world_size, together=label == "one")
        generator = torch.Generator().manual_seed(7)
        batch = [covering_batch(names, generator) for _ in range(world_size)][rank]
        out[f"collectives_{label}"] = count_collectives(dmp, batch)
        out[f"describe_{label}"] = sharders.describe(dmp)
    opt = overlap_optim.get_optimizers(dmp)
    out["stepped_keys"] = sorted(k for k, v in opt.state_dict()["state"].items() if v)
    out["param_keys"] = sorted(opt.params)
    dp, _, _ = build(names, distinct, "data_parallel", world_size)
    loss_of(dp, batch).backward()
    dp_opt = overlap_optim.get_optimizers(dp)
    out["dp_describe"] = sharders.describe(dp)
    out["dp_stepped_keys"] = sorted(k for k, v in dp_opt.state_dict()["state"].items() if v)
    out["dp_param_keys"] = sorted(dp_opt.params)
    return out


def lazy_rows(rank, world_size, sharding_type):
    """Rows a step does not touch keep their weights, and the fallback keeps their state."""
    import overlap_optim

    names = ["adam", "adagrad"]
    settings = [(torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}), (torch.optim.Adagrad, {"lr": 0.1})]
    dmp, _, _ = build(names, settings, sharding_type, world_size)
    opt = overlap_optim.get_optimizers(dmp)
    generator = torch.Generator().manual_seed(3)
    loss_of(dmp, [covering_batch(names, generator) for _ in range(world_size)][rank]).backward()
    before_w = {n: [(r, p.clone()) for r, _, p in local_pieces(dmp, n)] for n in names}
    before_s = {k: {s: _local(v) for s, v in st.items()} for k, st in opt.state_dict()["state"].items()}
    touched = 6  # the second step only looks up ids < 6
    loss_of(dmp, [covering_batch(names, generator, rows=touched, cover=False) for _ in range(world_size)][rank]).backward()
    moved_untouched, moved_touched = [], 0.0
    for name in names:
        for (row0, old), (_, _, new) in zip(before_w[name], local_pieces(dmp, name)):
            rows = torch.arange(row0, row0 + new.shape[0])
            untouched = rows >= touched
            if not torch.equal(old[untouched], new[untouched]):
                moved_untouched.append(name)
            moved_touched = max(moved_touched, (old[~untouched] - new[~untouched]).abs().max().item() if (~untouched).any() else 0.0)
    state_changed = []
    adam_key = dmp.module.table_key("adam")
    adam_row0 = before_w["adam"][0][0] if before_w["adam"] else 0
    for state_name, old in before_s.get(adam_key, {}).items():
        new = _local(opt.state_dict()["state"][adam_key][state_name])
        if old.dim():
            untouched = torch.arange(adam_row0, adam_row0 + old.shape[0]) >= touched
            if not torch.equal(old[untouched], new[untouched]):
                state_changed.append(state_name)
    return {"moved_untouched": moved_untouched, "moved_touched": moved_touched, "state_changed": state_changed,
            "adam_state_names": sorted(before_s.get(adam_key, {}))}


def _local(value):
    if isinstance(value, ShardedTensor):
        return value.local_shards()[0].tensor.clone() if value.local_shards() else torch.empty(0)
    return value.clone() if torch.is_tensor(value) else torch.tensor(value)


_MIXED = [("sgd", torch.optim.SGD, {"lr": 0.1}), ("adam", torch.optim.Adam, {"lr": 0.05})]
_DENSE_ADAMW = (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1})


def with_dense(rank, world_size, sharding_type, comm=None):
    """An SGD and an Adam table, and the MLP's AdamW through our DataParallelWrapper (``comm``: its
    allreduce_comm_precision), against torch.optim every step: how far each moved."""
    return train_and_compare(rank, world_size, [c[0] for c in _MIXED], [(c[1], c[2]) for c in _MIXED],
                             sharding_type, dense=_DENSE_ADAMW, comm=comm)


def scheduled(rank, world_size, sharding_type, family="ebc", steps=10):
    """A warm-up-then-decay LambdaLR through get_optimizers on fused, fallback (two Adam tables that
    differ in lr: one virtual group) and dense."""
    return train_and_compare(rank, world_size, ["sgd", "adagrad", "adam", "adam_fast"],
                             [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.2}),
                              (torch.optim.Adam, {"lr": 0.05}), (torch.optim.Adam, {"lr": 0.1})],
                             sharding_type, steps=steps, dense=_DENSE_ADAMW, schedule=warmup_then_decay,
                             family=family)


def scheduler_factory(fn):
    """Mark ``fn(optimizer) -> scheduler`` as a factory for ``train_and_compare(schedule=...)``."""
    fn.is_factory = True
    return fn


def _after_first_step(step, groups):
    """Halve every lr, set every eps to 1e-2, and switch on weight decay where the optimizer
    takes it exactly in every kernel (groups: Adagrad fused, Adagrad pinned to the fallback,
    RowWiseAdagrad, SGD, Adam, then the MLP's Adam)."""
    if step != 0:
        return
    for group in groups:
        group["lr"] *= 0.5
        if "eps" in group:
            group["eps"] = 1e-2
    for index in (1, 4, 5):
        groups[index]["weight_decay"] = 0.05


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8, cycle_momentum=True)


def _first_error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def _train_steps(dmp, names, world_size, rank, steps, before_step=None):
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        generator = torch.Generator().manual_seed(100 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()


LIVE_TABLES = ["adagrad", "adagrad_pinned", "rowwise", "sgd", "adam"]


def live_exact(rank, world_size, sharding_type):
    """lr, eps and weight decay changed by hand after the first step (``_after_first_step``):
    how far each reference table (and the MLP) moved, and each table's differences."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    settings = [(torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-8}), (torch.optim.Adagrad, {"lr": 0.2}),
                (RowWiseAdagrad, {"lr": 0.2}), (torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05})]
    diffs = {}
    moved = train_and_compare(rank, world_size, LIVE_TABLES, settings, sharding_type, steps=3,
                              dense=(torch.optim.Adam, {"lr": 0.02}), change=_after_first_step,
                              pinned=("adagrad_pinned",), diffs=diffs)
    return {"moved": moved, "diffs": diffs}


def live_one_cycle(rank, world_size, name):
    """OneCycleLR, cycling lr and momentum (SGD) or betas (Adam), on one row_wise table."""
    cls, kwargs = {"sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                   "adam": (torch.optim.Adam, {"lr": 0.05})}[name]
    return train_and_compare(rank, world_size, [name], [(cls, kwargs)], "row_wise", steps=4,
                             schedule=scheduler_factory(_one_cycle))


def _set_key(index, key, value):
    return lambda keyed: keyed.param_groups[index].__setitem__(key, value)


_ADAGRAD, _ADAM = [(torch.optim.Adagrad, {"lr": 0.2})], [(torch.optim.Adam, {"lr": 0.05})]
_SGD = [(torch.optim.SGD, {"lr": 0.1})]
# case -> (tables, settings, sharding type, the change made before the second step, pinned tables, dense).
# Each on row_wise or data_parallel, where every rank holds the table; the last two on table_wise,
# one table per rank: the rank without the changed table must raise alike, not wait.
LIVE_SETTING_ERRORS = {
    "fused_adagrad_weight_decay": (["t_ada"], _ADAGRAD, "row_wise", _set_key(0, "weight_decay", 0.01), (), None),
    "fused_sgd_one_cycle": (["t_sgd"], _SGD, "row_wise", _one_cycle, (), None),
    "fallback_sgd_momentum": (["t_sgd"], _SGD, "row_wise", _set_key(0, "momentum", 0.9), ("t_sgd",), None),
    "fallback_adam_amsgrad": (["t_adam"], _ADAM, "row_wise", _set_key(0, "amsgrad", True), (), None),
    "data_parallel_adam_amsgrad": (["t_adam"], _ADAM, "data_parallel", _set_key(0, "amsgrad", True), (), None),
    "dense_adam_amsgrad": (["t_sgd"], _SGD, "row_wise", _set_key(1, "amsgrad", True), (),
                           (torch.optim.Adam, {"lr": 0.02})),
    "table_wise_fused_adagrad_weight_decay": (["t_ada", "t_other"], _ADAGRAD * 2, "table_wise",
                                              _set_key(0, "weight_decay", 0.01), (), None),
    "table_wise_fallback_adam_amsgrad": (["t_adam", "t_other"], _ADAM * 2, "table_wise",
                                         _set_key(0, "amsgrad", True), (), None),
}


def live_setting_error(rank, world_size, case):
    """The first error of two steps with the change of ``LIVE_SETTING_ERRORS[case]`` made before
    the second, as "Type: message" ("no error" if none)."""
    names, settings, sharding_type, before_step, pinned, dense = LIVE_SETTING_ERRORS[case]
    dmp, _, _ = build(names, settings, sharding_type, world_size, pinned_dense=pinned, dense=dense)
    keyed = overlap_optim.get_optimizers(dmp)
    return _first_error(lambda: _train_steps(dmp, names, world_size, rank, 2,
                                             lambda step: step == 1 and before_step(keyed)))


def two_shards_per_rank(rank, world_size, directory, steps=3):
    """Tables 16 wide in four column shards of 4: each rank holds two shards of every table.
    Fused, fallback and cross-shard (layer-wise) tables are compared with torch.optim after
    every step; then a checkpoint is saved, ours takes a step the reference does not, the
    checkpoint is loaded, and both go on side by side. Returns each table's local pieces."""
    from pytorch_optimizer import Lamb

    from overlap_optim import checkpoint

    settings = {"fused": (torch.optim.Adagrad, {"lr": 0.2}), "fallback": (torch.optim.Adam, {"lr": 0.05}),
                "adafactor": (torch.optim.Adafactor, {"lr": 0.05}), "lamb": (Lamb, {"lr": 0.05, "weight_decay": 0.01})}
    names = list(settings)
    dmp, reference, ref_opts = build(names, list(settings.values()), "column_wise", world_size, dim=16)
    keyed = overlap_optim.get_optimizers(dmp)
    pieces = {n: [(row, col, tuple(p.shape)) for row, col, p in local_pieces(dmp, n)] for n in names}
    start = {n: reference.tables[n].weight.detach().clone() for n in names}

    def parts_of(step):
        generator = torch.Generator().manual_seed(300 + step)
        return [covering_batch(names, generator) for _ in range(world_size)]

    for step in range(steps):
        step_side_by_side(dmp, reference, ref_opts, names, parts_of(step), rank, step)
    checkpoint.save(directory, dmp, keyed, {"step": steps})
    loss_of(dmp, parts_of(99)[rank]).backward()  # ours only: the load must undo it, state included
    checkpoint.load(directory, dmp, keyed, {})
    for step in range(steps, steps + 2):
        step_side_by_side(dmp, reference, ref_opts, names, parts_of(step), rank, step)
    moved = {n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in names}
    return {"pieces": pieces, "moved": moved, "runs_as": sharders.describe(dmp)}


def parity_with_round_trip(rank, world_size, cases, sharding_type, family="ec", steps=3):
    """Every accepted case as a table of one collection on ``sharding_type``, side by side with
    torch.optim for ``steps`` steps; then ``get_optimizers().state_dict()`` is loaded into a second
    model, sharded alike from another seed with the first one's weights copied in, which takes one
    more step beside the reference. Returns how far each reference table moved, each table's
    differences (every step, the resumed one last) and the refusals, as :func:`parity`."""
    kept = [c for c in cases if _accepted_on(c, sharding_type)]
    names, settings = [c[0] for c in kept], [(c[1], c[2]) for c in kept]
    dmp, reference, ref_opts = build(names, settings, sharding_type, world_size, family=family)
    start = {n: reference.tables[n].weight.detach().clone() for n in names}
    diffs = {}

    def step(model, index):
        generator = torch.Generator().manual_seed(100 + index)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        loss_of(model, parts[rank]).backward()
        loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(model, reference, names, index, diffs=diffs)

    for index in range(steps):
        step(dmp, index)
    saved = overlap_optim.get_optimizers(dmp).state_dict()
    resumed, _, _ = build(names, settings, sharding_type, world_size, family=family, seed=1)
    with torch.no_grad():
        for name in names:
            for (_, _, source), (_, _, target) in zip(local_pieces(dmp, name), local_pieces(resumed, name)):
                target.copy_(source)
        for source, target in zip(dmp.module.dense.parameters(), resumed.module.dense.parameters()):
            target.copy_(source)
    overlap_optim.get_optimizers(resumed).load_state_dict(saved)
    step(resumed, steps)
    refused = {c[0]: _refusal(c, sharding_type, world_size, family) for c in cases if c not in kept}
    moved = {n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in names}
    return {"moved": moved, "diffs": diffs, "refused": refused}
