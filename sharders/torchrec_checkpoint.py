"""A stock TorchRec fused-optimizer state dict, converted into the keyed optimizer's form.

Stock TorchRec (its sharders, FBGEMM's fused optimizers through ``fused_params``
or through ``torchrec.optim.apply_optimizer_in_backward``) saves
``dmp.fused_optimizer.state_dict()``: per table ``{"<table>.momentum1": ShardedTensor}``
under the table's weight FQN, with FBGEMM's names and shapes, and nothing for a
table on plain SGD. It saves no settings (no param groups, no eps) and no step
count. :func:`from_torchrec` renames and reshapes that state into what
``get_optimizers(model).state_dict()`` holds (``sum``, ``step``; row-wise as
``(rows, 1)``), wherever FBGEMM's update and the table's torch.optim annotation
are the same update, and refuses every other table by name and setting.

FBGEMM's update rules are those of ``shared/FBGEMM_NOTES.md`` (fbgemm-gpu-cpu 1.8):
EXACT_SGD is ``torch.optim.SGD(lr)``, EXACT_ADAGRAD is ``torch.optim.Adagrad(lr,
eps)`` and EXACT_ROWWISE_ADAGRAD is torchrec's ``RowWiseAdagrad(lr, eps)``, with
FBGEMM's eps default (1e-8) where ``fused_params`` gives none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim import _private, _state_schema
from overlap_optim._private import ShardedTensor
from overlap_optim.keyed import InBackwardOptimizer, get_optimizers
from overlap_optim.spec import AnnotationGroup, describe_optimizer

__all__ = ["from_torchrec"]

# FBGEMM's fused optimizers that torch.optim computes exactly: name -> (torch.optim class, the
# layout of its one state entry, FBGEMM's ``momentum1``: None (no state), "element" or "row").
_EXACT = {
    "EXACT_SGD": (torch.optim.SGD, None),
    "EXACT_ADAGRAD": (torch.optim.Adagrad, "element"),
    "EXACT_ROWWISE_ADAGRAD": (RowWiseAdagrad, "row"),
}
# torch.optim classes TorchRec's sharder maps to those (torchrec.distributed.utils), for tables
# annotated with torchrec.optim.apply_optimizer_in_backward.
_STOCK_TYPE_OF = {torch.optim.SGD: "EXACT_SGD", torch.optim.Adagrad: "EXACT_ADAGRAD",
                  RowWiseAdagrad: "EXACT_ROWWISE_ADAGRAD"}
# FBGEMM's defaults for what the three kernels read (SplitTableBatchedEmbeddingBagsCodegen).
_FBGEMM_DEFAULTS = {"optimizer": "EXACT_SGD", "learning_rate": 0.01, "eps": 1e-8}
# FBGEMM kwargs that change the update and have no torch.optim counterpart, at their neutral value.
# Weight decay: FBGEMM's CPU row-wise Adagrad drops it for fp32 tables, and its Adagrad and SGD
# read none, so no stock run with it is known to have computed torch.optim's update.
_NEUTRAL = {"weight_decay": 0.0, "weight_decay_mode": "NONE", "gradient_clipping": False,
            "counter_based_regularization": None, "cowclip_regularization": None}
# Settings of ours that do not change the update: the state is replaced (initial_accumulator_value),
# or they only choose an implementation, or they are read only with momentum (dampening).
_INERT = frozenset({"lr", "foreach", "fused", "differentiable", "capturable", "initial_accumulator_value",
                    "dampening"})
_TABLE_KEY = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")
_STATE_NAME = {"element": "sum", "row": "sum"}


def from_torchrec(
    state_dict: Mapping[str, Any],
    model: torch.nn.Module,
    fused_params: Mapping[str, Any] | None = None,
    *,
    annotations: Mapping[str, tuple[type[torch.optim.Optimizer], Mapping[str, Any]]] | None = None,
    step: int = 0,
    fresh: Iterable[str] = (),
) -> dict[str, Any]:
    """Convert stock TorchRec's ``fused_optimizer.state_dict()`` for ``get_optimizers(model)``.

    Each table of ``model`` (an EBC's or EC's) gets the state stock TorchRec kept for it,
    under torch.optim's names and shapes: FBGEMM's ``momentum1`` becomes ``sum``, of shape
    ``(rows, dim)`` for Adagrad and ``(rows, 1)`` for ``RowWiseAdagrad``, a ``ShardedTensor``
    split as stock split it (``load_state_dict`` gathers it where this plan splits otherwise);
    a table on SGD gets none. Entries already in torch.optim's form under one of ``model``'s
    parameter names (the dense part of a ``CombinedOptimizer`` with a ``KeyedOptimizerWrapper``)
    are kept as they are. Learning rates are not converted: they stay ours (the annotation's,
    or what a scheduler's ``load_state_dict`` sets), as stock saves none.

    Stock saves no settings, so they are given here, as stock TorchRec was given them: a
    table's FBGEMM kwargs are ``fused_params`` (the stock sharder's), updated with its entry
    in ``annotations`` translated as TorchRec's sharder does (class to FBGEMM optimizer,
    ``lr`` to ``learning_rate``), with FBGEMM's defaults (``EXACT_SGD``, eps 1e-8) for the rest.

    ``step``: FBGEMM's SGD and Adagrad keep no step count, so ``step`` (default 0) becomes
    ``step`` of every converted table with state. torch's Adagrad and ``RowWiseAdagrad`` read
    it only for ``lr_decay``, which FBGEMM has not (an annotation with it is refused), so it
    changes no update; pass the number of stock steps for a state dict that says so.

    With several ranks this is a collective over the default group (call it on every rank
    with that rank's stock state dict): each rank's entries are described to every rank, so
    every rank returns the same keys, and every check's verdict is the same on every rank.
    Nothing is changed, on refusal or not: the result is for ``load_state_dict``.

    Args:
        state_dict: ``dmp.fused_optimizer.state_dict()`` of the stock model (this rank's).
        model: ours, sharded with :mod:`sharders` (or not), annotated as it will train.
        fused_params: the stock sharder's ``fused_params``; None where every table is in
            ``annotations``.
        annotations: table name -> ``(optimizer class, kwargs)``, as passed to TorchRec's
            ``apply_optimizer_in_backward`` for the stock model.
        step: the ``step`` the converted tables get (see above).
        fresh: names of ``model``'s parameters that start with no optimizer state (the dense
            part, when the stock dense optimizer's state is not in ``state_dict``).

    Returns:
        ``{"state": {fqn: {torch.optim name: value}}}`` for ``get_optimizers(model).load_state_dict``.

    Raises:
        TypeError: an argument of the wrong kind (named).
        ValueError: a table whose stock optimizer or setting is not its annotation's update
            (every such table, each with the setting and both values); an FBGEMM setting or
            optimizer with no exact torch.optim counterpart; keys missing or unexpected (both
            lists); stock state split per column shard (row-wise Adagrad on column shards).

    Example:
        >>> stock = dmp_stock.fused_optimizer.state_dict()   # EXACT_ADAGRAD, learning_rate 0.1, eps 1e-8
        >>> opt = overlap_optim.get_optimizers(model)         # Adagrad(lr=0.1, eps=1e-8) on every table
        >>> opt.load_state_dict(sharders.from_torchrec(stock, model, fused_params, fresh=["dense.0.weight"]))
    """
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    try:
        optimizer, fresh, stock, passed = _checked_input(state_dict, model, fused_params, annotations, step, fresh)
        facts, failure = _describe(stock), None
    except (TypeError, ValueError) as err:
        optimizer = fresh = stock = passed = facts = None
        failure = err
    gathered = _state_schema.agree(group, failure, facts)
    try:
        plan = _plan(optimizer, gathered, passed, fused_params, annotations, fresh)
        failure = None
    except ValueError as err:
        failure = err
    _state_schema.agree(group, failure)
    return {"state": _converted(plan, stock, passed, step, group)}


def _checked_input(state_dict, model, fused_params, annotations, step, fresh):
    """The keyed optimizer, ``fresh`` as a set, the stock fused entries and the torch-form entries."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_torchrec takes the model as an nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise TypeError(
            "from_torchrec takes stock TorchRec's fused_optimizer.state_dict(): a mapping with a 'state' mapping, "
            f"got {type(state_dict).__name__}"
        )
    if fused_params is not None and not isinstance(fused_params, Mapping):
        raise TypeError(f"fused_params must be a mapping (the stock sharder's), got {type(fused_params).__name__}")
    for table, entry in (annotations or {}).items():
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], Mapping)):
            raise TypeError(f"annotations[{table!r}] must be (optimizer class, kwargs), got {entry!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    optimizer = get_optimizers(model)
    if not isinstance(optimizer, InBackwardOptimizer):
        raise TypeError("from_torchrec: some module of the model was sharded by another sharder than sharders'; "
                        "its fused optimizer keeps TorchRec's keys already")
    fresh = set([fresh] if isinstance(fresh, str) else fresh)
    unknown = sorted(fresh - set(optimizer.params))
    if unknown:
        raise ValueError(f"fresh names {unknown}, which are not parameters that get_optimizers(model) steps")
    stock, passed = _split_entries(state_dict["state"], set(optimizer.params))
    return optimizer, fresh, stock, passed


def _split_entries(state: Mapping[str, Any], ours: set[str]) -> tuple[dict, dict]:
    """(key -> {FBGEMM name: value}) of stock fused entries, (key -> state) of torch-form entries."""
    stock, passed = {}, {}
    for key, entries in state.items():
        if not isinstance(entries, Mapping):
            raise TypeError(f"state[{key!r}] must be a mapping of state names, got {type(entries).__name__}")
        table = _table_of(key)
        fused = {n: v for n, v in entries.items() if table is not None and n.startswith(f"{table}.")}
        if fused and len(fused) != len(entries):
            raise ValueError(f"state[{key!r}] mixes FBGEMM's names {sorted(fused)} with others {sorted(entries)}")
        for name, value in entries.items():
            if not isinstance(value, (torch.Tensor, ShardedTensor)):
                raise TypeError(f"state[{key!r}][{name!r}] is a {type(value).__name__}, not a tensor")
        if fused or (table is not None and not entries):  # stock keeps an empty entry for SGD
            stock[key] = {n[len(table) + 1 :]: v for n, v in fused.items()}
        elif key in ours:
            passed[key] = dict(entries)
        else:
            stock[key] = dict(entries)  # refused by _plan as unexpected, on every rank
    return stock, passed


def _describe(stock: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What every rank must know of this rank's stock entries: a ShardedTensor's global metadata,
    a plain tensor's shape."""
    return {key: {name: (v.metadata() if isinstance(v, ShardedTensor) else tuple(v.shape))
                  for name, v in entries.items()} for key, entries in stock.items()}


def _plan(optimizer, gathered, passed, fused_params, annotations, fresh) -> dict[str, Any]:
    """Per key of ours: ("stock", layout, stock metadata or shape), ("none",) or ("passed",)."""
    merged: dict[str, dict[str, Any]] = {}
    for rank_facts in gathered:
        for key, entries in rank_facts.items():
            for name, meta in entries.items():
                merged.setdefault(key, {}).setdefault(name, meta)
    for key, entries in merged.items():  # a plain tensor is a whole copy, the same on every rank
        plain = [name for name, meta in entries.items() if isinstance(meta, tuple)]
        if any(rank_facts.get(key, {}).get(name) != entries[name] for rank_facts in gathered for name in plain):
            raise ValueError(f"stock state {key} {plain}: a plain tensor that is not on every rank alike")
    groups = optimizer.annotation_groups()
    unexpected = sorted(set(merged) - set(groups))
    if unexpected:
        raise ValueError(f"the stock state dict does not match the model: unexpected keys {unexpected}")
    plan, refusals, missing = {}, [], []
    for key, group in groups.items():
        if key in passed:
            plan[key] = ("passed",)
        elif _table_of(key) is not None and key not in fresh:
            try:
                plan[key] = _table_plan(key, group, merged.get(key, {}), optimizer.params[key], fused_params,
                                        annotations)
            except ValueError as err:
                refusals.append(str(err))
        elif key in fresh or not group.spec.state:
            plan[key] = ("none",)
        else:
            missing.append(key)
    if refusals:
        raise ValueError("stock TorchRec's state cannot become ours where the updates differ:\n  "
                         + "\n  ".join(refusals))
    if missing:
        raise ValueError(
            f"the stock state dict does not match the model: missing keys {missing} (annotated here with an "
            "optimizer that keeps state). Pass the stock dense optimizer's state dict by FQN too (a CombinedOptimizer "
            "with TorchRec's KeyedOptimizerWrapper saves it so), or name them in fresh= to start them without state"
        )
    return plan


def _table_plan(key, group, entries, weight, fused_params, annotations) -> tuple:
    table = _table_of(key)
    settings = _stock_settings(table, fused_params, annotations)
    cls, layout = _EXACT[settings["optimizer"]]
    _check_same_update(table, group, cls, settings)
    if layout is None:
        if entries:
            raise ValueError(f"table {table!r}: stock state {sorted(entries)} for FBGEMM's EXACT_SGD, which keeps none")
        return ("none",)
    if set(entries) != {"momentum1"}:
        raise ValueError(f"table {table!r}: stock state {sorted(entries)}, where FBGEMM's "
                         f"{settings['optimizer']} keeps ['momentum1'] (a table stock held data-parallel?)")
    meta = entries["momentum1"]
    rows, dim = tuple(weight.size())
    want = (rows, dim) if layout == "element" else (rows,)
    size = tuple(meta.size) if not isinstance(meta, tuple) else meta
    if size != want:
        why = (f" (stock keeps one accumulator per column shard, the mean of g² over that shard's columns; "
               f"RowWiseAdagrad keeps one per whole row)" if layout == "row" and size[0] % rows == 0 else "")
        raise ValueError(f"table {table!r}: stock momentum1 of shape {size}, {want} for a table of {rows}x{dim}{why}")
    return ("stock", layout, meta)


def _stock_settings(table: str, fused_params, annotations) -> dict[str, Any]:
    """The FBGEMM kwargs stock gave ``table``, as TorchRec's sharder merges them, checked."""
    if fused_params is None and table not in (annotations or {}):
        raise ValueError(f"table {table!r}: no stock settings: pass the stock sharder's fused_params= "
                         "or the table's annotations=")
    settings = {**_FBGEMM_DEFAULTS, **dict(fused_params or {}), "defaulted": set(_FBGEMM_DEFAULTS)}
    settings["defaulted"] -= set(fused_params or {})
    if table in (annotations or {}):
        cls, kwargs = annotations[table]
        if cls not in _STOCK_TYPE_OF:
            raise ValueError(f"table {table!r}: stock annotation {getattr(cls, '__name__', cls)}: FBGEMM runs it "
                             "otherwise than torch.optim or not on CPU; exact: SGD, Adagrad, RowWiseAdagrad")
        kwargs = dict(kwargs)
        if "lr" in kwargs:
            kwargs["learning_rate"] = kwargs.pop("lr")
        settings.update({"optimizer": _STOCK_TYPE_OF[cls], **kwargs})
        settings["defaulted"] -= {"optimizer", *kwargs}
    settings["optimizer"] = getattr(settings["optimizer"], "name", settings["optimizer"])
    if settings["optimizer"] not in _EXACT:
        raise ValueError(f"table {table!r}: FBGEMM's {settings['optimizer']} has no exact torch.optim counterpart "
                         f"here; exact: {sorted(_EXACT)}")
    for name, neutral in _NEUTRAL.items():
        value = settings.get(name, neutral)
        if getattr(value, "name", value) != neutral:
            raise ValueError(f"table {table!r}: stock {name}={value!r}, which FBGEMM does not compute as "
                             "torch.optim does")
    return settings


def _check_same_update(table: str, group: AnnotationGroup, cls: type, settings: dict[str, Any]) -> None:
    """Raise, naming the setting and both values, unless ``group`` computes stock's update."""
    stock_name = f"FBGEMM's {settings['optimizer']} ({cls.__module__}.{cls.__qualname__})"
    if group.optimizer_class is not cls:
        raise ValueError(f"table {table!r}: stock trained it with {stock_name}, ours is annotated with "
                         f"{group.optimizer_class.__name__}: annotate {cls.__name__} to convert it")
    ours = group.hyperparameters()
    kwargs = {"lr": ours["lr"], **({"eps": float(settings["eps"])} if "eps" in ours else {})}
    expected = describe_optimizer(cls, kwargs).defaults
    for name, want in expected.items():
        if name not in _INERT and ours.get(name, want) != want:
            origin = " (FBGEMM's default: the stock settings give none)" if name in settings["defaulted"] else ""
            raise ValueError(f"table {table!r}: {name} is {ours.get(name)!r} here, {want!r}{origin} in stock's "
                             f"{stock_name}: annotate {cls.__name__}({name}={want!r}) to convert it")


def _converted(plan, stock, passed, step: int, group: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for key, entry in plan.items():
        if entry[0] == "passed":
            out[key] = passed[key]
        elif entry[0] == "none":
            out[key] = {}
        else:
            _, layout, meta = entry
            local = stock.get(key, {}).get("momentum1")
            out[key] = {_STATE_NAME[layout]: _torch_form(local, layout, meta, group),
                        "step": torch.tensor(float(step))}
    return out


def _torch_form(local: Any, layout: str, meta: Any, group: Any) -> Any:
    """FBGEMM's momentum1 (this rank's, None if it holds none) as torch.optim's ``sum``."""
    if isinstance(meta, tuple):  # a plain tensor, whole on every rank
        if local is None:
            raise ValueError("a plain-tensor stock entry must be on every rank")
        return local if layout == "element" else local.view(-1, 1)
    shards = [] if local is None else local.local_shards()
    if layout == "element":
        return _private.sharded_tensor_from_local_shards(shards, meta, group)
    metadata = _private.ShardedTensorMetadata(
        shards_metadata=[_row_metadata(s) for s in meta.shards_metadata],
        size=torch.Size([meta.size[0], 1]),
        tensor_properties=meta.tensor_properties,
    )
    pieces = [_private.Shard(s.tensor.view(-1, 1), _row_metadata(s.metadata)) for s in shards]
    return _private.sharded_tensor_from_local_shards(pieces, metadata, group)


def _row_metadata(shard: Any) -> Any:
    """A ``(n,)`` row-wise shard at row ``o`` as the ``(n, 1)`` shard at ``(o, 0)``."""
    return _private.ShardMetadata([shard.shard_offsets[0], 0], [shard.shard_sizes[0], 1], shard.placement)


def _table_of(key: str) -> str | None:
    """The table name in an EBC's or EC's weight FQN, else None."""
    match = _TABLE_KEY.search(key)
    return match.group(1) if match else None
