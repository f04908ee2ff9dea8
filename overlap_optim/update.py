"""Every way an annotated parameter is updated, in one place.

- :func:`step_param`: one parameter, its own ``torch.optim`` step with the
  group's current hyperparameters, then the gradient is released.
- :func:`step_params`: many parameters at once, one foreach or fused update per
  set of compatible settings (virtual parameter groups).
- :class:`RowOptimizer`: the rows of a table that a batch touched (lazy);
  :class:`DenseTableOptimizer`: a whole table, untouched rows on a zero gradient.

State made by ``init_state()`` and never loaded over is a placeholder; the rule
that drops it before the first real update lives in :func:`_real_state`.

Multi-tensor updates: parameters whose optimizer class and non-float settings agree (Adam's amsgrad,
SGD's nesterov, RMSprop's centered, ...) are stepped together, each with its own
float hyperparameters (lr, betas, eps, weight_decay, momentum): foreach ops take
a list of scalars. That gives virtual parameter groups: three learning rates on
300 parameters cost one update, not 300 Python-level steps.

The math is ``torch.optim``'s own: for Adam and AdamW its fused kernel, called
once per distinct set of float hyperparameters (three learning rates, three
calls); for SGD and RMSprop its multi-tensor path, op for op, with scalars made
lists. State lives in each parameter's live optimizer under torch's names,
so checkpoints and ``get_optimizers`` see no difference. Classes or settings
not listed here (and ``foreach``/``fused``/``capturable``/``differentiable``
set by the user) fall back to the parameter's own ``torch.optim`` step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from overlap_optim.annotation import AnnotationGroup

__all__ = [
    "step_param", "step_params", "fused_key", "live_optimizer", "init_placeholder_state", "load_param_state",
    "has_real_state", "drop_placeholder_state",
    "RowOptimizer", "DenseTableOptimizer", "TableOptimizer", "table_optimizer",
]

_Key = tuple[Any, ...]
# The one mark on a parameter whose state init_state() made and nothing was loaded over.
_PLACEHOLDER = "_overlap_placeholder_state"


def fused_key(param: torch.Tensor) -> _Key | None:
    """Parameters with equal keys share one foreach update; None: step alone."""
    group = param._overlap_group
    h = group.param_group
    if any(h.get(flag) for flag in ("foreach", "fused", "capturable", "differentiable")) or param.is_sparse:
        return None
    cls = group.optimizer_class
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return ("adam", bool(h["amsgrad"]), bool(h["maximize"]), bool(h.get("decoupled_weight_decay")) or cls is torch.optim.AdamW)
    if cls is torch.optim.SGD:
        return ("sgd", bool(h["nesterov"]), bool(h["maximize"]), h["momentum"] != 0)
    if cls is torch.optim.RMSprop:
        return ("rmsprop", bool(h["centered"]), bool(h["maximize"]), h["momentum"] > 0)
    return None


def step_params(params: list[torch.Tensor]) -> None:
    """Step every param (each has ``.grad`` set) and release its grad: one foreach
    update per set of compatible settings, the param's own step for the rest."""
    sets: dict[_Key, list[torch.Tensor]] = {}
    checked: set[int] = set()
    for param in params:
        if id(param._overlap_group) not in checked:  # before fused_key reads the fixed settings
            check_live(param)
            checked.add(id(param._overlap_group))
        key = fused_key(param)
        if key is None:
            step_param(param)
        else:
            sets.setdefault(key, []).append(param)
    for key, members in sets.items():
        states = [_state_of(p) for p in members]
        hypers = [p._overlap_group.param_group for p in members]
        grads = [p.grad for p in members]
        with torch.no_grad():
            _UPDATES[key[0]](members, grads, states, hypers, *key[1:])
        for p in members:
            p.grad = None


def _state_of(param: torch.Tensor) -> dict[str, Any]:
    return _real_state(param, live_optimizer(param))


def _step_counts(states: list[dict], params: list[torch.Tensor]) -> list[torch.Tensor]:
    for state in states:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    return steps


def _zeros(states: list[dict], params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    for state, p in zip(states, params):
        if name not in state:
            state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return [s[name] for s in states]


def _adam(params, grads, states, hypers, amsgrad: bool, maximize: bool, decoupled: bool) -> None:
    """torch's fused Adam kernel, one call per distinct set of float hyperparameters."""
    exp_avgs, exp_avg_sqs = _zeros(states, params, "exp_avg"), _zeros(states, params, "exp_avg_sq")
    max_sqs = _zeros(states, params, "max_exp_avg_sq") if amsgrad else []
    steps = _step_counts(states, params)
    floats: dict[tuple[float, ...], list[int]] = {}
    for i, h in enumerate(hypers):
        key = (float(h["lr"]), float(h["betas"][0]), float(h["betas"][1]), float(h["weight_decay"]), float(h["eps"]))
        floats.setdefault(key, []).append(i)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for (lr, beta1, beta2, weight_decay, eps), index in floats.items():
        def pick(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [tensors[i] for i in index] if tensors else []

        kernel(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_sqs), pick(steps),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=amsgrad, maximize=maximize,
        )


def _sgd(params, grads, states, hypers, nesterov: bool, maximize: bool, has_momentum: bool) -> None:
    if maximize:
        grads = torch._foreach_neg(grads)
    wds = [float(h["weight_decay"]) for h in hypers]
    if any(wds):
        grads = torch._foreach_add(grads, torch._foreach_mul(params, wds))
    if has_momentum:
        momenta = [float(h["momentum"]) for h in hypers]
        bufs = []
        for state, grad, h, momentum in zip(states, grads, hypers, momenta):
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = buf = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - float(h["dampening"]))
            bufs.append(buf)
        grads = torch._foreach_add(grads, torch._foreach_mul(bufs, momenta)) if nesterov else bufs
    torch._foreach_add_(params, torch._foreach_mul(grads, [-float(h["lr"]) for h in hypers]))


def _rmsprop(params, grads, states, hypers, centered: bool, maximize: bool, has_momentum: bool) -> None:
    if maximize:
        grads = torch._foreach_neg(grads)
    square_avgs = _zeros(states, params, "square_avg")
    grad_avgs = _zeros(states, params, "grad_avg") if centered else []
    bufs = _zeros(states, params, "momentum_buffer") if has_momentum else []
    _step_counts(states, params)
    wds = [float(h["weight_decay"]) for h in hypers]
    if any(wds):
        grads = torch._foreach_add(grads, torch._foreach_mul(params, wds))
    alphas = [float(h["alpha"]) for h in hypers]
    torch._foreach_mul_(square_avgs, alphas)
    torch._foreach_addcmul_(square_avgs, grads, grads, [1 - a for a in alphas])
    if centered:
        torch._foreach_lerp_(grad_avgs, grads, [1 - a for a in alphas])
        avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, [-1.0] * len(params))
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(square_avgs)
    torch._foreach_add_(avg, [float(h["eps"]) for h in hypers])
    lrs = [-float(h["lr"]) for h in hypers]
    if has_momentum:
        torch._foreach_mul_(bufs, [float(h["momentum"]) for h in hypers])
        torch._foreach_addcdiv_(bufs, grads, avg)
        torch._foreach_add_(params, torch._foreach_mul(bufs, lrs))
    else:
        torch._foreach_addcdiv_(params, grads, avg, lrs)


_UPDATES: dict[str, Callable[..., None]] = {"adam": _adam, "sgd": _sgd, "rmsprop": _rmsprop}


def live_optimizer(param: torch.Tensor) -> torch.optim.Optimizer | None:
    """The param's live optimizer, created on first use; None while on meta."""
    optimizers = getattr(param, "_in_backward_optimizers", None)
    if optimizers:
        return optimizers[0]
    group: AnnotationGroup | None = getattr(param, "_overlap_group", None)
    if group is None or param.is_meta:
        return None
    optimizer = group.optimizer_class([param], **group.optimizer_kwargs)
    param._in_backward_optimizers = [optimizer]
    return optimizer


def step_param(param: torch.Tensor) -> None:
    """Run the param's optimizer on its current grad with the group's current
    hyperparameters, then release the grad."""
    optimizer = live_optimizer(param)
    assert optimizer is not None, "step_param on a parameter without a live optimizer"
    check_live(param)
    _real_state(param, optimizer)
    optimizer.param_groups[0].update(param._overlap_group.hyperparameters())
    optimizer.step()
    param.grad = None


def check_live(param: torch.Tensor) -> None:
    """Refuse a fixed (non-float) setting of ``param``'s group changed since annotation."""
    group = param._overlap_group
    where = f"a parameter of shape {tuple(param.shape)} in param group {group.order} ({group.spec.name})"
    group.spec.check_live(group.param_group, where)


def init_placeholder_state(param: torch.Tensor) -> None:
    """Give ``param`` state to load a checkpoint over, if it has none: a step on a zero
    gradient, with the weight put back. The state is a placeholder: the next update drops
    it unless :func:`load_param_state` replaced it."""
    optimizer = live_optimizer(param)
    if optimizer is None or optimizer.state.get(param):
        return
    kept = param.detach().clone()
    param.grad = torch.zeros_like(param)
    optimizer.param_groups[0].update(param._overlap_group.hyperparameters())
    optimizer.step()
    with torch.no_grad():
        param.copy_(kept)
    param.grad = None
    param.__dict__[_PLACEHOLDER] = True


def has_real_state(param: torch.Tensor) -> bool:
    """Whether ``param`` has optimizer state that is not an :func:`init_placeholder_state` placeholder."""
    optimizer = live_optimizer(param)
    return bool(optimizer is not None and optimizer.state.get(param)) and not param.__dict__.get(
        _PLACEHOLDER, False
    )


def drop_placeholder_state(param: torch.Tensor) -> None:
    """Undo :func:`init_placeholder_state` if nothing was loaded over it."""
    optimizer = live_optimizer(param)
    if optimizer is not None:
        _real_state(param, optimizer)
        if not optimizer.state.get(param):
            optimizer.state.pop(param, None)


def load_param_state(param: torch.Tensor, state: dict[str, Any]) -> None:
    """Replace ``param``'s optimizer state with ``state`` (empty: no state, as before a first step)."""
    optimizer = live_optimizer(param)
    optimizer.state.pop(param, None)
    if state:
        optimizer.state[param] = state
    param.__dict__.pop(_PLACEHOLDER, None)


def _real_state(param: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The param's state, after dropping a placeholder that nothing was loaded over."""
    if param.__dict__.pop(_PLACEHOLDER, False):
        optimizer.state.pop(param, None)
    return optimizer.state[param]


# -- touched rows: The real torch.optim update, applied to the rows of a table that a batch touched.
#
# :class:`RowOptimizer` keeps one table's optimizer state at full size and, each
# step, gathers the touched rows of the weight and of every row-shaped state
# tensor into a small parameter, runs the genuine ``torch.optim`` step on it, and
# scatters the results back. Its cost follows the number of touched rows, not the
# table size.
#
# Semantics (lazy, as FBGEMM's fused kernels and ``torch.optim.SparseAdam``):
#
# - Untouched rows and their row state do not change.
# - Duplicate ids are summed by the caller before one update.
# - State that is not per row (``step`` counters, NAdam's ``mu_product``) is per
#   table and advances at every step, touched rows or not (as FBGEMM's
#   iteration counter and ``SparseAdam`` on an empty gradient do), so every shard
#   of a table holds the same count.
# - When every row is touched at every step, the result is that of dense
#   ``torch.optim`` on the whole table.
# - A row touched for the first time after the table's first step starts from the
#   state the optimizer gives a fresh row after a zero-gradient step on a zero
#   weight (zeros for Adam's moments, ``initial_accumulator_value`` for Adagrad).
#   One visible consequence: SGD with ``dampening != 0`` starts such a row's
#   momentum at ``(1 - dampening) * g`` where torch's first step uses ``g``.


class RowOptimizer:
    """``optimizer_class`` applied lazily to the touched rows of one 2-D table.

    Only for row-separable optimizers (``group.spec.row_separable``).

    Args:
        weight: the table (or this rank's shard of it), ``(rows, dim)``; updated in place.
        group: the table's annotation.
        name: the table's name, for errors.

    Example:
        >>> rows = RowOptimizer(table_weight, table_weight_annotation_group, "t0")
        >>> rows.step(torch.tensor([3, 7]), row_grads)  # row_grads: (2, dim)
    """

    semantics = "lazy"

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str = "?") -> None:
        assert weight.dim() == 2, "a table is 2-D"
        assert group.spec.row_separable, f"{group.spec.name} is not row-separable"
        self.weight, self.group, self.name = weight, group, name
        self.param_group = group.param_group
        # A reusable optimizer whose param and state are swapped in at each step.
        self._placeholder = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self._optimizer = group.optimizer_class([self._placeholder], **group.optimizer_kwargs)
        self._row_keys = group.spec.row_keys()
        self.row_state: dict[str, torch.Tensor] = {}
        self.table_state: dict[str, Any] = {}
        self.placeholder_state = False

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update rows ``ids`` (unique, 1-D, possibly empty) with their summed gradients ``grads``."""
        assert ids.dim() == 1 and grads.shape == (ids.numel(), self.weight.shape[1])
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        if self.placeholder_state:  # made by init_state and never loaded over: start afresh
            self.row_state, self.table_state, self.placeholder_state = {}, {}, False
        rows = self.weight.index_select(0, ids)
        rows.grad = grads.to(rows.dtype)
        first = not self.row_state and not self.table_state
        if first:  # a new optimizer on the rows, so its own state init runs
            optimizer = self.group.optimizer_class([rows], **self.group.optimizer_kwargs)
        else:
            optimizer = self._optimizer
            optimizer.param_groups[0]["params"] = [rows]
            optimizer.state.clear()
            optimizer.state[rows] = self.state_for_rows(ids)
        optimizer.param_groups[0].update(self.group.hyperparameters())
        try:
            optimizer.step()
        finally:
            stepped = optimizer.state.pop(rows, {})
            self._optimizer.param_groups[0]["params"] = [self._placeholder]
        self._check_layout(stepped)
        if first:
            self._allocate()
        self.weight.index_copy_(0, ids, rows)
        for key, value in stepped.items():
            if key in self._row_keys:
                self.row_state[key].index_copy_(0, ids, value)
            else:
                self.table_state[key] = value

    def init_state(self) -> None:
        """Create the state, if there is none yet, so that a checkpoint can be loaded in place.

        It is a step on no rows: no weight changes. The state it makes is a
        placeholder, dropped at the next step unless something is loaded over it.
        """
        if self.state:
            return
        empty = torch.empty(0, dtype=torch.long, device=self.weight.device)
        self.step(empty, self.weight.new_zeros(0, self.weight.shape[1]))
        self.placeholder_state = True

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` if nothing was loaded over it."""
        if self.placeholder_state:
            self.row_state, self.table_state, self.placeholder_state = {}, {}, False

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the state with copies of ``state`` (names and shapes as :attr:`state`)."""
        self.row_state = {k: v.detach().clone() for k, v in state.items() if k in self._row_keys}
        self.table_state = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items() if k not in self._row_keys
        }
        self.placeholder_state = False

    @property
    def state(self) -> dict[str, Any]:
        """The whole table's state under torch.optim's names (empty before the first step)."""
        return {**self.row_state, **self.table_state}

    def state_for_rows(self, ids: torch.Tensor) -> dict[str, Any]:
        """The optimizer state of rows ``ids``, as torch.optim would hold it for them."""
        return {**{k: v.index_select(0, ids) for k, v in self.row_state.items()}, **self.table_state}

    def _check_layout(self, stepped: dict[str, Any]) -> None:
        """A float setting changed at run time can change the state an optimizer keeps (SGD's
        momentum from 0): the rows untouched so far would have no such state. Refuse."""
        known = set(self.group.spec.state or {})
        new = sorted(set(stepped) - known)
        if new:
            raise ValueError(
                f"table {self.name!r}: {self.group.spec.name} now keeps state {new} that it did not keep when "
                f"annotated, after {self.group.spec.changed_floats(self.param_group)} at run time; the rows not "
                "touched so far have none. Annotate the table with that setting from the start"
            )

    def _allocate(self) -> None:
        rows, dim = self.weight.shape
        for key in self._row_keys:
            entry = self.group.spec.state[key]
            shape = (rows, *(dim if size == -1 else size for size in entry.tail))
            self.row_state[key] = torch.full(shape, entry.fresh, dtype=self.weight.dtype, device=self.weight.device)


class DenseTableOptimizer:
    """``optimizer_class`` on the whole of one 2-D table (or shard), every step.

    Dense semantics, as ``torch.optim`` on an ``nn.EmbeddingBag`` with a dense
    gradient: rows the batch did not touch get a zero gradient and are stepped
    too. Exact for any optimizer while the table is whole, and on a shard split
    along an axis the optimizer is separable by. Cost follows the shard size.
    Same interface as :class:`RowOptimizer`.
    """

    semantics = "dense"

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str = "?") -> None:
        assert weight.dim() == 2, "a table is 2-D"
        self.weight, self.group, self.name = weight, group, name
        self.param_group = group.param_group
        self._optimizer = group.optimizer_class([weight], **group.optimizer_kwargs)
        self._row_keys = group.spec.row_keys()
        self.placeholder_state = False

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Step the whole table on the gradient that is ``grads`` at rows ``ids`` (unique) and zero elsewhere."""
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        if self.placeholder_state:
            self._optimizer.state.clear()
            self.placeholder_state = False
        grad = torch.zeros_like(self.weight)
        grad.index_copy_(0, ids, grads.to(grad.dtype))
        self.weight.grad = grad
        self._optimizer.param_groups[0].update(self.group.hyperparameters())
        try:
            self._optimizer.step()
        finally:
            self.weight.grad = None

    def init_state(self) -> None:
        """Create the state if there is none (a placeholder, as :meth:`RowOptimizer.init_state`); weights stay."""
        if self.state:
            return
        kept = self.weight.clone()
        self.step(torch.empty(0, dtype=torch.long, device=self.weight.device), self.weight.new_zeros(0, self.weight.shape[1]))
        self.weight.copy_(kept)
        self.placeholder_state = True

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` if nothing was loaded over it."""
        if self.placeholder_state:
            self._optimizer.state.clear()
            self.placeholder_state = False

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the state with copies of ``state``."""
        self._optimizer.state.clear()
        self._optimizer.state[self.weight] = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        self.placeholder_state = False

    @property
    def state(self) -> dict[str, Any]:
        return dict(self._optimizer.state.get(self.weight, {}))

    @property
    def row_state(self) -> dict[str, torch.Tensor]:
        """Entries that slice by rows (saved as sharded tensors)."""
        return {k: v for k, v in self.state.items() if k in self._row_keys}

    @property
    def table_state(self) -> dict[str, Any]:
        """Every other entry (scalars, per-column and whole-table state), saved as plain values."""
        return {k: v for k, v in self.state.items() if k not in self._row_keys}


TableOptimizer = RowOptimizer | DenseTableOptimizer


def table_optimizer(weight: torch.Tensor, group: AnnotationGroup, name: str, semantics: str) -> TableOptimizer:
    """The optimizer of one table shard: ``semantics`` "lazy" (touched rows) or "dense" (every row)."""
    kinds = {"lazy": RowOptimizer, "dense": DenseTableOptimizer}
    return kinds[semantics](weight, group, name)
