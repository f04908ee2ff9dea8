"""A plain ``load_state_dict`` into our sharded collections keeps each table's dtype.

TorchRec's sharded collections copy each incoming table weight into the held one with ``copy_``,
which casts: an FP32 state dict loads into an FP16 table, rounded, without a word. Ours refuses
it instead, as :func:`overlap_optim.checkpoint.load` does (one rule,
:func:`overlap_optim.checkpoint.refuse_other_dtypes`): a ``load_state_dict`` pre-hook, run before
TorchRec's, compares each incoming table weight (a tensor, or a ``ShardedTensor``: its metadata's
dtype and its local shards') with the weight the module holds and raises before anything is
copied, naming each weight with both dtypes. The ranks of the module's process group gather
their findings first (a local shard's dtype is the rank's own), so every rank raises the same
error; ``load_state_dict`` of a sharded model is called on every rank.

Under ``DistributedModelParallel`` the model's root gets the same check, for every sharded
collection under it: DMP loads module by module, and a dense layer loaded before a refused
collection would be changed.

The cast, when wanted, is the user's, on the state dict itself: ``value.to(torch.float16)``
(a ``ShardedTensor`` too), rounding once to nearest even, or
``overlap_optim.checkpoint.load(..., cast=True)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from overlap_optim.checkpoint import refuse_other_dtypes
from overlap_optim.plans import plan_of
from overlap_optim.record import module_record
from sharders import _private
from sharders.plan import ShardedModulePlan

__all__ = ["install_dtype_check"]


def install_dtype_check(sharded: nn.Module, root: nn.Module | None) -> None:
    """Make ``load_state_dict`` of ``sharded``, and of ``root``, refuse table weights of another
    dtype (see the module doc).

    Args:
        sharded: our sharded EBC or EC, its plan installed (where its tables sit, its process group).
        root: the model DMP is sharding (None: no DMP is).
    """
    _private.run_first_on_load(sharded, _check)
    if root is not None and root is not sharded and not module_record(root).checks_load_dtypes:
        module_record(root).checks_load_dtypes = True
        _private.run_first_on_load(root, _check)


def _check(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """The pre-hook: every sharded collection under ``module`` (itself included), in one check."""
    held, group = {}, None
    for path, sharded in module.named_modules(prefix=prefix.rstrip(".")):
        plan = plan_of(sharded)
        if isinstance(plan, ShardedModulePlan):
            group = plan.state.process_group
            start = f"{path}.{plan.state.tables_attr}." if path else f"{plan.state.tables_attr}."
            held.update({f"{start}{t}.weight": w for t, w in _private.sharded_weights(sharded).items()})
    dtypes = sorted({str(w.dtype) for w in held.values()})
    target = dtypes[0] if len(dtypes) == 1 else "the dtype the model holds"
    refuse_other_dtypes(
        state_dict, held, "the state dict",
        f"to load them cast once (to nearest even), cast the state dict's tensors yourself (value.to({target}), "
        "a ShardedTensor too) or load with overlap_optim.checkpoint.load(..., cast=True)", group=group,
    )
