"""A table kind that only the tests define, with per-row optimizer state: torch.optim on the rows a
batch touched, built from the fallback's parts (``FallbackTable``, ``RowOptimizer``), so that its
updates take the gradient path (clipping, the ``no_step`` window) as every kernel's do.

It shows what a new kind with state costs: this module and one registry line in the sharder's
``kinds=`` (:func:`row_state_kind`). Nothing in the library names it, and it holds no window code.

Also the rank body of ``tests/test_new_kind.py``'s row-state cases (spawned; not collected by pytest).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

import overlap_optim
import sharders
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from _sharded_parity import compare, shard_like_reference
from overlap_optim.table_optimizer import RowOptimizer, TableOptimizer
from sharders.fallback import FallbackTable
from sharders.kernels import BuildContext
from sharders.kinds import Kind


class RowStateTable(FallbackTable):
    """torch.optim on the touched rows of its tables, each row's state its own."""

    kind = "kind_with_rows"
    semantics = "lazy"

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        return RowOptimizer(weight, self.group, self.table)

    def runs_as(self) -> str:
        return "kind_with_rows: torch.optim on the touched rows (a test-only kind)"


def row_state_kind(table: str = "mine") -> Kind:
    """The kind's registry line: the annotated table ``table`` runs as a :class:`RowStateTable`."""
    return Kind(RowStateTable, lambda t: t.table == table and t.spec is not None)


NAMES = ["mine", "fused"]
# Adagrad with an initial accumulator: the fallback's lazy kind would run it, were this kind not first.
SETTINGS = {"mine": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": 0.1}),
            "fused": (torch.optim.SGD, {"lr": 0.1})}


def _sharded(world_size: int, sharding_type: str, reference: torch.nn.Module, bound: float) -> Any:
    """A model like ``reference``, annotated, clipped by norm over both tables, under DMP with the kind."""
    model = copy.deepcopy(reference)
    for name, (cls, kwargs) in SETTINGS.items():
        overlap_optim.apply_optimizer_in_backward(cls, [model.tables[name].weight], kwargs)
    overlap_optim.apply_gradient_clipping([model.tables[n].weight for n in NAMES], max_norm=bound)
    sharder = sharders.EmbeddingBagCollectionSharder(kinds=[row_state_kind()])
    return shard_like_reference(model, reference, NAMES, dict.fromkeys(NAMES, sharding_type), world_size, sharder)


def clipped_windows_and_a_checkpoint(rank: int, world_size: int, sharding_type: str, steps: int = 4,
                                     micro: int = 2) -> dict:
    """Train ``steps`` steps of ``micro`` micro-batches (all but the last inside ``no_step``; the
    later ones touch a few rows), every table in one clipping set by norm, and reload the model and
    its optimizer into a fresh model half-way; compared with one process on the global batch
    (torch's ``clip_grad_norm_``, then torch.optim) after every step."""

    def parts(step: int, m: int) -> list:
        return [covering_batch(NAMES, torch.Generator().manual_seed(100 * step + 10 * m + r), cover=m == 0)
                for r in range(world_size)]

    reference = ManyTableModel(NAMES, seed=5)
    start = {n: reference.tables[n].weight.detach().clone() for n in NAMES}
    probe = copy.deepcopy(reference)
    loss_of(probe, concat_batches(parts(0, 0))).backward()
    bound = 0.3 * torch.nn.utils.get_total_norm([probe.tables[n].weight.grad for n in NAMES]).item()
    ref_opts = [cls([reference.tables[n].weight], **kw) for n, (cls, kw) in SETTINGS.items()]
    dmp = _sharded(world_size, sharding_type, reference, bound)
    for step in range(steps):
        if step == steps // 2:  # a checkpoint, in memory: the model and its optimizer, into a fresh model
            model_state, optimizer_state = dmp.state_dict(), overlap_optim.get_optimizers(dmp).state_dict()
            dmp = _sharded(world_size, sharding_type, ManyTableModel(NAMES, seed=6), bound)
            dmp.load_state_dict(model_state)
            overlap_optim.get_optimizers(dmp).load_state_dict(optimizer_state)
        for m in range(micro):
            with overlap_optim.no_step(dmp) if m < micro - 1 else contextlib.nullcontext():
                (loss_of(dmp, parts(step, m)[rank]) / micro).backward()
        overlap_optim.get_optimizers(dmp).step()
        for m in range(micro):
            (loss_of(reference, concat_batches(parts(step, m))) / micro).backward()
        torch.nn.utils.clip_grad_norm_([reference.tables[n].weight for n in NAMES], bound)
        for optimizer in ref_opts:
            optimizer.step()
        reference.zero_grad()
        compare(dmp, reference, NAMES, step, atol=2e-6)
    tables = sharders.plan_of(dmp.module.ebc).tables
    return {
        "kinds": {n: str(t.kind) for n, t in tables.items()},
        "moved": {n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in NAMES},
        "state": sorted(overlap_optim.get_optimizers(dmp).state_dict()["state"]),
    }
