"""Settings changed at run time are refused on every rank alike, not only where the table lives.

A fused kernel refuses a setting FBGEMM cannot compute (weight decay on
Adagrad, say) in its own forward pre-hook (:mod:`sharders.fbgemm`), and a
fallback table refuses a changed non-float setting when it steps. Only a rank
that holds the table runs those. On a table_wise table the other ranks would go
on to the next collective and wait there for a peer that has raised.

So every rank also checks every annotated fused and fallback table of a sharded
module, wherever it lives, at the start of the module's first lookup. Every
rank runs that lookup at every step, after the input all-to-all and before any
other collective of the step, and every rank reads the same param groups (a
scheduler or a user changes them on all ranks). So they all raise the same
error at the same point, and none is left waiting.

Data-parallel tables are left to the DDP hook, which every rank runs anyway. A
refusal that only a step can show (SGD's momentum raised from 0 on a fallback
table: new state that the untouched rows lack) is still raised where the table
steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from overlap_optim.spec import AnnotationGroup
from sharders.fbgemm import live_choice

if TYPE_CHECKING:
    from sharders.embeddingbag import TableDecision

__all__ = ["install_settings_check"]


def install_settings_check(
    sharded: ShardedEmbeddingBagCollection, decisions: dict[str, TableDecision], device_type: str
) -> None:
    """Check every fused and fallback table's live settings before ``sharded``'s first lookup, on every rank."""
    fused: dict[int, tuple[AnnotationGroup, list[str]]] = {}
    fallback: list[tuple[str, AnnotationGroup]] = []
    for name, decision in decisions.items():
        if decision.kernel == "fused":
            fused.setdefault(id(decision.group), (decision.group, []))[1].append(name)
        elif decision.kernel == "fallback":
            fallback.append((name, decision.group))
    if not sharded._lookups or not (fused or fallback):
        return

    def check(_lookup: Any, _inputs: Any) -> None:
        for group, tables in fused.values():
            live_choice(group, tables, device_type)
        for name, group in fallback:
            group.spec.check_live(group.param_group, f"table {name!r}")

    sharded._lookups[0].register_forward_pre_hook(check)
