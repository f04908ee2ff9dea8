"""``describe(model)``: the sharding plan as it runs, one row per kernel per rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from overlap_optim.keyed import unwrapped_path
from sharders.embeddingbag import TableDecision, kernels_of

__all__ = ["describe", "kernel_rows"]

_HEADER = ("rank", "module", "kernel", "sharding type", "tables", "optimizer", "runs as", "semantics", "why not fused")


def kernel_rows(model: nn.Module) -> list[tuple[str, ...]]:
    """This rank's rows: one per kernel of every module sharded by our sharders."""
    rank = str(dist.get_rank()) if dist.is_initialized() else "0"
    rows = []
    for path, module in model.named_modules():
        decisions: dict[str, TableDecision] | None = getattr(module, "_overlap_decisions", None)
        if decisions is None:
            continue
        for index, (_, kernel) in enumerate(kernels_of(module)):
            tables = [t.name for t in kernel.config.embedding_tables]
            first = decisions[tables[0]]
            rows.append((
                rank,
                unwrapped_path(path),
                str(index),
                first.sharding_type,
                ", ".join(tables),
                _setting(first),
                _runs_as(first),
                first.semantics,
                first.choice.reason if first.kernel in ("fallback", "user") else "",
            ))
    return rows


def describe(model: nn.Module) -> str:
    """A markdown table of every kernel on every rank: its tables, sharding type,
    optimizer and settings, fused or fallback, its semantics ("lazy": only the
    rows a batch touched change; "dense": every row steps, untouched ones on a
    zero gradient), and for a fallback which setting prevented fusion.

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


def _setting(decision: TableDecision) -> str:
    if decision.group is None:
        return "none"
    kwargs = ", ".join(f"{k}={v!r}" for k, v in decision.group.optimizer_kwargs.items())
    return f"{decision.group.optimizer_class.__name__}({kwargs})"


def _runs_as(decision: TableDecision) -> str:
    if decision.kernel == "user":
        return "dense: .grad handed back to your optimizer"
    if decision.kernel == "fused":
        return f"fused {decision.choice.fbgemm_kwargs['optimizer'].name}"
    if decision.kernel == "data_parallel_hook":
        return "torch.optim after all-reduce (DDP hook)"
    if decision.semantics == "dense":
        return "fallback: torch.optim on the whole table"
    return "fallback: torch.optim on touched rows"
