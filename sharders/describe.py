"""``describe(model)``: the sharding plan as it runs, one row per kernel per rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from overlap_optim.keyed import unwrapped_path
from sharders._private import kernels_of
from sharders.kernels import TableKernel
from sharders.plan import plan_of

__all__ = ["describe", "kernel_rows"]

_HEADER = ("rank", "module", "kernel", "sharding type", "tables", "optimizer", "runs as", "semantics", "why not fused")


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
            ))
    return rows


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
    zero gradient; "frozen": never updated), and for a fallback which setting prevented fusion. A kernel that
    holds several shards of one table (column shards, say) names it once, with the count.

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
