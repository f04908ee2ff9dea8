"""Every private TorchRec API the sharders touch, each in one place, each named and checked.

TorchRec does not promise these across releases. Each is reached only through
the functions here, so an upgrade that removes one breaks one function, and
``tests/test_private_apis.py`` names it: it checks every entry of
:data:`PRIVATE_APIS` against the installed TorchRec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding, BatchedDenseEmbedding, BatchedDenseEmbeddingBag,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

__all__ = [
    "PRIVATE_APIS", "BATCH_KEY", "WRAPPED", "lookups", "kernels_of_lookup", "kernels_of", "add_fused_optimizer", "sharded_weights",
    "wrapped_module", "DenseKernelLayout", "dense_kernel_layout", "slice_again", "ModelBeingSharded",
    "model_being_sharded", "divide_only_row_split_means", "uses_index_dedup", "data_parallel_wrapper",
    "reservation_percentage", "record_reservation", "replace_enumerator", "optimizer_classes_hidden",
    "annotations_read_as", "comm_hook_left_to_us", "recast_kernel", "replace_lookup", "run_first_on_load",
    "managed_collision_being_built", "mc_collection_of", "table_init_fn", "remapping_layouts", "reread_remapping_count", "round_mean_divisor", "semi_sync_pipeline", "stashes_gradients", "pipeline_model",
]

# The name under which DistributedModelParallel registers the module it wraps.
WRAPPED = "_dmp_wrapped_module"

# A fused-params entry TorchRec groups tables into kernels by, then drops before building a
# kernel (``torchrec.distributed.embedding_sharding``): it keeps tables apart that we want apart.
BATCH_KEY = "_batch_key"


def lookups(sharded: nn.Module) -> list[nn.Module]:
    """A sharded module's lookups, one per sharding type (DDP-wrapped for data_parallel).
    Private: ``ShardedEmbeddingBagCollection._lookups`` (and the EC's)."""
    return sharded._lookups


def kernels_of_lookup(lookup: nn.Module) -> list[nn.Module]:
    """The TBE kernels of one (unwrapped) lookup. Private: ``GroupedPooledEmbeddingsLookup._emb_modules``
    (and ``GroupedEmbeddingsLookup``'s)."""
    return list(getattr(lookup, "_emb_modules", []))


def kernels_of(sharded: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """``(lookup, kernel)`` for every TBE kernel of every lookup of a sharded module."""
    for lookup in lookups(sharded):
        inner = lookup.module if isinstance(lookup, DistributedDataParallel) else lookup
        for kernel in kernels_of_lookup(inner):
            yield lookup, kernel


def add_fused_optimizer(sharded: nn.Module, optimizer: Any) -> None:
    """Add ``optimizer`` to the sharded module's ``fused_optimizer`` (a CombinedOptimizer TorchRec
    built before we saw the module). Private: ``ShardedEmbeddingBagCollection._optim._optims`` (and the EC's)."""
    sharded._optim._optims.append(("", optimizer))


def sharded_weights(sharded: nn.Module) -> dict[str, Any]:
    """Table name -> its model-parallel weight (a ``ShardedTensor``). Private:
    ``ShardedEmbeddingBagCollection._model_parallel_name_to_sharded_tensor`` (and the EC's)."""
    return dict(sharded._model_parallel_name_to_sharded_tensor)


def wrapped_module(dmp: DistributedModelParallel) -> nn.Module:
    """What DMP wraps (DDP, for the data-parallel part). Private: ``DistributedModelParallel._dmp_wrapped_module``."""
    return getattr(dmp, WRAPPED)


@dataclasses.dataclass(frozen=True)
class DenseKernelLayout:
    """How a TorchRec dense TBE kernel maps features to tables and reads its inputs (its pooling
    mode is FBGEMM's public ``emb_module.pooling_mode``)."""

    feature_table_map: list[int]
    index_dtype: torch.dtype
    offset_dtype: torch.dtype


def dense_kernel_layout(kernel: nn.Module) -> DenseKernelLayout:
    """Of a ``BatchedDenseEmbeddingBag`` (EBC) or ``BatchedDenseEmbedding`` (EC). Private:
    ``._feature_table_map``, ``._embedding_table_index_type`` and ``._embedding_table_offset_type``
    of both."""
    return DenseKernelLayout(
        kernel._feature_table_map, kernel._embedding_table_index_type, kernel._embedding_table_offset_type,
    )


def slice_again(weight: Any) -> Any:
    """A table's weight view made again over its TBE's flat weights, so that it takes up their
    ``requires_grad`` now (TorchRec's view keeps the flag the weights had when it was made), or
    ``weight`` itself if it is no such view. Private: ``TableBatchedEmbeddingSlice._original_tensor``,
    ``._start_offset``, ``._end_offset``, ``._num_embeddings``, ``._embedding_dim``."""
    if not isinstance(weight, TableBatchedEmbeddingSlice):
        return weight
    return TableBatchedEmbeddingSlice(
        weight._original_tensor, weight._start_offset, weight._end_offset, weight._num_embeddings,
        weight._embedding_dim,
    )


def divide_only_row_split_means(sharded: nn.Module) -> None:
    """Repair TorchRec's mean pooling of row-split tables (row_wise, table_row_wise) in an EBC.

    Their kernel pools by SUM, and a callback divides the module's output by each bag's length
    afterwards. The divisor is 1 only for the SUM features of row-split tables: every feature of
    another sharding type is divided too, so a table_wise SUM feature would end up averaged, and a
    column_wise MEAN feature divided twice (wrong output and gradients). Here
    every feature that is not a row-split MEAN one gets divisor 1. Private:
    ``ShardedEmbeddingBagCollection._pooling_type_to_rs_features``, read by its
    ``_create_mean_pooling_divisor``.
    """
    if not getattr(sharded, "_has_mean_pooling_callback", False):
        return
    by_pooling = sharded._pooling_type_to_rs_features
    means = set(by_pooling.get("MEAN", []))
    features = [f for config in sharded._embedding_bag_configs for f in config.feature_names]
    by_pooling["SUM"] = [f for f in features if f not in means]
    if sharded._is_weighted:  # the divisor is each bag's sum of weights: left as TorchRec makes it
        return
    # TorchRec adds 1e-6 to every divisor (against empty bags): a relative error of 1e-6 on every
    # feature of the module, which ill-conditioned updates (Adagrad, LAMB on rows with tiny
    # gradients) amplify. Unweighted, the divisor is a whole number of ids
    # (1 where nothing is divided): rounded, it is exact; an empty bag's sum (0) stays 0, as
    # nn.EmbeddingBag's mean of an empty bag. Private: ``input_dist`` sets ``ctx.divisor``, which
    # the module's output callback divides by (every caller, train pipelines included).
    input_dist = sharded.input_dist

    def exact_input_dist(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        out = input_dist(ctx, *args, **kwargs)
        round_mean_divisor(ctx)
        return out

    sharded.input_dist = exact_input_dist


def round_mean_divisor(ctx: Any) -> None:
    """Round the mean-pooling divisor an unweighted input dist set on ``ctx`` (see
    :func:`divide_only_row_split_means`); nothing where it set none. Private: ``ctx.divisor``
    (TorchRec's managed-collision collection sets it in its own ``input_dist`` too)."""
    if getattr(ctx, "divisor", None) is not None:
        ctx.divisor = torch.round(ctx.divisor).clamp_(min=1.0)


def run_first_on_load(module: nn.Module, hook: Callable[..., None]) -> None:
    """Register ``hook(module, state_dict, prefix, *rest)`` as a ``load_state_dict`` pre-hook of
    ``module`` that runs before the hooks it already has: TorchRec's
    (``ShardedEmbeddingBagCollection._pre_load_state_dict_hook``, and the EC's) replaces each
    incoming ``ShardedTensor`` by its local shards (an empty float32 tensor on a rank that holds
    none), so only a hook before it sees what was saved. Private: torch's
    ``nn.Module._load_state_dict_pre_hooks`` (an ordered dict, run in order)."""
    handle = module._register_load_state_dict_pre_hook(hook, with_module=True)
    module._load_state_dict_pre_hooks.move_to_end(handle.id, last=False)


@dataclasses.dataclass(frozen=True)
class ModelBeingSharded:
    """The whole model a ``DistributedModelParallel`` is sharding, its plan and its sharders."""

    root: nn.Module
    plan: Any  # TorchRec's ShardingPlan
    sharders: dict[type, Any]  # module type -> its sharder
    data_parallel_wrapper: Any = None  # what wraps the unsharded part after sharding


def model_being_sharded() -> ModelBeingSharded | None:
    """What the ``DistributedModelParallel`` whose constructor is sharding now shards, or None when
    no DMP is (a sharder called by hand, TorchRec's ``shard_modules``). A sharder sees one module at
    a time; this lets it check every module before the first is changed. Private: the frame of
    ``DistributedModelParallel._init_dmp(self, module)`` on the stack, and DMP's ``._plan``,
    ``._sharder_map`` and ``._data_parallel_wrapper``."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is DistributedModelParallel._init_dmp.__code__:
            dmp = frame.f_locals["self"]
            return ModelBeingSharded(frame.f_locals["module"], dmp._plan, dict(dmp._sharder_map),
                                     data_parallel_wrapper(dmp))
        frame = frame.f_back
    return None


def merge_variable_batches_by_rank(sharded: nn.Module) -> None:
    """For a batch with a variable batch size per feature (VBE), TorchRec's pooled lookup joins the
    outputs of several kernels in two ways that fail here: those of dense kernels kernel after kernel
    (``torch.cat``), where its output all-to-all reads them rank after rank, so each rank would get
    other ranks' bags; those of FBGEMM's kernels into one preallocated output, which FBGEMM's CPU
    kernels refuse ("Using pre-allocated vbe_output is not supported on CPU"). Each such lookup of
    ``sharded`` joins them with TorchRec's own rank-major merge instead (its path on MTIA); FBGEMM's
    kernels on other devices keep the preallocated output. Private:
    ``GroupedPooledEmbeddingsLookup._emb_modules``, ``._feature_splits``, ``._forward``,
    ``._vbe_splits`` and ``._merge_variable_batch_embeddings``."""
    for lookup in lookups(sharded):
        modules = kernels_of_lookup(lookup)
        dense = [isinstance(m, BatchedDenseEmbeddingBag) for m in modules]
        if len(modules) < 2 or len(set(dense)) > 1:  # one kernel, or a mix TorchRec refuses itself
            continue
        fused = not dense[0]

        def forward(features: Any, lookup: nn.Module = lookup, plain: Callable = lookup.forward,
                    fused: bool = fused) -> Any:
            if not features.variable_stride_per_key() or (fused and features.device().type != "cpu"):
                return plain(features)
            groups = features.split(lookup._feature_splits)
            return lookup._merge_variable_batch_embeddings(lookup._forward(groups), lookup._vbe_splits(groups))

        lookup.forward = forward


def _running(codes: set[Any]) -> Any:
    """The innermost frame on this thread's stack that runs one of the code objects ``codes``, or None."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code not in codes:
        frame = frame.f_back
    return frame


def _train_pipeline(name: str) -> type:
    from torchrec.distributed.train_pipeline import train_pipelines

    return getattr(train_pipelines, name)


def semi_sync_pipeline() -> Any:
    """The ``TrainPipelineSemiSync`` whose ``progress`` runs on this thread, or None. Private: the
    frames of ``TrainPipelineSemiSync.progress`` and ``.fill_pipeline`` (its ``self``)."""
    cls = _train_pipeline("TrainPipelineSemiSync")
    frame = _running({cls.fill_pipeline.__code__, inspect.unwrap(cls.progress).__code__})
    return None if frame is None else frame.f_locals["self"]


def stashes_gradients(pipeline: Any) -> bool:
    """Whether a ``TrainPipelineSemiSync`` steps its optimizer on the previous batch's gradients.
    Private: ``TrainPipelineSemiSync._stash_gradients``."""
    return bool(pipeline._stash_gradients)


def pipeline_model(pipeline: Any) -> nn.Module:
    """The model a TorchRec train pipeline trains. Private: ``TrainPipeline._model``."""
    return pipeline._model


def managed_collision_being_built() -> nn.Module | None:
    """The sharded managed-collision collection TorchRec is building on this thread (it hands its
    inner collection to the collection sharder it was given), or None. Private: the frame of
    ``BaseShardedManagedCollisionEmbeddingCollection.__init__`` on the stack, and its ``self``."""
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    frame = _running({BaseShardedManagedCollisionEmbeddingCollection.__init__.__code__})
    return None if frame is None else frame.f_locals["self"]


def mc_collection_of(module: nn.Module) -> nn.Module:
    """The collection (EBC or EC) inside a managed-collision collection, sharded or not. Private:
    ``BaseManagedCollisionEmbeddingCollection._embedding_module`` (and the sharded one's)."""
    return module._embedding_module


def remapping_layouts(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict key (relative to a sharded managed-collision collection) -> the buffer in which each
    table's managed-collision module keeps its row shards' output segments. Private: the buffer
    ``_output_segments_tensor`` of TorchRec's ``ManagedCollisionModule``."""
    return {key: value for key, value in sharded.named_buffers() if key.endswith("." + _OUTPUT_SEGMENTS)}


_OUTPUT_SEGMENTS = "_output_segments_tensor"


def reread_remapping_count(sharded: nn.Module) -> None:
    """Make each managed-collision module of ``sharded`` start its count of iterations again from its
    ``_current_iter_tensor`` buffer at its next profile (as a freshly built one does), with no ids
    held since its last eviction. Private: TorchRec's ``MCHManagedCollisionModule._current_iter``
    (``-1``: read the buffer) and ``._current_history_buffer_offset``, which a ``load_state_dict``
    leaves as they were."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    for module in sharded.modules():
        if isinstance(module, MCHManagedCollisionModule):
            module._current_iter = -1
            module._current_history_buffer_offset = 0


def table_init_fn(sharded: nn.Module, table: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``init_fn`` of a sharded collection's table config. Private:
    ``ShardedEmbeddingBagCollection._table_name_to_config`` (and the EC's)."""
    return sharded._table_name_to_config[table].init_fn


def uses_index_dedup(sharder: Any) -> bool:
    """Whether a TorchRec ``EmbeddingCollectionSharder`` deduplicates ids before the lookup.
    Private: ``EmbeddingCollectionSharder._use_index_dedup`` (its ``use_index_dedup`` argument)."""
    return sharder._use_index_dedup


def data_parallel_wrapper(dmp: nn.Module) -> Any:
    """What wraps the unsharded part of ``dmp`` after sharding (None before DMP set it). Private:
    ``DistributedModelParallel._data_parallel_wrapper``."""
    return getattr(dmp, "_data_parallel_wrapper", None)


def reservation_percentage(reservation: Any) -> float:
    """The share of each device a TorchRec ``FixedPercentageStorageReservation`` reserves. Private:
    ``FixedPercentageStorageReservation._percentage``."""
    return reservation._percentage


# -- TorchRec objects edited in place: one function per edit, each probed on a real object --


def record_reservation(reservation: Any, reserved: Any, dense: Any) -> None:
    """Set what TorchRec's planner reads of a storage reservation after ``reserve``: the topology
    left (its public ``last_reserved_topology`` returns it) and the dense part's ``Storage`` (its
    stats). In place. Private: ``FixedPercentageStorageReservation._last_reserved_topology`` and
    ``._dense_storage`` (read by ``EmbeddingShardingPlanner`` and its stats)."""
    reservation._last_reserved_topology = reserved
    reservation._dense_storage = dense


def replace_enumerator(planner: Any, make: Callable[..., Any]) -> None:
    """Give a TorchRec ``EmbeddingShardingPlanner`` the enumerator that ``make(topology=...,
    batch_size=..., constraints=...)`` builds from the planner's own settings, as its constructor
    filled them in (the default group's topology, TorchRec's batch size). In place. Private:
    ``EmbeddingShardingPlanner._enumerator`` (what ``plan`` enumerates with), ``._topology``,
    ``._batch_size``, ``._constraints``."""
    planner._enumerator = make(
        topology=planner._topology, batch_size=planner._batch_size, constraints=planner._constraints,
    )


@contextlib.contextmanager
def optimizer_classes_hidden(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """While the block runs, ``tensors`` carry no ``_optimizer_classes``: TorchRec's storage
    estimate reads ``tensor._optimizer_classes[0]`` for its optimizer multiplier, and adds none
    without it. Put back afterwards. In place. Private: ``shard_estimators`` reading the
    annotation of each sharding option's tensor."""
    saved = {}
    for tensor in tensors:
        if "_optimizer_classes" in tensor.__dict__ and id(tensor) not in saved:
            saved[id(tensor)] = (tensor, tensor.__dict__.pop("_optimizer_classes"))
    try:
        yield
    finally:
        for tensor, classes in saved.values():
            tensor._optimizer_classes = classes


@contextlib.contextmanager
def annotations_read_as(weight_of: Callable[[str], torch.Tensor], fused_params: dict[str, dict]) -> Iterator[None]:
    """While the block runs (TorchRec's ``shard``), the annotation of each table ``name`` of
    ``fused_params`` reads as no optimizer class and ``fused_params[name]`` as its kwargs, which
    TorchRec then hands to FBGEMM as the table's fused params. Put back afterwards (the weights
    are looked up again with ``weight_of``). In place. Private: ``create_grouped_sharding_infos``
    of TorchRec's sharded EBC and EC reading ``_optimizer_classes[0]`` and ``_optimizer_kwargs[0]``
    of each table's parameter."""
    names = ("_optimizer_classes", "_optimizer_kwargs")
    saved = {}
    for name, kwargs in fused_params.items():
        weight = weight_of(name)
        saved[name] = {a: weight.__dict__[a] for a in names if a in weight.__dict__}
        weight._optimizer_classes = [None]
        weight._optimizer_kwargs = [kwargs]
    try:
        yield
    finally:
        for name, attrs in saved.items():
            weight = weight_of(name)
            for attr in names:
                weight.__dict__.pop(attr, None)
            weight.__dict__.update(attrs)


@contextlib.contextmanager
def comm_hook_left_to_us(wrapper: Any) -> Iterator[str]:
    """While the block runs (TorchRec's ``DefaultDataParallelWrapper.wrap``), the wrapper asks for
    no compressed all-reduce, so TorchRec registers no comm hook of its own; yields what it asked
    for (``"allreduce"`` when nothing), and puts it back afterwards. In place. Private:
    ``DefaultDataParallelWrapper._allreduce_comm_precision``, read by its ``_ddp_wrap``."""
    comm = wrapper._allreduce_comm_precision or "allreduce"
    wrapper._allreduce_comm_precision = None
    try:
        yield comm
    finally:
        wrapper._allreduce_comm_precision = None if comm == "allreduce" else comm


def recast_kernel(kernel: nn.Module, cls: type[nn.Module]) -> None:
    """Make TorchRec's TBE kernel ``kernel`` an instance of ``cls``, a subclass of its class that
    overrides methods only. In place: TorchRec's lookups build kernels from a closed switch with no
    registry, and register the tables' parameters before a sharder sees them, so the object is
    kept (weights, views and all) and only its class changes. Private: the lookup calls each kernel
    of its ``_emb_modules`` as a module, so ``cls.forward`` runs."""
    assert issubclass(cls, type(kernel)), f"{cls.__name__} does not subclass {type(kernel).__name__}"
    kernel.__class__ = cls


def replace_lookup(sharded: nn.Module, index: int, lookup: nn.Module) -> None:
    """Make ``lookup`` the ``index``-th lookup of a sharded EBC or EC, in place, as TorchRec's own
    ``init_data_parallel`` does when it wraps a data-parallel lookup in DDP. Private:
    ``ShardedEmbeddingBagCollection._lookups`` (and the EC's), a list read at each forward."""
    sharded._lookups[index] = lookup


# -- probes of the in-place edits, on real objects (they need a process group of one rank) --


def _probe_sharded(collection: str, sharding_type: str) -> nn.Module:
    """A one-table EBC (``collection="ebc"``) or EC sharded by TorchRec's own sharder on this rank, in
    dense kernels."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.types import ShardingEnv

    config = {"name": "t", "embedding_dim": 2, "num_embeddings": 4, "feature_names": ["f"]}
    if collection == "ebc":
        module, sharder = EmbeddingBagCollection([EmbeddingBagConfig(**config)]), EmbeddingBagCollectionSharder()
    else:
        module, sharder = EmbeddingCollection([EmbeddingConfig(**config)]), EmbeddingCollectionSharder()
    sharding = data_parallel() if sharding_type == "data_parallel" else table_wise(rank=0, compute_kernel="dense")
    plan = construct_module_sharding_plan(module, per_param_sharding={"t": sharding}, local_size=1, world_size=1,
                                          device_type="cpu", sharder=sharder)
    return sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))


def _probe_features() -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([0, 1]), lengths=torch.tensor([1, 1]))


def _probe_replace_lookup() -> object:
    for collection in ("ebc", "ec"):
        sharded = _probe_sharded(collection, "data_parallel")
        assert isinstance(sharded._lookups, list), f"{collection}: _lookups is a {type(sharded._lookups).__name__}"
        assert isinstance(sharded._lookups[0], DistributedDataParallel), f"{collection}: no DDP-wrapped lookup"
        called = []
        inner = sharded._lookups[0].module

        class Recording(nn.Module):
            def forward(self, *args: Any) -> Any:
                called.append(True)
                return inner(*args)

        replace_lookup(sharded, 0, Recording())
        sharded(_probe_features())
        assert called, f"{collection}: the sharded module no longer looks up through _lookups at each forward"
    return replace_lookup


def _probe_recast_kernel() -> object:
    for collection, dense in (("ebc", BatchedDenseEmbeddingBag), ("ec", BatchedDenseEmbedding)):
        sharded = _probe_sharded(collection, "table_wise")
        kernel = next(kernel for _, kernel in kernels_of(sharded))
        assert type(kernel) is dense, f"{collection}: TorchRec built a {type(kernel).__name__} for compute kernel dense"
        called = []

        class Recording(type(kernel)):
            def forward(self, *args: Any) -> Any:
                called.append(True)
                return super().forward(*args)

        recast_kernel(kernel, Recording)
        sharded(_probe_features())
        assert called, f"{collection}: the lookup no longer calls its kernels as modules"
    return recast_kernel


def _probe_annotations_read_as() -> object:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.types import ParameterSharding

    config = {"name": "t", "embedding_dim": 2, "num_embeddings": 4, "feature_names": ["f"]}
    sharding = {"t": ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])}
    cases = (  # (module, the attribute holding its tables, how TorchRec's sharded module reads the annotations)
        (EmbeddingBagCollection([EmbeddingBagConfig(**config)]), "embedding_bags", lambda module: (
            ShardedEmbeddingBagCollection.create_grouped_sharding_infos(module, sharding, "embedding_bags.", None))),
        (EmbeddingCollection([EmbeddingConfig(**config)]), "embeddings", lambda module: (
            ShardedEmbeddingCollection.create_grouped_sharding_infos(module, sharding, None))),
    )
    for module, tables, read in cases:
        weight = getattr(module, tables)["t"].weight
        weight._optimizer_classes, weight._optimizer_kwargs = [torch.optim.SGD], [{"lr": 0.1}]
        with annotations_read_as(lambda name: getattr(module, tables)[name].weight, {"t": {BATCH_KEY: "probe"}}):
            infos = read(module)
        fused = [info.fused_params for group in infos.values() for info in group]
        assert fused and fused[0].get(BATCH_KEY) == "probe" and "optimizer" not in fused[0], (
            f"TorchRec's sharded {type(module).__name__} no longer takes a table's fused params from its "
            f"annotation: {fused}")
        assert weight._optimizer_classes == [torch.optim.SGD], "the annotation was not put back"
    return annotations_read_as


def _probe_optimizer_classes_hidden() -> object:
    import torchrec.distributed.planner.shard_estimators as estimators

    if "_optimizer_classes" not in estimators.calculate_shard_storages.__code__.co_consts:
        raise AttributeError("TorchRec's storage estimate no longer reads the tensor's _optimizer_classes")
    tensor = torch.nn.Parameter(torch.zeros(1))
    tensor._optimizer_classes = [torch.optim.SGD]
    with optimizer_classes_hidden([tensor]):
        assert getattr(tensor, "_optimizer_classes", None) is None
    assert tensor._optimizer_classes == [torch.optim.SGD]
    return optimizer_classes_hidden


def _probe_replace_enumerator() -> object:
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import Enumerator

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    assert isinstance(planner._enumerator, Enumerator), "EmbeddingShardingPlanner._enumerator is gone"
    assert isinstance(planner._topology, Topology) and isinstance(planner._batch_size, int)
    assert planner._constraints is None or isinstance(planner._constraints, dict)
    if "_enumerator" not in inspect.unwrap(EmbeddingShardingPlanner.plan).__code__.co_names:
        raise AttributeError("EmbeddingShardingPlanner.plan no longer enumerates with _enumerator")
    made = []
    replace_enumerator(planner, lambda **settings: made.append(settings) or planner._enumerator)
    assert made == [{"topology": planner._topology, "batch_size": planner._batch_size, "constraints": None}]
    return replace_enumerator


def _probe_record_reservation() -> object:
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import Storage

    reservation = FixedPercentageStorageReservation(0.25)
    assert reservation_percentage(reservation) == 0.25
    topology = Topology(world_size=1, compute_device="cpu")
    record_reservation(reservation, topology, Storage(hbm=0, ddr=1))
    assert reservation.last_reserved_topology.world_size == 1, "last_reserved_topology no longer reads it"
    _mentions("torchrec.distributed.planner.planners", "_dense_storage")
    return record_reservation


def _probe_comm_hook_left_to_us() -> object:
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    wrapper = DefaultDataParallelWrapper(allreduce_comm_precision="bf16")
    assert wrapper._allreduce_comm_precision == "bf16"
    if "_allreduce_comm_precision" not in inspect.unwrap(DefaultDataParallelWrapper._ddp_wrap).__code__.co_names:
        raise AttributeError("DefaultDataParallelWrapper._ddp_wrap no longer reads _allreduce_comm_precision")
    with comm_hook_left_to_us(wrapper) as comm:
        assert comm == "bf16" and wrapper._allreduce_comm_precision is None
    assert wrapper._allreduce_comm_precision == "bf16"
    return comm_hook_left_to_us


def _probe_semi_sync() -> object:
    TrainPipelineSemiSync = _train_pipeline("TrainPipelineSemiSync")  # noqa: N806
    for method in (TrainPipelineSemiSync.fill_pipeline, inspect.unwrap(TrainPipelineSemiSync.progress)):
        if method.__code__.co_varnames[:1] != ("self",):
            raise AttributeError(f"TrainPipelineSemiSync.{method.__name__} no longer takes self first")
    _set_by(TrainPipelineSemiSync, "_stash_gradients")
    _set_by(_train_pipeline("TrainPipelineSparseDist"), "_model")
    return semi_sync_pipeline


def _probe_run_first_on_load() -> object:
    seen = []
    module = nn.Linear(1, 1)
    module.register_load_state_dict_pre_hook(lambda *args: seen.append("theirs"))
    run_first_on_load(module, lambda *args: seen.append("ours"))
    module.load_state_dict(module.state_dict())
    assert seen == ["ours", "theirs"], seen
    _set_by(ShardedEmbeddingBagCollection, "_pre_load_state_dict_hook")
    return run_first_on_load


# name -> a function that returns the private object (raises if it is gone). Instance
# attributes are checked in the code of the class that sets them: no instance is needed.
def _probe_remapping_count() -> str:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    _mentions("torchrec.modules.mc_modules", "if self._current_iter == -1:")
    return _set_by(MCHManagedCollisionModule, "_current_history_buffer_offset")


def _probe_managed_collision() -> str:
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection as cls

    _set_by(cls, "_embedding_module")
    _takes(cls._evict, "evictions_per_table")
    return "_evict"


PRIVATE_APIS: dict[str, Callable[[], object]] = {
    "ShardedEmbeddingBagCollection._lookups": lambda: _set_by(ShardedEmbeddingBagCollection, "_lookups"),
    "ShardedEmbeddingBagCollection._optim": lambda: _set_by(ShardedEmbeddingBagCollection, "_optim"),
    "ShardedEmbeddingBagCollection._model_parallel_name_to_sharded_tensor": lambda: _set_by(
        ShardedEmbeddingBagCollection, "_model_parallel_name_to_sharded_tensor"),
    "CombinedOptimizer._optims": lambda: _set_by(CombinedOptimizer, "_optims"),
    "GroupedPooledEmbeddingsLookup._emb_modules": lambda: _set_by(GroupedPooledEmbeddingsLookup, "_emb_modules"),
    "GroupedPooledEmbeddingsLookup._feature_splits": lambda: _set_by(GroupedPooledEmbeddingsLookup, "_feature_splits"),
    "GroupedPooledEmbeddingsLookup._forward": lambda: GroupedPooledEmbeddingsLookup._forward,
    "GroupedPooledEmbeddingsLookup._vbe_splits": lambda: GroupedPooledEmbeddingsLookup._vbe_splits,
    "GroupedPooledEmbeddingsLookup._merge_variable_batch_embeddings":
        lambda: GroupedPooledEmbeddingsLookup._merge_variable_batch_embeddings,
    "DistributedModelParallel._dmp_wrapped_module": lambda: _set_by(DistributedModelParallel, "_dmp_wrapped_module"),
    "BatchedDenseEmbeddingBag._feature_table_map": lambda: _set_by(BatchedDenseEmbeddingBag, "_feature_table_map"),
    "BatchedDenseEmbeddingBag._embedding_table_index_type": lambda: _set_by(
        BatchedDenseEmbeddingBag, "_embedding_table_index_type"),
    "BatchedDenseEmbeddingBag._embedding_table_offset_type": lambda: _set_by(
        BatchedDenseEmbeddingBag, "_embedding_table_offset_type"),
    **{f"BaseBatchedEmbedding.{n}": (lambda n=n: _set_by(BaseBatchedEmbedding, n)) for n in (
        "_feature_table_map", "_embedding_table_index_type", "_embedding_table_offset_type")},
    **{f"ShardedEmbeddingCollection.{n}": (lambda n=n: _set_by(ShardedEmbeddingCollection, n)) for n in (
        "_lookups", "_optim", "_model_parallel_name_to_sharded_tensor")},
    "GroupedEmbeddingsLookup._emb_modules": lambda: _set_by(GroupedEmbeddingsLookup, "_emb_modules"),
    **{f"TableBatchedEmbeddingSlice.{n}": (lambda n=n: _set_by(TableBatchedEmbeddingSlice, n)) for n in (
        "_original_tensor", "_start_offset", "_end_offset", "_num_embeddings", "_embedding_dim")},
    **{f"ShardedEmbeddingBagCollection.{n}": (lambda n=n: _set_by(ShardedEmbeddingBagCollection, n)) for n in (
        "_has_mean_pooling_callback", "_pooling_type_to_rs_features", "_embedding_bag_configs", "_is_weighted")},
    "EmbeddingBagCollectionContext.divisor (set by ShardedEmbeddingBagCollection.input_dist)": lambda: _mentions(
        "torchrec.distributed.embeddingbag", "ctx.divisor = _create_mean_pooling_divisor("),
    "DistributedModelParallel._init_dmp(self, module)": lambda: _takes(DistributedModelParallel._init_dmp, "module"),
    "TrainPipelineSemiSync.progress, .fill_pipeline (self), ._stash_gradients, ._model": _probe_semi_sync,
    "BaseShardedManagedCollisionEmbeddingCollection.__init__ hands _embedding_module to the collection's sharder": (
        lambda: _mentions("torchrec.distributed.mc_embedding_modules", "e_sharder.shard(")
    ),
    "BaseShardedManagedCollisionEmbeddingCollection._embedding_module, ._evict": _probe_managed_collision,
    "MCHManagedCollisionModule._current_iter (-1: read _current_iter_tensor), ._current_history_buffer_offset":
        _probe_remapping_count,
    "ManagedCollisionModule._output_segments_tensor (a buffer)": lambda: _mentions(
        "torchrec.modules.mc_modules", f'"{_OUTPUT_SEGMENTS}"'),
    "BaseManagedCollisionEmbeddingCollection._embedding_module": lambda: _mentions(
        "torchrec.modules.mc_embedding_modules", "self._embedding_module"),
    **{f"{cls.__name__}._table_name_to_config": (lambda cls=cls: _set_by(cls, "_table_name_to_config")) for cls in (
        ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)},
    "DistributedModelParallel._plan": lambda: _set_by(DistributedModelParallel, "_plan"),
    "DistributedModelParallel._sharder_map": lambda: _set_by(DistributedModelParallel, "_sharder_map"),
    "DistributedModelParallel._data_parallel_wrapper": lambda: _set_by(DistributedModelParallel,
                                                                        "_data_parallel_wrapper"),
    "fused params key _batch_key (embedding_sharding.group_tables)": lambda: _mentions(
        "torchrec.distributed.embedding_sharding", BATCH_KEY),
    "EmbeddingCollectionSharder._use_index_dedup": lambda: EmbeddingCollectionSharder()._use_index_dedup,
    "FixedPercentageStorageReservation._percentage, ._last_reserved_topology, ._dense_storage (edited: "
    "record_reservation)": _probe_record_reservation,
    "EmbeddingShardingPlanner._enumerator, ._topology, ._batch_size, ._constraints (edited: replace_enumerator)":
        _probe_replace_enumerator,
    "shard_estimators reads tensor._optimizer_classes (edited: optimizer_classes_hidden)":
        _probe_optimizer_classes_hidden,
    "create_grouped_sharding_infos reads _optimizer_classes, _optimizer_kwargs (edited: annotations_read_as)":
        _probe_annotations_read_as,
    "DefaultDataParallelWrapper._allreduce_comm_precision (edited: comm_hook_left_to_us)":
        _probe_comm_hook_left_to_us,
    "the lookups call each kernel of _emb_modules (edited: recast_kernel)": _probe_recast_kernel,
    "ShardedEmbeddingBagCollection._lookups, ShardedEmbeddingCollection._lookups (edited: replace_lookup)":
        _probe_replace_lookup,
    "nn.Module._load_state_dict_pre_hooks, run before ShardedEmbeddingBagCollection._pre_load_state_dict_hook "
    "(edited: run_first_on_load)": _probe_run_first_on_load,
}


def _set_by(cls: type, name: str) -> str:
    """``name`` if some method of ``cls`` (or of a base) uses the attribute; AttributeError if none does."""
    for klass in cls.__mro__:
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None and name in code.co_names:
                return name
    raise AttributeError(f"no method of {cls.__name__} sets or reads {name!r} any more")


def _takes(function: Callable, parameter: str) -> str:
    if parameter not in inspect.signature(function).parameters:
        raise AttributeError(f"{function.__qualname__} no longer takes {parameter!r}")
    return parameter


def _mentions(module: str, text: str) -> str:
    source = inspect.getsource(importlib.import_module(module))
    if text not in source:
        raise AttributeError(f"{module} no longer mentions {text!r}")
    return text
