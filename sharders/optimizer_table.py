"""The one table that decides: a table's annotation and sharding -> the kind of kernel that runs it.

:func:`decide` reads a table's annotation and its sharding and returns its
:class:`~sharders.kernels.TableDecision`, whose ``kind`` is the registry line
(:mod:`sharders.kinds`) of the class that runs it. A table is fused only where FBGEMM computes the same update as
``torch.optim`` on that device type (:func:`choose_kernel`); its kwargs are then
translated, name by name, and nothing else reaches FBGEMM. Everything else runs
in the fallback kernel, which applies the real ``torch.optim`` step. A reader
who wants to know "why did table t3 not fuse?" finds the answer in FBGEMM's
rules (:data:`sharders.fbgemm.RULES`, with FBGEMM's other names), or in
:func:`decide` below, where the user, the plan or clipping kept a table out of them, or in
:meth:`sharders.fbgemm.FusedTable.keeps`, where FBGEMM would not be exact on that table.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.clipping import GradientClipping, clipping_of
from overlap_optim.record import contract_of, group_of
from overlap_optim.spec import AnnotationGroup, OptimizerSpec, describe_optimizer, needs_closure
from overlap_optim.cross_shard import cross_shard_class
from sharders.fbgemm import RULES, FusedTable, choose_kernel
from sharders.kernels import COLUMN_SPLITTING, DTYPE_NAMES, ROW_SPLITTING, KernelChoice, TableDecision
from sharders.kinds import KINDS, Kind, TableFacts, kind_of

__all__ = [
    "KernelChoice", "choose_kernel", "decide", "annotation_of", "RULES",
    "DOC_EXAMPLES", "ALL_OPTIMIZERS", "decision_table_markdown", "support_table_markdown", "ROW_SPLITTING", "COLUMN_SPLITTING",
]

SHARDING_TYPES = ("data_parallel", "table_wise", *COLUMN_SPLITTING, *ROW_SPLITTING)


def decide(
    table: str,
    weight: torch.Tensor,
    sharding_type: str,
    shard_offsets: list[list[int]],
    compute_kernel: str,
    shape: tuple[int, int],
    device_type: str,
    torch_made: dict[str, AnnotationGroup],
    *,
    pinned: frozenset[str] = frozenset(),
    dense: frozenset[str] = frozenset(),
    shard_sizes: list[list[int]] = (),
    variable_batch: bool = False,
    dtype: torch.dtype | None = None,
    kinds: tuple[Kind, ...] = KINDS,
) -> TableDecision:
    """Where ``table`` runs, from its (unsharded) ``weight``'s annotation and its sharding.

    Args:
        shard_offsets: the ``[row, col]`` offset of each shard the plan makes of it.
        compute_kernel: the plan's kernel for it; "dense" pins a fusable table to the fallback.
        torch_made: shared by the tables of one module (see :func:`annotation_of`).
        pinned: tables named in ``fallback_tables``; ``dense``: in ``dense_tables``.
        shard_sizes: the ``[rows, cols]`` of each shard; a shard with none of either keeps the
            table out of FBGEMM's CPU kernel, which refuses an empty table.
        variable_batch: the module takes batches with a variable batch size per feature (VBE):
            a table whose fused kernel cannot run them (FBGEMM's Adagrad; a clipped table, whose
            backward is held) runs in the fallback, which can.
        dtype: the dtype the table is stored in, its config's ``data_type`` (TorchRec's unsharded
            module holds a BF16 table in FP16); None: the weight's.
        kinds: the registry's lines, a sharder's added ones first (:func:`sharders.kinds.check_kinds`).

    Raises:
        ValueError: the table is split along an axis its optimizer is not separable by and
            has no cross-shard form; its optimizer needs a closure; the plan names a compute
            kernel we do not run (:data:`RUNNABLE_KERNELS`).
        NotImplementedError: a weight that is not FP32, FP16 or BF16, or a low-precision weight that its
            kind cannot run exactly (:attr:`~sharders.kernels.TableKernel.precisions`).
        NotImplementedError: a table with no annotation is in a gradient clipping set.
    """
    dtype = weight.dtype if dtype is None else dtype
    _check_runnable(table, dtype, compute_kernel, device_type)
    frozen = not weight.requires_grad
    group = None if frozen else annotation_of(weight, table, torch_made)
    clip = None if frozen else clipping_of(weight)
    cross_shard = False
    if group is None:  # frozen, or TorchRec's dense kernel with the gradient handed back on the weight
        choice = KernelChoice(False, reason="frozen: requires_grad=False" if frozen else "no annotation")
        _check_unannotated_clip(table, clip)
    else:
        choice = _choice(table, group, compute_kernel, device_type, pinned, dense, clip, variable_batch)
        cross_shard = _check_separable(table, group, sharding_type, shard_offsets)
        if choice.fused:
            choice = FusedTable.keeps(choice, device_type=device_type, sharding_type=sharding_type,
                                      shard_sizes=shard_sizes, group=group, dtype=dtype, cross_shard=cross_shard)
    facts = TableFacts(table, sharding_type, None if group is None else group.spec, choice, frozen=frozen,
                       cross_shard=cross_shard, dense_requested=table in dense, dtype=dtype)
    kind = kind_of(facts, kinds)
    if group is not None and group.state_dtype is not None and not kind.cls.low_precision_state:
        raise NotImplementedError(
            f"table {table!r} is annotated with state_dtype={group.state_dtype} and runs as "
            f"{kind.name} ({sharding_type}), which keeps its "
            "optimizer state in float32 only; low-precision state runs in the fallback (touched rows, whole "
            "shards, cross-shard tables) and in the DDP hook (data_parallel); annotate the table without state_dtype"
        )
    if dtype not in kind.cls.precisions:
        raise NotImplementedError(
            f"table {table!r} holds its weights in {DTYPE_NAMES.get(dtype, dtype)} and runs as "
            f"{kind.name} ({sharding_type}), which is exact in "
            f"float32 only: {kind.cls.float32_only}. Low-precision tables run annotated with an in-backward optimizer: "
            "in the fallback (touched rows, whole shards, cross-shard tables) on a model-parallel sharding type, "
            "or on data_parallel (the whole table, its gradient averaged across ranks); or build the table with "
            "data_type=DataType.FP32"
        )
    return TableDecision(table, sharding_type, shape, group, choice, kind, device_type, clip, dtype)


# The compute kernels a plan may name, per device type: "fused" is TorchRec's planner's name for
# every model-parallel kernel, "dense" pins a table to the fallback; FBGEMM runs the same update in
# UVM (CUDA). Anything else (key_value, ssd, quant...) is a kernel we do not run.
RUNNABLE_KERNELS = {
    "cpu": frozenset({"dense", "fused"}),
    "cuda": frozenset({"dense", "fused", "fused_uvm", "fused_uvm_caching"}),
}


def _check_runnable(table: str, dtype: torch.dtype, compute_kernel: str, device_type: str) -> None:
    """Refuse, by table, a plan's compute kernel that we do not run, and a weight that is not FP32, FP16 or BF16."""
    runnable = RUNNABLE_KERNELS.get(device_type, RUNNABLE_KERNELS["cpu"])
    if compute_kernel not in runnable:
        raise ValueError(
            f"table {table!r}: the plan gives it compute kernel {compute_kernel!r}, which overlap-optim does not run "
            f"on {device_type}; a plan may give {sorted(runnable)} (\"dense\" pins the table to the fallback)"
        )
    if dtype not in DTYPE_NAMES:
        raise NotImplementedError(
            f"table {table!r} holds its weights in {dtype}: tables are FP32, FP16 or BF16; build the "
            "table with data_type=DataType.FP32"
        )


def _check_unannotated_clip(table: str, clip: GradientClipping | None) -> None:
    if clip is not None:
        raise NotImplementedError(
            f"table {table!r} has no in-backward optimizer and is in a gradient clipping set ({clip!r}): clipping "
            "a sharded table that your own optimizer steps is not supported; annotate the table, or leave it out "
            "of the set"
        )


def _choice(
    table: str, group: AnnotationGroup, compute_kernel: str, device_type: str, pinned: frozenset[str],
    dense: frozenset[str], clip: GradientClipping | None = None, variable_batch: bool = False,
) -> KernelChoice:
    """FBGEMM's translation, unless the user, the plan or gradient clipping keeps the table out
    of the fused kernel."""
    choice = choose_kernel(
        group.optimizer_class, group.optimizer_kwargs, device_type, table=table, settings=group.hyperparameters()
    )
    if choice.fused and clip is not None and not clip.by_norm:
        # FBGEMM's only clipping clamps the pooled output gradient, not each element of a row's
        # summed gradient, and clamping is not linear in the output gradient. Clipping by norm
        # stays fused: sharders.fused_clipping holds FBGEMM's backward for the coefficient.
        return KernelChoice(
            False, reason="gradient clipping by value: FBGEMM cannot clamp a row's summed gradient before its update"
        )
    if choice.fused and table in dense:
        return KernelChoice(False, reason="dense semantics requested (dense_tables)")
    if choice.fused and table in pinned:
        return KernelChoice(False, reason="pinned to the fallback (fallback_tables)")
    if choice.fused and compute_kernel == "dense":
        return KernelChoice(False, reason="the plan gives it compute kernel 'dense'")
    if choice.fused and variable_batch:  # TorchRec's VBE merging takes one kind of kernel per lookup
        return KernelChoice(False, reason="variable_batch=True: every table of the module runs in the fallback, "
                                          "the one kernel that takes VBE batches whatever its optimizer")
    return choice


def _check_separable(table: str, group: AnnotationGroup, sharding_type: str, offsets: list[list[int]]) -> bool:
    """Refuse a table split along an axis its optimizer cannot be split by (its update reads
    the whole matrix: Adafactor's factored moments, Muon's orthogonalisation, a per-row
    accumulator split into column shards), unless :mod:`sharders.cross_shard` has a cross-shard
    form of it: then True, the table's statistics travel in the module's round."""
    spec = group.spec
    for axis, what in ((0, "row"), (1, "column")):
        if len({o[axis] for o in offsets}) <= 1:  # not split this way: separability is not asked (nor probed)
            continue
        separable = spec.row_separable if axis == 0 else spec.column_separable
        if separable:
            continue
        implementation = cross_shard_class(spec.optimizer_class)
        why = "it has no cross-shard form" if implementation is None else implementation.unsupported(spec, axis)
        if why is None:
            return True
        works = ["table_wise", "data_parallel"]
        works += list(ROW_SPLITTING) if spec.row_separable else []
        works += list(COLUMN_SPLITTING) if spec.column_separable else []
        raise ValueError(
            f"table {table!r}: {spec.name}'s update is not separable by {what}s (stepping {what} pieces "
            f"apart differs from stepping the whole table), {sharding_type} sharding splits "
            f"this table into {what} shards, and {why}; use {', '.join(works)} for this table"
        )
    return False


def annotation_of(
    weight: torch.Tensor, table: str, torch_made: dict[str, AnnotationGroup] | None = None
) -> AnnotationGroup | None:
    """The table's annotation, also when torch's own ``_apply_optimizer_in_backward`` made it;
    None for a table with no annotation.

    Tables that torch's function annotated with equal settings share one group
    per ``torch_made`` dict (that function does not record which call made what).
    """
    group = group_of(weight)
    if group is not None:
        return group
    contract = contract_of(weight)
    if contract is None or contract[0] is None:
        return None
    cls, kwargs = contract
    made = {} if torch_made is None else torch_made
    label = f"{cls.__module__}.{cls.__qualname__}{sorted(kwargs.items())}"
    if label not in made:
        if needs_closure(cls):
            raise ValueError(f"table {table!r}: {cls.__name__} needs a closure in step() and cannot run in backward")
        try:
            made[label] = AnnotationGroup(describe_optimizer(cls, kwargs))
        except (TypeError, ValueError, NotImplementedError) as err:  # name the table torch annotated
            raise type(err)(f"table {table!r}: {err}") from None
    return made[label]


def _support(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], sharding_type: str, device: str) -> str:
    """What happens to a table annotated ``cls(**kwargs)`` under ``sharding_type``, split in several shards."""
    spec = describe_optimizer(cls, kwargs)
    for splitting, separable, what in ((ROW_SPLITTING, spec.row_separable, "rows"),
                                       (COLUMN_SPLITTING, spec.column_separable, "columns")):
        if sharding_type in splitting and not separable:
            if cross_shard_class(cls) is not None:
                return "exact, dense (cross-shard)"
            return f"refused: not separable by {what}"
    if sharding_type == "data_parallel":
        return "exact, dense (DDP hook)"
    kind = kind_of(TableFacts("?", sharding_type, spec, choose_kernel(cls, kwargs, device, settings=spec.defaults))).cls
    return f"exact, {kind.semantics} ({kind.family})"


def support_table_markdown(
    examples: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]], device: str = "cpu"
) -> str:
    """A markdown table: each example optimizer x sharding type, exact (lazy or dense, which kernel) or refused."""
    lines = ["| optimizer | " + " | ".join(SHARDING_TYPES) + " |", "| --- |" + " --- |" * len(SHARDING_TYPES)]
    for label, cls, kwargs in examples:
        try:
            cells = [_support(cls, kwargs, st, device) for st in SHARDING_TYPES]
        except (TypeError, ValueError) as err:  # cannot run in backward at all
            reason = "needs a closure" if needs_closure(cls) else str(err).split(": ", 2)[-1].split(",")[0]
            cells = [f"refused: {reason}"] * len(SHARDING_TYPES)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decision_table_markdown(
    examples: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]],
) -> str:
    """A markdown table of what :func:`choose_kernel` decides for each example, per device type."""
    lines = ["| setting | " + " | ".join(RULES) + " |", "| --- |" + " --- |" * len(RULES)]
    for label, cls, kwargs in examples:
        cells = []
        for device in RULES:
            choice = choose_kernel(cls, kwargs, device)
            cells.append(f"fused {choice.fbgemm_kwargs['optimizer'].name}" if choice.fused else f"fallback: {choice.reason}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The settings docs/optimizers.md shows; regenerate with `python -m sharders.optimizer_table`.
DOC_EXAMPLES: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("SGD(lr)", torch.optim.SGD, {"lr": 0.1}),
    ("SGD(lr, momentum)", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("SGD(lr, weight_decay)", torch.optim.SGD, {"lr": 0.1, "weight_decay": 1e-4}),
    ("Adagrad(lr, eps)", torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    ("Adagrad(lr, lr_decay)", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    ("Adagrad(lr, initial_accumulator_value)", torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    ("Adagrad(lr, weight_decay)", torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 1e-4}),
    ("RowWiseAdagrad(lr)", RowWiseAdagrad, {"lr": 0.1}),
    ("RowWiseAdagrad(lr, weight_decay)", RowWiseAdagrad, {"lr": 0.1, "weight_decay": 1e-4}),
    ("Adam(lr)", torch.optim.Adam, {"lr": 1e-3}),
    ("Adam(lr, amsgrad)", torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
    ("AdamW(lr, weight_decay)", torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    ("RMSprop(lr)", torch.optim.RMSprop, {"lr": 1e-3}),
]


# Every optimizer of torch.optim (torch 2.13) and torchrec's RowWiseAdagrad, for the support table.
ALL_OPTIMIZERS: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("SGD", torch.optim.SGD, {"lr": 0.1}),
    ("SGD(momentum, dampening, nesterov, weight_decay)", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1}),
    ("Adagrad(lr_decay, weight_decay, initial_accumulator_value, maximize)", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    ("RowWiseAdagrad (torchrec)", RowWiseAdagrad, {"lr": 0.1}),
    ("Adam, AdamW (amsgrad, maximize)", torch.optim.Adam, {"lr": 1e-3}),
    ("Adamax", torch.optim.Adamax, {"lr": 1e-3}),
    ("NAdam (decoupled_weight_decay, momentum_decay)", torch.optim.NAdam, {"lr": 1e-3, "decoupled_weight_decay": True}),
    ("RAdam (decoupled_weight_decay)", torch.optim.RAdam, {"lr": 1e-3, "decoupled_weight_decay": True}),
    ("RMSprop", torch.optim.RMSprop, {"lr": 1e-3}),
    ("Rprop", torch.optim.Rprop, {"lr": 1e-3}),
    ("ASGD", torch.optim.ASGD, {"lr": 1e-3}),
    ("Adadelta", torch.optim.Adadelta, {"lr": 1.0}),
    ("Adafactor", torch.optim.Adafactor, {"lr": 1e-2}),
    ("Muon (2-D tables)", torch.optim.Muon, {"lr": 1e-2}),
    ("LBFGS", torch.optim.LBFGS, {"lr": 1.0}),
    ("SparseAdam", torch.optim.SparseAdam, {"lr": 1e-3}),
]


if __name__ == "__main__":
    print(decision_table_markdown(DOC_EXAMPLES))
    print()
    print(support_table_markdown(ALL_OPTIMIZERS))
