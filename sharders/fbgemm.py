"""The fused kind: FBGEMM's TBE runs the update; its state names, its step count, its live settings.

Which settings FBGEMM computes exactly, and their translation, are FBGEMM's
rules (:data:`RULES`, :func:`choose_kernel`), here with FBGEMM's other names; the
decision table (:mod:`sharders.optimizer_table`) asks them. A reader who wants
to know "why did table t3 not fuse?" finds the answer in :data:`RULES`.
This module also keeps a fused kernel in step with its annotation group while
it trains:

- before every forward, the group's live settings are checked against the same
  rule again and pushed into the kernel (``learning_rate``, ``eps``), so a
  scheduler, a user or ``load_state_dict`` reaches the very next backward. A
  change FBGEMM cannot compute (weight decay on Adagrad, momentum on SGD, a
  non-float setting) is refused there, naming the table and the setting;
- FBGEMM keeps no step count for Adagrad: each fused kernel counts the backward
  passes that reached it, which is torch.optim's ``step``;
- :data:`FUSED_ROW_STATE` names FBGEMM's per-row state as torch.optim does;
- FBGEMM's backward runs when :mod:`sharders.fused_backward` decides: at once,
  at the end of backward for a table clipped by norm, or at the last micro-batch
  of a ``no_step`` window.

TorchRec applies a fused kernel's LR only in ``fused_optimizer.step()``, after
backward: a schedule would reach the kernel one step late. Kernels are called
the same way under DMP and TorchRec's train pipelines, so their own forward
pre-hook is the one place that sees every step in time.

Facts behind the rules (measured on torch 2.13 / fbgemm-gpu-cpu 1.8, see
``shared/FBGEMM_NOTES.md``):

- EXACT_SGD is ``w -= lr*g``: no momentum, no weight decay.
- EXACT_ADAGRAD is ``s += g*g; w -= lr*g/(sqrt(s)+eps)``: no lr_decay, no
  weight decay, the accumulator starts at 0. torch's eps default is 1e-10,
  FBGEMM's 1e-8, so eps is always passed explicitly.
- EXACT_ROWWISE_ADAGRAD is torchrec's ``RowWiseAdagrad``; on CPU FBGEMM drops
  weight decay for fp32 tables, so weight decay there goes to the fallback.
- On CPU FBGEMM fuses nothing else (Adam asserts).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.spec import AnnotationGroup, describe_optimizer, needs_closure
from sharders import fused_rows
from sharders.fused_backward import HeldBackward
from sharders.kernels import DTYPE_NAMES, BuildContext, KernelChoice, KernelKind, LocalShard, TableKernel

__all__ = [
    "RULES", "VARIABLE_BATCH_OPTIMIZERS", "choose_kernel", "FUSED_ROW_STATE", "FusedTable", "FusedShardState",
    "live_choice",
]


def _unsupported(s: dict[str, Any], **neutral: Any) -> str:
    """The first setting whose value is not the neutral one FBGEMM assumes."""
    for name, value in neutral.items():
        if name in s and s[name] != value:
            return f"{name}={s[name]!r}"
    return ""


def _sgd(s: dict[str, Any], device: str) -> KernelChoice:
    bad = _unsupported(s, momentum=0, weight_decay=0, nesterov=False, maximize=False)
    if bad:
        return KernelChoice(False, reason=f"{bad}: FBGEMM's EXACT_SGD has no momentum, weight decay or maximize")
    return KernelChoice(True, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": float(s["lr"])})


def _adagrad(s: dict[str, Any], device: str) -> KernelChoice:
    bad = _unsupported(s, lr_decay=0, weight_decay=0, initial_accumulator_value=0, maximize=False)
    if bad:
        return KernelChoice(
            False,
            reason=f"{bad}: FBGEMM's EXACT_ADAGRAD has no lr_decay, weight decay, initial accumulator or maximize",
        )
    kwargs = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": float(s["lr"]), "eps": float(s["eps"])}
    return KernelChoice(True, kwargs)


def _rowwise_adagrad(s: dict[str, Any], device: str) -> KernelChoice:
    bad = _unsupported(s, lr_decay=0, initial_accumulator_value=0, maximize=False)
    if bad:
        return KernelChoice(
            False, reason=f"{bad}: FBGEMM's EXACT_ROWWISE_ADAGRAD has no lr_decay, initial accumulator or maximize"
        )
    if s["weight_decay"] != 0:
        why = "FBGEMM's CPU kernel ignores it for fp32 tables" if device == "cpu" else "not verified on CUDA here"
        return KernelChoice(False, reason=f"weight_decay={s['weight_decay']!r}: {why}")
    kwargs = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": float(s["lr"]),
        "eps": float(s["eps"]),
    }
    return KernelChoice(True, kwargs)


# The fused kernels FBGEMM runs with a variable batch size per feature (VBE): its TBE asserts it.
VARIABLE_BATCH_OPTIMIZERS = frozenset({EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD})


_Rule = Callable[[dict[str, Any], str], KernelChoice]

# device type -> optimizer class -> rule. A class missing here goes to the fallback.
RULES: dict[str, dict[type[torch.optim.Optimizer], _Rule]] = {
    "cpu": {torch.optim.SGD: _sgd, torch.optim.Adagrad: _adagrad, RowWiseAdagrad: _rowwise_adagrad},
    # CUDA keeps to the rules verified on CPU: FBGEMM's CUDA Adam counts steps per
    # kernel and its decoupled decay is unverified here, so Adam stays in the fallback.
    "cuda": {torch.optim.SGD: _sgd, torch.optim.Adagrad: _adagrad, RowWiseAdagrad: _rowwise_adagrad},
}


def choose_kernel(
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    device_type: str,
    *,
    table: str = "?",
    settings: dict[str, Any] | None = None,
) -> KernelChoice:
    """Decide where ``table``'s update runs on ``device_type``.

    ``settings``: the complete current settings (a live param group); by
    default the kwargs completed with the class defaults. The fused kernel of a
    table re-runs this rule on its live param group before every forward, so a
    setting changed at run time either reaches FBGEMM translated or is refused.

    Raises:
        ValueError: the device type is unknown, or the optimizer cannot run in
            backward at all (it needs a closure); the message names the table.
    """
    if device_type not in RULES:
        raise ValueError(f"table {table!r}: no optimizer rules for device type {device_type!r}; known: {sorted(RULES)}")
    if needs_closure(optimizer_class):
        raise ValueError(
            f"table {table!r}: {optimizer_class.__name__} needs a closure in step() and cannot run in backward"
        )
    rule = RULES[device_type].get(optimizer_class)
    if rule is None:
        return KernelChoice(False, reason=f"{optimizer_class.__name__}: FBGEMM has no kernel verified exact on {device_type}")
    if settings is None:
        settings = describe_optimizer(optimizer_class, optimizer_kwargs).defaults
    return rule(settings, device_type)


# Why a low-precision table does not fuse (FBGEMM_NOTES.md, fbgemm-gpu-cpu 1.8.0).
_NOT_FUSED_LOW_PRECISION = (
    "FBGEMM's CPU TBE rounds the update to FP16 before adding it (two roundings a step) and has no BF16 kernels; "
    "an FP16 table fuses only where our compiled backward steps it (CPU, the extension built)"
)

# Per-row state of each fused kernel type: torch.optim name -> row-wise (one value per row)?
FUSED_ROW_STATE = {
    EmbOptimType.EXACT_SGD: {},
    EmbOptimType.EXACT_ADAGRAD: {"sum": False},
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: {"sum": True},
}


class FusedTable(TableKernel):
    """A table whose update FBGEMM's fused TBE kernel computes exactly (lazy semantics)."""

    kind = KernelKind.FUSED
    semantics = "lazy"
    family = "fused"
    compute_kernel = "fused"
    # FBGEMM computes the same exact update with the table in HBM, in UVM, or cached in HBM (CUDA).
    plan_kernels = frozenset({"fused", "fused_uvm", "fused_uvm_caching"})
    # FP16 only where our compiled backward steps it, in float32, rounded once (sharders.fused_rows):
    # the table's choice keeps any other FP16 table out of the fused kernel.
    precisions = frozenset({torch.float32, torch.float16})

    @staticmethod
    def keeps(choice: KernelChoice, *, device_type: str, sharding_type: str, shard_sizes: list[list[int]],
              group: AnnotationGroup, dtype: torch.dtype, cross_shard: bool) -> KernelChoice:
        """``choice`` (fused), or the fallback's, with the reason, where FBGEMM would not be exact
        on this table: a shard with no rows on CPU, low-precision state, a low-precision weight
        that FBGEMM would round twice (an FP16 one fuses where our compiled backward steps it in
        float32 and rounds once: :func:`sharders.fused_rows.applies`), or a table split across an
        axis its optimizer's statistic spans."""
        if device_type == "cpu" and any(0 in size for size in shard_sizes):
            return KernelChoice(False, reason="a shard with no rows: FBGEMM's CPU kernel cannot hold an empty table")
        if group.state_dtype is not None:
            return KernelChoice(False, reason=f"state_dtype={group.state_dtype}: FBGEMM keeps low-precision "
                                "state on CUDA only (optimizer_state_dtypes); the fallback keeps it exactly")
        if dtype != torch.float32 and not fused_rows.applies(choice.fbgemm_kwargs["optimizer"], device_type, dtype):
            return KernelChoice(False, reason=f"{DTYPE_NAMES.get(dtype, dtype)} weights: {_NOT_FUSED_LOW_PRECISION}; "
                                              "the fallback rounds once")
        if cross_shard:  # FBGEMM would step each shard on its own statistics
            return KernelChoice(False, reason=f"{sharding_type}: FBGEMM would keep a statistic per shard, where "
                                              "the whole table has one; the fallback carries it across shards")
        return choice

    def kernel_for(self, planned: str) -> str | None:
        return planned if planned in self.plan_kernels else self.compute_kernel

    def batch_key(self) -> Hashable:
        # A fused TBE has one learning rate: one kernel per annotation group (its LR schedule),
        # and one clipping set.
        return (self.kind, id(self.group), id(self.clip))

    def fbgemm_kwargs(self) -> dict[str, Any]:
        return dict(self.decision.choice.fbgemm_kwargs)

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        names = [t.table for t in tables]
        fused = _FusedKernel(kernel, names, tables[0].group, context.device_type)
        compiled = fused_rows.CompiledBackward(kernel.emb_module) if tables[0].compiled_backward() else None
        HeldBackward(kernel.emb_module, names, tables[0].clip, context.sharded, fused.count, compiled)
        for index, (table, config) in enumerate(zip(tables, kernel.config.embedding_tables)):
            table.shards.append(LocalShard(config.local_metadata, FusedShardState(fused, index, table.state_layout())))

    def check_live(self) -> None:
        live_choice(self.group, [self.table], self.decision.device_type)

    def why_no_variable_batch(self) -> str | None:
        optimizer = self.decision.choice.fbgemm_kwargs["optimizer"]
        if optimizer not in VARIABLE_BATCH_OPTIMIZERS:
            return f"FBGEMM's {optimizer.name} kernel has no variable-batch backward"
        if self.clip is not None:
            return "it is clipped, and FBGEMM's variable-batch backward cannot be held for the norm"
        if self.decision.dtype != torch.float32:
            return "its weights are FP16, and FBGEMM's variable-batch backward rounds the update twice"
        return None

    def state_layout(self) -> dict[str, str]:
        rowwise = FUSED_ROW_STATE[self.decision.choice.fbgemm_kwargs["optimizer"]]
        return {name: "row" if row else "element" for name, row in rowwise.items()}

    def scalar_names(self) -> list[str]:
        return ["step"] if self.state_layout() else []

    def state_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        # FBGEMM keeps its momentum in fp32 whatever the weights' dtype, row-wise ones as (rows,).
        rows, cols = shard_shape
        return sum(rows * (1 if layout == "row" else cols) * 4 for layout in self.state_layout().values())

    def compiled_backward(self) -> bool:
        """Whether the backward runs in our compiled pass (:mod:`sharders.fused_rows`), not FBGEMM's."""
        return fused_rows.applies(self.decision.choice.fbgemm_kwargs["optimizer"], self.decision.device_type)

    def runs_as(self) -> str:
        name = self.decision.choice.fbgemm_kwargs["optimizer"].name
        return f"fused {name}" + (", compiled backward" if self.compiled_backward() else "")

    def why_not_fused(self) -> str:
        return ""


# FBGEMM's buffers of optimizer state (``split_optimizer_states`` views them): per state, where it is placed.
_STATE_BUFFERS = tuple(f"{state}_{where}" for state in ("momentum1", "momentum2", "prev_iter", "row_counter")
                       for where in ("dev", "host", "uvm"))


class _FusedKernel:
    """One fused TBE kernel of ours: its tables, their group, and its step count. Its forward
    pre-hook keeps FBGEMM's settings live; :mod:`sharders.fused_backward` counts its updates."""

    def __init__(self, kernel: nn.Module, tables: list[str], group: AnnotationGroup, device_type: str) -> None:
        self.emb, self.tables, self.group, self.device_type = kernel.emb_module, tables, group, device_type
        self.steps = 0
        self._split: tuple[tuple, list[list[torch.Tensor]]] | None = None  # (the buffers, split_states())
        # the buffers that hold state: FBGEMM keeps stand-ins of 0 or 1 element for the placements and
        # states it does not use (momentum1, every optimizer's first, is kept whatever its size)
        self._buffer_names = [n for n in _STATE_BUFFERS if isinstance(getattr(self.emb, n, None), torch.Tensor)
                              and (n.startswith("momentum1") or getattr(self.emb, n).numel() > 1)]
        kernel.register_forward_pre_hook(lambda _kernel, _inputs: self.sync_live_settings())

    def sync_live_settings(self) -> None:
        """Push the group's current settings into the kernel, or refuse those FBGEMM cannot compute."""
        choice = live_choice(self.group, self.tables, self.device_type)
        self.emb.set_learning_rate(choice.fbgemm_kwargs["learning_rate"])
        eps = choice.fbgemm_kwargs.get("eps")
        if eps is not None and self.emb.optimizer_args.eps != eps:
            self.emb.update_hyper_parameters({"eps": eps})

    def count(self) -> None:
        """FBGEMM ran one update of the kernel's tables."""
        self.steps += 1

    def split_states(self) -> list[list[torch.Tensor]]:
        """FBGEMM's ``split_optimizer_states()``: each table's state, as views of the kernel's buffers.
        Split once for each set of buffers, not once per table (each split views every table of the
        kernel: split per table, a state dict would be quadratic in the kernel's tables). A load writes the
        buffers in place, which the views see; buffers replaced are split again."""
        buffers = tuple((id(t), t.data_ptr()) for t in (getattr(self.emb, n) for n in self._buffer_names))
        if self._split is None or self._split[0] != buffers:
            self._split = (buffers, self.emb.split_optimizer_states())
        return self._split[1]


class FusedShardState:
    """One table shard's state inside a fused kernel, as torch.optim names it (a
    :class:`sharders.kernels.ShardState`). FBGEMM allocates it with the kernel, so it always
    exists: there is no placeholder to make or drop."""

    placeholder_state = False
    views_kept_buffers = True  # its state is views of FBGEMM's buffers, kept for the kernel's life

    def __init__(self, kernel: _FusedKernel, index: int, layout: dict[str, str]) -> None:
        self._kernel, self._index, self._layout = kernel, index, layout

    @property
    def row_state(self) -> dict[str, torch.Tensor]:
        if not self._layout:  # EXACT_SGD keeps none
            return {}
        states = self._kernel.split_states()[self._index]
        return {name: (t.view(-1, 1) if layout == "row" else t) for (name, layout), t in zip(self._layout.items(), states)}

    @property
    def table_state(self) -> dict[str, Any]:
        return {"step": torch.tensor(float(self._kernel.steps))} if self._layout else {}

    @property
    def state(self) -> dict[str, Any]:
        return {**self.row_state, **self.table_state}

    def holds_state(self) -> bool:
        return bool(self._layout)  # EXACT_SGD keeps none

    def has_real_state(self) -> bool:
        return bool(self._layout) and self._kernel.steps > 0

    def init_state(self) -> None:
        """Nothing to make: FBGEMM's state exists from the start."""

    def drop_placeholder_state(self) -> None:
        """Nothing to drop."""

    def placeholder_written(self) -> bool:
        """Never: FBGEMM's state is real, and a ``dcp.load`` in place fills it for good."""
        return False

    def restore_point(self) -> Callable[[], None]:
        """A function that puts the state back as it is now: :meth:`load_state` writes FBGEMM's
        buffers in place, so this holds a copy of them."""
        rows = {name: t.clone() for name, t in self.row_state.items()}
        steps = self._kernel.steps

        def restore() -> None:
            for name, target in self.row_state.items():
                target.copy_(rows[name])
            self._kernel.steps = steps
        return restore

    def load_state(self, state: dict[str, Any]) -> None:
        for name, target in self.row_state.items():
            target.copy_(state[name].view_as(target))
        if "step" in state:
            self._kernel.steps = int(float(state["step"]))


def live_choice(group: AnnotationGroup, tables: list[str], device_type: str) -> KernelChoice:
    """FBGEMM's translation of the group's current settings; ValueError, naming ``tables`` and
    the setting, if a change made at run time is one FBGEMM cannot compute."""
    where = f"fused table(s) {tables}"
    group.spec.check_live(group.param_group, where)
    choice = choose_kernel(
        group.optimizer_class, group.optimizer_kwargs, device_type, table=tables[0], settings=group.param_group
    )
    if not choice.fused:
        raise ValueError(
            f"{where}: {choice.reason}. It was changed at run time ({group.spec.changed_floats(group.param_group)}), "
            "and the fused FBGEMM kernel cannot apply it exactly. Annotate the table with that setting from "
            "the start, or run it in the fallback: EmbeddingBagCollectionSharder(fallback_tables=[...])"
        )
    return choice
