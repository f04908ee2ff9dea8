"""The optimizer model: what overlap-optim knows about one annotation's optimizer, derived once.

Every decision about an annotated optimizer reads one :class:`OptimizerSpec`,
made when the parameters are annotated, by running the optimizer itself on
small stand-ins (probes), never by a list of known classes. So a third-party
``torch.optim.Optimizer`` subclass is modelled the same way as torch's own:

- ``defaults``: the constructor's settings, completed with the class defaults;
- ``float_keys``: the settings that are numbers (lr, betas, eps, momentum, ...),
  which a scheduler, a user or ``load_state_dict`` may change at run time;
  every other setting (amsgrad, nesterov, maximize, foreach, ...) is fixed
  once annotated, and :meth:`OptimizerSpec.check_live` refuses a change;
- ``state``: the state a 2-D parameter gets, one :class:`StateEntry` per name,
  with its layout: per ``element``, per ``row``, per ``column``, one
  ``scalar`` per tensor, or another ``tensor`` shape;
- ``row_separable`` / ``column_separable``: whether stepping a matrix in row
  (column) pieces, each with its own optimizer, gives the whole-matrix result.
  Probed by three steps on a random matrix, whole and in two pieces;
  ``vector_separable`` likewise on a vector (GaLore projects matrices only);
- ``group_state``: anything ``step()`` writes into its param group
  (pytorch-optimizer's LAMB, LARS and GaLore count steps there). It is kept per
  tensor, in the tensor's state under the same name (:meth:`OptimizerSpec.step`
  moves it in and out of the group), so it is checkpointed and resharded as the
  rest of the state is, and a table's copy never lags;
- ``group_options``: settings the optimizer reads from its param group and not
  from its constructor (GaLore's ``rank``, ``update_proj_gap``...), set on the
  group of every optimizer :meth:`OptimizerSpec.make` builds;
- ``share_key``: groups with equal keys differ only in floats and may share
  one update.

:class:`AnnotationGroup` is one ``apply_optimizer_in_backward`` call: its spec
and its live param group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AnnotationGroup", "OptimizerSpec", "StateEntry", "describe_optimizer", "needs_closure", "settings_of"]

# The 2-D probe: distinct sizes, so a state tensor's shape says what it follows; even, to split in two.
_ROWS, _COLS = 6, 4
_PROBE_STEPS = 3
_STAND_IN_SIZES = (17, 19, 23, 29, 31, 37, 41, 43)
_EXACT_STAND_IN = 1 << 16  # elements: up to this, state shapes are probed on the real shape


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One state entry of a 2-D parameter ``(rows, cols)``.

    Attributes:
        layout: "element" ``(rows, cols)``, "row" ``(rows, 1)`` or ``(rows,)``,
            "column" ``(1, cols)`` or ``(cols,)``, "scalar" (a 0-d tensor or a
            plain value) or "tensor" (any other shape).
        tail: the shape after the row dimension, for "element" and "row"
            entries; ``-1`` stands for ``cols``.
        fresh: what one element holds after a step on a zero gradient at a
            zero weight (the state of a row that was never touched).
    """

    layout: str
    tail: tuple[int, ...] = ()
    fresh: Any = None

    @property
    def row_sliceable(self) -> bool:
        """A ``(rows, cols)`` or ``(rows, 1)`` tensor: slices by rows, saved as a sharded tensor."""
        return self.layout == "element" or (self.layout == "row" and self.tail == (1,))


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """What one optimizer class with one set of kwargs is; see the module doc. Build with :func:`describe_optimizer`."""

    optimizer_class: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    defaults: dict[str, Any]
    float_keys: frozenset[str]
    fixed: dict[str, Any]
    state: dict[str, StateEntry] | None  # None: it cannot step a 2-D parameter
    group_state: tuple[str, ...]
    group_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def row_separable(self) -> bool:
        """See the module doc. Probed when first asked (a sharder splitting a table, FSDP2), not at
        annotation: most annotations never need it, and the probe steps the optimizer 36 times."""
        return self.state is not None and _separable(self.optimizer_class, self.kwargs, self.group_options, 0) and all(
            e.row_sliceable or e.layout == "scalar" for e in self.state.values())

    @functools.cached_property
    def column_separable(self) -> bool:
        """As :attr:`row_separable`, along columns."""
        layouts = {e.layout for e in (self.state or {}).values()}
        return (self.state is not None and _separable(self.optimizer_class, self.kwargs, self.group_options, 1)
                and layouts <= {"element", "scalar"})

    @functools.cached_property
    def vector_separable(self) -> bool:
        """As :attr:`row_separable`, for a vector split in pieces: an optimizer can be element-wise on
        a vector and not on a matrix (GaLore projects matrices only; on a vector it is Adam)."""
        return _vector_separable(self.optimizer_class, self.kwargs, self.group_options)

    @property
    def name(self) -> str:
        return self.optimizer_class.__name__

    @functools.cached_property
    def share_key(self) -> tuple[Any, ...]:
        """Equal for specs that differ only in float settings (computed once: the spec is frozen)."""
        return (self.optimizer_class, tuple(sorted((k, repr(v)) for k, v in self.fixed.items())))

    def make(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """A live optimizer over ``params``: the class with the annotation's kwargs and group
        options. Every optimizer this library steps is made here."""
        return _make(self.optimizer_class, self.kwargs, self.group_options, params)

    def step(self, optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> None:
        """``optimizer.step()`` for ``tensor``, its only parameter, with the group state kept in
        ``optimizer.state[tensor]``: moved into the param group before, back after. Every step
        this library takes goes through here."""
        group, state = optimizer.param_groups[0], optimizer.state[tensor]
        for key in self.group_state:
            if key in state:
                group[key] = state[key]
            else:  # no state yet: the optimizer starts its count afresh
                group.pop(key, None)
        optimizer.step()
        state = optimizer.state[tensor]
        for key in self.group_state:
            if key in group:
                state[key] = group[key]

    def row_keys(self) -> set[str]:
        """State names that slice by rows (per element, or ``(rows, 1)``)."""
        return {name for name, entry in (self.state or {}).items() if entry.row_sliceable}

    def changed_floats(self, param_group: dict[str, Any]) -> list[str]:
        """``"key: old -> new"`` for each float setting that differs from the annotation."""
        return [
            f"{k}: {self.defaults[k]!r} -> {param_group[k]!r}"
            for k in sorted(self.float_keys)
            if k in param_group and not _same(param_group[k], self.defaults[k])
        ]

    def check_live(self, param_group: dict[str, Any], where: str | Callable[[], str]) -> None:
        """Raise ValueError, naming ``where`` (or what ``where()`` returns: made only for the error)
        and the key, if a fixed setting changed at run time."""
        for key, value in self.fixed.items():
            now = param_group.get(key, value)
            if not _same(now, value):
                raise ValueError(
                    f"{where() if callable(where) else where}: {self.name}'s setting {key}={now!r} was changed "
                    f"at run time (annotated with "
                    f"{value!r}); only its float settings {sorted(self.float_keys)} may change once annotated. "
                    f"Annotate with {key}={now!r} from the start (apply_optimizer_in_backward(..., replace=True))"
                )

    def state_shapes(self, shape: torch.Size | tuple[int, ...]) -> dict[str, Any]:
        """``name -> shape tuple`` (tensors) or the plain value, for a parameter of ``shape``."""
        # Distinct sizes, so a state size names its dimension, ordered as the real ones are (a
        # low-rank projection, GaLore's, picks its side by which dimension is larger) and above
        # the small sizes settings use (ranks).
        order = sorted(range(len(shape)), key=lambda d: (shape[d], d))
        sizes = [0] * len(shape)
        for rank, d in enumerate(order):
            sizes[d] = _STAND_IN_SIZES[rank]
        sizes = tuple(shape) if math.prod(shape) <= _EXACT_STAND_IN else tuple(sizes)
        stand_in = torch.ones(sizes, requires_grad=True)
        stand_in.grad = torch.ones_like(stand_in)
        optimizer = self.make([stand_in])
        self.step(optimizer, stand_in)
        dim_of = {size: i for i, size in enumerate(sizes)}
        return {
            name: tuple(shape[dim_of[s]] if s in dim_of else s for s in value.shape)
            if isinstance(value, torch.Tensor)
            else value
            for name, value in optimizer.state[stand_in].items()
        }


def settings_of(param_group: dict[str, Any]) -> tuple:
    """A param group's settings as plain values (a tensor setting by its values), to tell cheaply
    whether any changed since they last passed :meth:`OptimizerSpec.check_live`."""
    return tuple((k, v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in param_group.items() if k != "params")


class AnnotationGroup:
    """The parameters of one ``apply_optimizer_in_backward`` call.

    It holds the optimizer's :class:`OptimizerSpec` and the hyperparameters the
    call asked for, completed with the optimizer's defaults, as one torch-style
    ``param_group`` dict. That dict is what ``get_optimizers(model).param_groups``
    exposes: an LR scheduler that writes ``group["lr"]`` changes the update at
    the next backward.

    Attributes:
        spec: the optimizer model.
        param_group: hyperparameters plus ``"params"``, the annotated tensors.
        made: when the group was made, a reading of the monotonic clock that is
            only ever compared: groups made by the same annotation code come in
            the same order on every rank, and ``get_optimizers`` lists param
            groups in that order.
        index: its position in the param groups of the ``get_optimizers`` that
            listed it last (None before), which errors name.
        together: for a group that asks torch for ``foreach`` or ``fused``, the
            optimizers that step a set of its tensors in one call (a DDP bucket's
            share, say), by the set's tensor ids; see :mod:`overlap_optim.update`.
        state_dtype: the dtype its optimizer state is kept in between steps (None:
            float32); see :mod:`overlap_optim.state_precision`.
    """

    __slots__ = ("spec", "param_group", "made", "index", "together", "state_dtype")

    def __init__(self, spec: OptimizerSpec, state_dtype: torch.dtype | None = None) -> None:
        self.spec = spec
        self.state_dtype = state_dtype
        self.param_group: dict[str, Any] = {**spec.defaults, "params": []}
        # A clock, not a count the process shares, so nothing that ran before shows. Making a group takes
        # microseconds, far above the clock's resolution (ns on Linux, 100 ns on Windows): no two tie.
        self.made = time.perf_counter_ns()
        self.index: int | None = None
        self.together: dict[tuple[int, ...], torch.optim.Optimizer] = {}

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return self.spec.optimizer_class

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """The kwargs exactly as the user passed them."""
        return self.spec.kwargs

    def hyperparameters(self) -> dict[str, Any]:
        """The current hyperparameters, without ``"params"``."""
        return {k: v for k, v in self.param_group.items() if k != "params"}

    def step(self, optimizer: torch.optim.Optimizer, tensor: torch.Tensor | None = None) -> None:
        """Step ``optimizer`` (made by ``spec.make``) with this group's current hyperparameters:
        through :meth:`OptimizerSpec.step` for its one ``tensor``, or one plain ``step()`` over
        all its tensors (``tensor`` None). Every update of an annotated tensor runs here."""
        optimizer.param_groups[0].update(self.hyperparameters())
        if tensor is None:
            optimizer.step()
        else:
            self.spec.step(optimizer, tensor)

    def __repr__(self) -> str:
        return f"AnnotationGroup({self.optimizer_class.__name__}, {self.optimizer_kwargs})"


def needs_closure(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """True if ``optimizer_class.step`` cannot run without a closure (LBFGS)."""
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def describe_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dtypes: dict[int, torch.dtype] | None = None,
    group_options: dict[str, Any] | None = None,
) -> OptimizerSpec:
    """Probe ``optimizer_class(**kwargs)`` (with ``group_options`` set on its param group) once
    and describe it.

    It builds and steps the optimizer on a stand-in of each rank in ``dtypes``
    (``ndim -> dtype`` of the parameters to annotate; default: one 2-D fp32
    table), so that a bad value, or a step that cannot run alone, fails here
    and not in the middle of backward.

    Raises:
        TypeError: the constructor fails on the kwargs.
        ValueError: the optimizer rejects a value, or cannot step a stand-in.
        NotImplementedError: ``step()`` writes into its param group a name it also
            keeps per parameter (the two could not be kept apart).
    """
    kwargs, options = dict(kwargs), dict(group_options or {})
    defaults, group_state = {}, ()
    for ndim, dtype in (dtypes or {2: torch.float32}).items():
        defaults, group_state = _dry_run(optimizer_class, kwargs, options, ndim, dtype)
    defaults = {**defaults, **options}
    floats = frozenset(
        k for k, v in defaults.items() if (isinstance(v, float) if k in options else _is_float_setting(v))
    )
    state = _probe_state(optimizer_class, kwargs, options, group_state)
    return OptimizerSpec(
        optimizer_class=optimizer_class,
        kwargs=kwargs,
        defaults=dict(defaults),
        float_keys=floats,
        fixed={k: v for k, v in defaults.items() if k not in floats},
        state=state,
        group_state=group_state,
        group_options=options,
    )


def _make(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], options: dict[str, Any], params: list):
    optimizer = cls(params, **kwargs)
    optimizer.param_groups[0].update(options)
    return optimizer


def _dry_run(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], options: dict[str, Any], ndim: int, dtype: torch.dtype
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(completed defaults, names ``step()`` wrote into the param group), from one step on a stand-in."""
    stand_in = torch.ones((2,) * ndim, dtype=dtype, requires_grad=True)
    stand_in.grad = torch.ones_like(stand_in)
    try:
        optimizer = _make(cls, kwargs, options, [stand_in])
    except ValueError as err:
        raise ValueError(f"{cls.__name__}({kwargs}) rejected a value: {err}") from None
    except (IndexError, KeyError) as err:  # a tuple setting of the wrong length: betas=(0.9,)
        raise ValueError(
            f"{cls.__name__}({kwargs}) rejected a value: its constructor failed with {type(err).__name__}: {err} "
            "(a setting of the wrong length or kind?)"
        ) from None
    except TypeError as err:
        raise TypeError(f"{cls.__name__}({kwargs}) failed: {err}") from None
    before = dict(optimizer.param_groups[0])
    try:
        optimizer.step()
    except Exception as err:  # any failure means it cannot run in backward
        raise ValueError(
            f"{cls.__name__}({kwargs}) cannot step a {ndim}-d {dtype} "
            f"parameter on its own in backward: {type(err).__name__}: {err}"
        ) from None
    after = optimizer.param_groups[0]
    written = tuple(k for k in after if k != "params" and (k not in before or after[k] is not before[k]))
    clash = sorted(set(written) & set(optimizer.state[stand_in]))
    if clash:
        raise NotImplementedError(
            f"{cls.__name__} keeps {clash} both in its param group and per parameter; overlap_optim keeps "
            "group state per parameter under the same name, so it cannot hold both"
        )
    return dict(optimizer.defaults), written


def _probe_state(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], options: dict[str, Any], group_state: tuple[str, ...]
) -> dict[str, StateEntry] | None:
    """The state layout of a ``(_ROWS, _COLS)`` parameter, from a step on a zero gradient at zero;
    group state counts as per-tensor scalars (see :meth:`OptimizerSpec.step`)."""
    stand_in = torch.zeros(_ROWS, _COLS, requires_grad=True)
    stand_in.grad = torch.zeros_like(stand_in)
    try:
        optimizer = _make(cls, kwargs, options, [stand_in])
        optimizer.step()
    except Exception:  # it cannot step a matrix: no table may use it
        return None
    group = optimizer.param_groups[0]
    return {
        **{name: _entry(value) for name, value in optimizer.state[stand_in].items()},
        **{name: StateEntry("scalar", fresh=group[name]) for name in group_state},
    }


def _entry(value: Any) -> StateEntry:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return StateEntry("scalar", fresh=value)
    shape, fresh = tuple(value.shape), value.flatten()[0].item()
    if shape == (_ROWS, _COLS):
        return StateEntry("element", (-1,), fresh)
    if shape in ((_ROWS, 1), (_ROWS,)):
        return StateEntry("row", shape[1:], fresh)
    if shape in ((1, _COLS), (_COLS,)):
        return StateEntry("column", shape[:-1])
    return StateEntry("tensor", shape)


def _separable(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], options: dict[str, Any], axis: int) -> bool:
    """Whether stepping two halves (split along ``axis``), each with its own optimizer, gives
    the whole matrix's result, for every probe gradient sequence (:func:`_probe_gradients`):
    weights within 1e-7 of the update, and equal per-tensor scalars."""
    if "lr" in kwargs:  # separability must not hinge on a small (or zero) starting lr
        kwargs = {**kwargs, "lr": 1e-2}
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(_ROWS, _COLS, generator=generator, dtype=torch.float64)
    return all(_separable_on(cls, kwargs, options, axis, start, g) for g in _probe_gradients(start, generator))


def _vector_separable(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], options: dict[str, Any]) -> bool:
    """:func:`_separable` for a vector in two halves: random gradients, and a first one orthogonal to
    the weight."""
    if "lr" in kwargs:
        kwargs = {**kwargs, "lr": 1e-2}
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(_ROWS * _COLS, generator=generator, dtype=torch.float64)

    def randn():
        return torch.randn(start.shape, generator=generator, dtype=torch.float64)

    first = randn()
    sequences = [[randn() for _ in range(_PROBE_STEPS)],
                 [first - (first @ start) / (start @ start) * start] + [randn() for _ in range(_PROBE_STEPS - 1)]]
    return all(_separable_on(cls, kwargs, options, 0, start, g) for g in sequences)


def _probe_gradients(start: torch.Tensor, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Gradient sequences that reach an optimizer's branches: random ones, and first gradients
    orthogonal to the weight's rows, to its columns and to the whole weight, where an update
    that reads a cosine (AdamP's projection) takes another path."""
    def randn():
        return torch.randn(_ROWS, _COLS, generator=generator, dtype=torch.float64)

    def orthogonal(g, dim):  # remove the component along the weight, per row (1), column (0) or all (None)
        if dim is None:
            return g - (g * start).sum() / start.square().sum() * start
        return g - (g * start).sum(dim, keepdim=True) / start.square().sum(dim, keepdim=True) * start

    sequences = [[randn() for _ in range(_PROBE_STEPS)]]
    for dim in (1, 0, None):
        sequences.append([orthogonal(randn(), dim)] + [randn() for _ in range(_PROBE_STEPS - 1)])
    return sequences


def _separable_on(cls, kwargs, options, axis, start, grads) -> bool:
    try:
        whole, whole_scalars = _run(cls, kwargs, options, start, grads)
        halves = [
            _run(cls, kwargs, options, start.chunk(2, axis)[i], [g.chunk(2, axis)[i] for g in grads])
            for i in range(2)
        ]
    except Exception:  # it cannot step the pieces (or float64): treat as not separable
        return False
    moved = (whole - start).abs().max().item()
    joined = torch.cat([h[0] for h in halves], axis)
    if moved == 0 or (joined - whole).abs().max().item() > 1e-7 * moved:
        return False
    return all(_same(h[1], whole_scalars) for h in halves)


def _run(cls, kwargs, options, start, grads) -> tuple[torch.Tensor, dict[str, Any]]:
    param = start.clone().requires_grad_(True)
    optimizer = _make(cls, kwargs, options, [param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    scalars = {k: v for k, v in optimizer.state[param].items() if not isinstance(v, torch.Tensor) or v.dim() == 0}
    return param.detach(), scalars


def _is_float_setting(value: Any) -> bool:
    """Numbers (not bools), tensors, and tuples of numbers (betas, etas, Adafactor's eps)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float, torch.Tensor)):
        return True
    if isinstance(value, (tuple, list)) and value:
        return all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in value)
    return False


def _same(a: Any, b: Any) -> bool:
    if a is b:  # most often: the very value annotated
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
