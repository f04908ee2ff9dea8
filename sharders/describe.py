"""``describe(model)``: the sharding plan as it runs, one row per kernel per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchrec.modules.embedding_configs import data_type_to_dtype

from overlap_optim.keyed import unwrapped_path
from sharders._private import kernels_of
from sharders.kernels import TableKernel
from sharders.plan import plan_of

__all__ = ["describe", "kernel_rows"]

_HEADER = ("rank", "module", "kernel", "sharding type", "tables", "optimizer", "runs as", "semantics", "why not fused",
           "dtype: weights / state", "memory: held / planned")
_DTYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16", torch.float64: "FP64"}


def kernel_rows(model: nn.Module) -> list[tuple[str, ...]]:
    """This rank's rows: one per kernel of every module sharded by our sharders."""
    rank = str(dist.get_rank()) if dist.is_initialized() else "0"
    rows = []
    for path, module in model.named_modules():
        plan = plan_of(module)
        if plan is None:
            continue
        for index, (_, kernel) in enumerate(kernels_of(module)):
            tables = [plan.tables[t.name] for t in kernel.config.embedding_tables]
            rows.append((
                rank,
                unwrapped_path(path),
                str(index),
                tables[0].decision.sharding_type,
                _table_names(tables),
                _per_table(tables, lambda t: t.setting()),
                _per_table(tables, lambda t: t.runs_as()),
                _per_table(tables, lambda t: t.semantics),
                _per_table(tables, lambda t: t.why_not_fused()),
                _dtypes(module, plan, kernel),
                _memory(module, plan, kernel),
            ))
    return rows


def _dtypes(module: nn.Module, plan, kernel: nn.Module) -> str:
    """The kernel's weight dtype, and its optimizer state's (``-``: none held yet)."""
    weights = _DTYPES.get(_weight_dtype(kernel), str(_weight_dtype(kernel)))
    state = {
        _DTYPES.get(v.dtype, str(v.dtype))
        for config in kernel.config.embedding_tables
        for v in _state_of(module, plan, plan.tables[config.name], config).values()
        if torch.is_tensor(v) and v.dim() > 0
    }
    return f"{weights} / {', '.join(sorted(state)) or '-'}"


def _weight_dtype(kernel: nn.Module) -> torch.dtype:
    """The dtype a kernel stores its tables in (TorchRec's ``data_type`` of its first table)."""
    return data_type_to_dtype(kernel.config.embedding_tables[0].data_type)


def _memory(module: nn.Module, plan, kernel: nn.Module) -> str:
    """This rank's bytes of the kernel's table shards, weights and optimizer state: held now (every
    state tensor of each shard's kernel) / planned (weights plus ``TableKernel.state_bytes``, what
    :mod:`sharders.planner` counts; per-step buffers and I/O aside)."""
    held = planned = 0
    for config in kernel.config.embedding_tables:
        table = plan.tables[config.name]
        shape = tuple(config.local_metadata.shard_sizes) if config.local_metadata is not None else table.decision.shape
        weights = shape[0] * shape[1] * torch.empty(0, dtype=_weight_dtype(kernel)).element_size()
        planned += weights + table.state_bytes(shape)
        held += weights + sum(_bytes(v) for v in _state_of(module, plan, table, config).values())
    return f"{_human(held)} / {_human(planned)}"


def _state_of(module: nn.Module, plan, table: TableKernel, config) -> dict:
    """The optimizer state one shard (``config``) of ``table`` holds on this rank."""
    weight = getattr(getattr(module, plan.state.tables_attr)[table.table], "weight", None)
    return table.held_state(config.local_metadata, weight)


def _bytes(value) -> int:
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024 or unit == "MiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _table_names(tables: list[TableKernel]) -> str:
    """The kernel's tables, each once: ``t0 (2 shards)`` where it holds several shards of one."""
    names = [d.table for d in tables]
    return ", ".join(n if names.count(n) == 1 else f"{n} ({names.count(n)} shards)" for n in dict.fromkeys(names))


def _per_table(tables: list[TableKernel], column) -> str:
    """The column's value, once if every table of the kernel agrees, else ``table: value`` for each
    (the tables of a virtual group share a fallback kernel with settings that differ in floats)."""
    values = {d.table: column(d) for d in tables}
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return "; ".join(f"{table}: {v}" for table, v in values.items())


def describe(model: nn.Module) -> str:
    """A markdown table of every kernel on every rank: its tables, sharding type,
    optimizer and settings (each table's, where the tables of a fallback kernel
    differ in float settings: one virtual group), fused or fallback, its semantics ("lazy": only the
    rows a batch touched change; "dense": every row steps, untouched ones on a
    zero gradient; "frozen": never updated), for a fallback which setting prevented fusion, the dtype of
    the weights and of the optimizer state, and the bytes of
    weights and optimizer state the rank holds for the kernel, beside what :mod:`sharders.planner` plans
    for them. A kernel that holds several shards of one table (column shards, say) names it once, with the count.

    Under ``torch.distributed`` this is a collective: call it on every rank; each
    returns the whole table.
    """
    rows = kernel_rows(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[list[tuple[str, ...]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        rows = [row for part in gathered for row in (part or [])]
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + " --- |" * len(_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
