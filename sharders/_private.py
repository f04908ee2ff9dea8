"""Every private TorchRec API the sharders touch, each in one place, each named and checked.

TorchRec does not promise these across releases. Each is reached only through
the functions here, so an upgrade that removes one breaks one function, and
``tests/test_private_apis.py`` names it: it checks every entry of
:data:`PRIVATE_APIS` against the installed TorchRec.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BatchedDenseEmbeddingBag
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

__all__ = [
    "PRIVATE_APIS", "BATCH_KEY", "WRAPPED", "lookups", "kernels_of_lookup", "kernels_of", "add_fused_optimizer", "sharded_weights",
    "wrapped_module", "DenseKernelLayout", "dense_kernel_layout", "slice_again", "ModelBeingSharded",
    "model_being_sharded", "divide_only_row_split_means",
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
    another sharding type is divided too, so a table_wise SUM feature ends up averaged, and a
    column_wise MEAN feature divided twice (silently wrong output and gradients, measured). Here
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
    # gradients) amplify past 1e-5 (measured). Unweighted, the divisor is a whole number of ids
    # (1 where nothing is divided): rounded, it is exact; an empty bag's sum (0) stays 0, as
    # nn.EmbeddingBag's mean of an empty bag. Private: ``input_dist`` sets ``ctx.divisor``, which
    # the module's output callback divides by (every caller, train pipelines included).
    input_dist = sharded.input_dist

    def exact_input_dist(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        out = input_dist(ctx, *args, **kwargs)
        if getattr(ctx, "divisor", None) is not None:
            ctx.divisor = torch.round(ctx.divisor).clamp_(min=1.0)
        return out

    sharded.input_dist = exact_input_dist


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
                                     dmp._data_parallel_wrapper)
        frame = frame.f_back
    return None


def merge_dense_variable_batches_by_rank(sharded: nn.Module) -> None:
    """For a batch with a variable batch size per feature (VBE), TorchRec's pooled lookup joins
    the outputs of several dense kernels kernel after kernel (``torch.cat``), where its output
    all-to-all reads them rank after rank: each rank then gets other ranks' bags. Each such lookup
    of ``sharded`` joins them with TorchRec's own rank-major merge instead. Private:
    ``GroupedPooledEmbeddingsLookup._emb_modules``, ``._feature_splits``, ``._forward``,
    ``._vbe_splits`` and ``._merge_variable_batch_embeddings``."""
    for lookup in lookups(sharded):
        modules = kernels_of_lookup(lookup)
        if len(modules) < 2 or not all(isinstance(m, BatchedDenseEmbeddingBag) for m in modules):
            continue

        def forward(features: Any, lookup: nn.Module = lookup, plain: Callable = lookup.forward) -> Any:
            if not features.variable_stride_per_key():
                return plain(features)
            groups = features.split(lookup._feature_splits)
            return lookup._merge_variable_batch_embeddings(lookup._forward(groups), lookup._vbe_splits(groups))

        lookup.forward = forward


# name -> a function that returns the private object (raises if it is gone). Instance
# attributes are checked in the code of the class that sets them: no instance is needed.
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
    "DistributedModelParallel._plan": lambda: _set_by(DistributedModelParallel, "_plan"),
    "DistributedModelParallel._sharder_map": lambda: _set_by(DistributedModelParallel, "_sharder_map"),
    "DistributedModelParallel._data_parallel_wrapper": lambda: _set_by(DistributedModelParallel,
                                                                        "_data_parallel_wrapper"),
    "fused params key _batch_key (embedding_sharding.group_tables)": lambda: _mentions(
        "torchrec.distributed.embedding_sharding", BATCH_KEY),
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
