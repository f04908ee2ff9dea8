"""Settings changed at run time are refused on every rank alike, not only where the table lives.

A fused kernel refuses a setting FBGEMM cannot compute (weight decay on
Adagrad, say) in its own forward pre-hook (:mod:`sharders.fbgemm`), and a
fallback table refuses a changed non-float setting when it steps. Only a rank
that holds the table runs those. On a table_wise table the other ranks would go
on to the next collective and wait there for a peer that has raised.

So every rank also asks every table kernel of a sharded module, wherever the
table lives, to check its live settings (:meth:`sharders.kernels.TableKernel.check_live`)
at the start of the module's first lookup. Every rank runs that lookup at every
step, after the input all-to-all and before any other collective of the step,
and every rank reads the same param groups (a scheduler or a user changes them
on all ranks). So they all raise the same error at the same point, and none is
left waiting.

The clipping sets of the module's tables are checked there too (an unannotated member that
nothing of ours reduces is refused before any table of the set has stepped).

Data-parallel tables are left to the DDP hook, which every rank runs anyway. A
refusal that only a step can show (SGD's momentum raised from 0 on a fallback
table: new state that the untouched rows lack) is still raised where the table
steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from overlap_optim.accumulation import module_accumulating
from overlap_optim.keyed import refuse_compiling_pipeline
from overlap_optim.record import group_of
from overlap_optim.spec import settings_of
from sharders import _private
from sharders.kernels import ROW_SPLITTING, TableKernel

__all__ = ["install_settings_check"]

# What runs a variable batch size per feature (VBE) exactly: FBGEMM's fused SGD and row-wise Adagrad,
# and the fallback, on a model-parallel sharding type.
VARIABLE_BATCH_ROUTE = (
    "declare it with EmbeddingBagCollectionSharder(variable_batch=True), which runs every annotated table on a "
    "model-parallel sharding type where VBE is exact (FBGEMM's fused SGD and RowWiseAdagrad unclipped, the "
    "fallback for the rest) and refuses the others by name when sharding; keep VBE batches out of no_step; or "
    "send batches with one batch size for every feature"
)


def install_settings_check(
    sharded: nn.Module, tables: dict[str, TableKernel], process_group: Any = None
) -> Callable[[], None] | None:
    """Check every table kernel's live settings before ``sharded``'s first lookup, on every rank;
    a batch with a variable batch size per feature (VBE) too, against every table of the module,
    and, on gloo, before each row-split lookup, against its ranks' batch sizes. Returns the same
    checks (VBE's aside), for what runs before that lookup and changes the model (None: no lookup)."""
    kernels = list(tables.values())
    clips = list({id(k.clip): k.clip for k in kernels if k.clip is not None}.values())
    lookups = _private.lookups(sharded)
    if not lookups:
        return None
    if process_group is not None and dist.get_backend(process_group) == "gloo":
        _check_row_split_batches(sharded, tables)

    live = _LiveChecks(kernels)

    def check(_lookup: Any, inputs: Any) -> None:
        refuse_compiling_pipeline()  # where the pipeline's optimizer is not ours (the keyed one refuses first)
        _check_semi_sync(kernels, clips)
        live.run()
        if inputs and isinstance(inputs[0], KeyedJaggedTensor) and inputs[0].variable_stride_per_key():
            _check_variable_batch(kernels, module_accumulating(sharded), process_group)
        for clip in clips:  # before any update of the step: a refused set leaves every weight as it was
            clip.check_members()

    lookups[0].register_forward_pre_hook(check)
    return lambda: check(None, ())


class _LiveChecks:
    """Every kernel's :meth:`~sharders.kernels.TableKernel.check_live`, at a cost flat in the tables:
    the kernels of one kind and one annotation group read the same settings, so one of them checks
    for all, and only when the group's settings differ from those it last passed with."""

    def __init__(self, kernels: list[TableKernel]) -> None:
        self.groupless = [k for k in kernels if k.group is None]  # what they check is their own (frozen)
        self.by_group = {(type(k), id(k.group)): k for k in reversed(kernels) if k.group is not None}
        self.passed: dict[tuple[type, int], tuple] = {}

    def run(self) -> None:
        for kernel in self.groupless:
            kernel.check_live()
        for key, kernel in self.by_group.items():
            now = settings_of(kernel.group.param_group)
            if self.passed.get(key) != now:
                kernel.check_live()  # raises, naming the table, with nothing changed
                self.passed[key] = now


def _check_semi_sync(kernels: list[TableKernel], clips: list[Any]) -> None:
    """Under TorchRec's ``TrainPipelineSemiSync`` (every rank runs it, and reaches this lookup before
    any backward of the step): refuse what it cannot run exactly. It runs the dense backward and each
    sharded module's embedding backward as separate backward passes, and a clipping set closes its
    norm at the end of each; with ``stash_gradients=True`` it steps the dense optimizer on the
    previous batch's gradients, where an annotated dense parameter steps in backward on this one."""
    pipeline = _private.semi_sync_pipeline()
    if pipeline is None:
        return
    mine = {k.table for k in kernels}
    for clip in clips:
        others = sorted(set(clip.tables) - mine)
        if clip.params or others:
            beyond = f"{len(clip.params)} dense parameter(s)" if clip.params else f"the tables {others}"
            raise NotImplementedError(
                f"TrainPipelineSemiSync with a clipping set over the tables {sorted(set(clip.tables) & mine)} and "
                f"{beyond}: SemiSync runs the dense backward and each sharded module's embedding backward as "
                "separate backward passes, so each would be clipped by a norm of its own, not the global one. "
                "Clip each module's tables and the dense part in separate sets, or train with "
                "TrainPipelineSparseDist"
            )
    if _private.stashes_gradients(pipeline):
        annotated = sorted(n for n, p in _private.pipeline_model(pipeline).named_parameters() if group_of(p) is not None)
        if annotated:
            raise NotImplementedError(
                f"TrainPipelineSemiSync(stash_gradients=True) with in-backward optimizers on {annotated}: it steps "
                "the dense optimizer on the previous batch's gradients, and these step during backward on this "
                "batch's, so it would train as without stash. Use stash_gradients=False, or leave the dense part "
                "to an optimizer of your own"
            )


def _check_row_split_batches(sharded: nn.Module, tables: dict[str, TableKernel]) -> None:
    """Refuse, on every rank alike, a VBE batch whose ranks give a feature of a row-split table
    different batch sizes: TorchRec's row-wise output reduce-scatter gathers its uneven pieces in
    backward with ``all_gather``, which gloo cannot (``ProcessGroupGloo::allgather: invalid tensor
    size``), after every rank has run its forward. Every rank's row-split lookup sees every rank's
    batch sizes of its features, so every rank decides alike."""
    row_split = {}
    for lookup, kernel in _private.kernels_of(sharded):
        names = [t.name for t in kernel.config.embedding_tables]
        if any(tables[n].decision.sharding_type in ROW_SPLITTING for n in names if n in tables):
            row_split.setdefault(id(lookup), (lookup, []))[1].extend(names)

    def check(names: list[str], inputs: Any) -> None:
        features = inputs[0] if inputs and isinstance(inputs[0], KeyedJaggedTensor) else None
        if features is None or not features.variable_stride_per_key():
            return
        uneven = {k: s for k, s in zip(features.keys(), features.stride_per_key_per_rank()) if len(set(s)) > 1}
        if uneven:
            why = f"row-split, and the ranks send its features different batch sizes {uneven}"
            raise NotImplementedError(
                "a batch with a variable batch size per feature (VBE) reached tables that cannot take it: "
                f"{dict.fromkeys(names, why)}; TorchRec's row-wise output reduce-scatter gathers uneven pieces in "
                "backward, which gloo cannot: "
                "on gloo, send each feature the same batch size from every rank, or shard these tables table_wise "
                "or column_wise"
            )

    for lookup, names in row_split.values():
        lookup.register_forward_pre_hook(lambda _m, inputs, names=names: check(names, inputs))


def _check_variable_batch(kernels: list[TableKernel], accumulating: bool, process_group: Any = None) -> None:
    """Refuse a VBE batch, on every rank alike and before any update, naming each table that cannot
    take it (the fallback and data-parallel kinds, FBGEMM's Adagrad, a clipped table, no_step)."""
    why = {k.table: k.variable_batch_refusal() for k in kernels}
    several_ranks = process_group is not None and dist.get_world_size(process_group) > 1
    by_type: dict[str, list[TableKernel]] = {}
    for kernel in kernels:
        by_type.setdefault(kernel.decision.sharding_type, []).append(kernel)
    for sharding_type, same in by_type.items():  # the same on every rank: every table's kind is known
        mixed = {"fallback", "fused"} <= {k.family for k in same}
        if several_ranks and mixed:
            for k in same:
                why[k.table] = why[k.table] or (
                    f"a fused and a fallback table share TorchRec's {sharding_type} lookup, whose VBE merging takes "
                    "FBGEMM's fused kernels or dense ones, not both; declare variable_batch=True (the fallback runs "
                    "them all), or give the fused tables another sharding type")
    if accumulating:
        why = {t: r or "inside no_step, and FBGEMM's variable-batch backward cannot be held" for t, r in why.items()}
    refused = {t: r for t, r in why.items() if r is not None}
    if refused:
        raise NotImplementedError(
            f"a batch with a variable batch size per feature (VBE) reached tables that cannot take it: {refused}; "
            f"{VARIABLE_BATCH_ROUTE}"
        )
