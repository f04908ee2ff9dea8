"""One keyed optimizer over every annotated parameter of a model.

:func:`get_optimizers` gathers the per-parameter optimizers that
:func:`~overlap_optim.apply_optimizer_in_backward` attached, and presents them
as a single TorchRec ``KeyedOptimizer``: state keyed by fully qualified
parameter name, one param group per annotation call, ``state_dict()`` /
``load_state_dict()`` and ``init_state()``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.types import ShardedModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from overlap_optim import _private, _state_schema, plans
from overlap_optim._private import ShardedTensor
from overlap_optim.accumulation import StepTracker, track_steps
from overlap_optim.lost import refuse_lost
from overlap_optim.record import group_of, module_record
from overlap_optim.spec import AnnotationGroup, settings_of
from overlap_optim.update import (
    drop_placeholder_state,
    has_real_state,
    init_placeholder_state,
    live_optimizer,
    load_param_state,
    param_restore_point,
    placeholder_written,
)

__all__ = [
    "get_optimizers", "unoptimized_parameters", "InBackwardOptimizer", "unwrapped_parameters", "unwrapped_name",
    "ddp_prefixes", "unwrapped_path", "refuse_compiling_pipeline",
]

# The group entry naming the optimizer class; it is metadata, not a hyperparameter.
_CLASS_KEY = "optimizer"

class _LiveState(Mapping):
    """``param -> state dict`` read through to each live optimizer, so state
    created lazily at the first backward shows up without a rebuild."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = list(params.values())

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        optimizer = live_optimizer(param)
        if optimizer is None or param not in optimizer.state:
            raise KeyError(param)
        return optimizer.state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for param in self._params:
            optimizer = live_optimizer(param)
            if optimizer is not None and optimizer.state.get(param):
                yield param

    def __len__(self) -> int:
        return sum(1 for _ in self)


class InBackwardOptimizer(KeyedOptimizer):
    """The in-backward optimizers of a model, as one ``KeyedOptimizer``.

    The updates themselves run during backward, so ``step()`` and
    ``zero_grad()`` do no work (``step(closure)`` runs the closure, whose
    backward updates). ``param_groups`` are the live groups: setting
    ``param_groups[i]["lr"]``, by hand or from a ``torch.optim.lr_scheduler``,
    takes effect at the next backward. Call ``step()`` once per iteration anyway
    if you use a scheduler, so that it does not warn about the call order.

    Build it with :func:`get_optimizers`.
    """

    def __init__(self, params: dict[str, torch.Tensor], tables: list[tuple[str, Any]] | None = None) -> None:
        # tables: (module path, its overlap_optim.plans.TableStates) of each module a sharder planned
        self._sources = list(tables or [])
        self._tables = {_join(path, key): (t, key) for path, t in self._sources for key in t.keys()}
        groups: dict[int, AnnotationGroup] = {}
        self._table_keys_of: dict[int, list[str]] = {}
        for param in params.values():
            group = group_of(param)
            groups.setdefault(id(group), group)
        for path, t in self._sources:
            for key, group in t.groups():
                groups.setdefault(id(group), group)
                self._table_keys_of.setdefault(id(group), []).append(_join(path, key))
        # Creation order: the same on every rank and whatever the plan.
        self._groups = sorted(groups.values(), key=lambda g: g.made)
        for index, group in enumerate(self._groups):
            group.index = index
        all_params = {**params, **{k: t.weight(key) for k, (t, key) in self._tables.items()}}
        super().__init__(all_params, _LiveState(params), [g.param_group for g in self._groups])
        self._in_backward = params
        self.save_param_groups(True)
        # Schedulers that cycle momentum (OneCycleLR, CyclicLR) look for it in the defaults.
        for name in ("momentum", "betas"):
            if self._groups and all(name in g.param_group for g in self._groups):
                self.defaults[name] = self._groups[0].param_group[name]
        self._key_of = {param: key for key, param in params.items()}
        self._tracker: StepTracker | None = None  # get_optimizers sets the model's
        self._template_out = False  # a state_dict() was taken since the last load or check

    # AMP's GradScaler hands itself to step() (``grad_scaler=``) when this is set: the one
    # place to see it, and refuse it.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """Run ``closure`` if given (its backward performs the updates); else nothing.

        Raises:
            RuntimeError: called by AMP's ``GradScaler.step``: the updates ran in backward on
                the scaled gradients.
        """
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                "GradScaler.step() on in-backward optimizers: the loss was scaled (by "
                f"{_scale_of(grad_scaler)}), and every annotated update already ran during backward on the "
                "scaled gradients, before GradScaler could unscale them or skip the step. Do not use GradScaler "
                "with overlap_optim: train in bfloat16 autocast (no loss scaling needed), or leave the "
                "parameters that need loss scaling unannotated"
            )
        if self._tracker is not None and not _private.called_from_torch_state_dict_api():
            self._tracker.stepped()
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: backward releases each annotated gradient after its update.

        Raises:
            NotImplementedError: called by TorchRec's compiling train pipelines (see
                :func:`refuse_compiling_pipeline`), before their first forward.
        """
        refuse_compiling_pipeline()

    def _refuse_mid_window(self, what: str) -> None:
        if self._tracker is not None and self._tracker.window.pending:
            raise RuntimeError(
                f"{what} inside a no_step window: micro-batches have run in overlap_optim.no_step(model) and the "
                "window's last micro-batch has not, so their gradients are held outside the optimizer state. "
                "Save or load after the window's last backward"
            )

    def _refuse_torch_state_dict_api(self) -> None:
        """torch's ``get_state_dict`` / ``set_state_dict`` translate an optimizer's state between keys by
        position and keys by name; ours is keyed by name already, so they would mis-key it."""
        if not _private.called_from_torch_state_dict_api():
            return
        if self._tracker is None or not self._tracker.window.open:
            for param in self._in_backward.values():  # the zero gradients torch put to make state
                param.grad = None
        raise NotImplementedError(
            "torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (and get_optimizer_state_dict, "
            "set_optimizer_state_dict) translate an optimizer's state between keys by position and keys by parameter "
            "name; overlap_optim's keyed optimizer already keys its state by parameter FQN, so they would mis-key it. "
            "Save opt.state_dict() and load it with opt.load_state_dict(), or hand the optimizer itself to DCP "
            "(dcp.save({'optim': opt}), dcp.load({'optim': opt})): see docs/checkpoints.md. Nothing was changed"
        )

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {name: value}}, "param_groups": (...), "placeholders": [...]}``.

        Keys are the unsharded model's parameter FQNs and state names are
        torch.optim's, with torch.optim's shapes, whatever the sharding plan:
        a sharded table's per-row state is a ``ShardedTensor`` of the whole
        table's shape. Each group lists its parameters by FQN and records the
        optimizer class. State tensors are returned by reference, as
        ``torch.optim`` does. With sharded tables this is a collective: call it
        on every rank.

        Every parameter with an optimizer that keeps state has every entry, as
        TorchRec's fused optimizers do, even before its first step (then its
        state is a placeholder, made by :meth:`init_state`, and its key is
        listed under ``"placeholders"``; loading gives it no state again). So
        a fresh optimizer's state dict is a template that
        ``torch.distributed.checkpoint.load`` fills: then hand it to
        :meth:`load_state_dict` (or pass the optimizer itself to ``dcp.load``,
        which does). The first forward after an in-place fill that was never
        loaded raises (see ``docs/checkpoints.md``).

        ``param_groups`` is a tuple of dicts, which ``torch.distributed.checkpoint``
        stores as one entry: torch's default load planner re-reads a template in its
        pre-2.4 layout when some ``ShardedTensor`` has no piece on a rank (a table_wise
        table held by another rank), and there a list of dicts is one entry where the
        saved layout has one per hyperparameter. A tuple is one entry in both, so
        ``dcp.load`` reads this state dict under any plan.

        Raises:
            RuntimeError: inside a ``no_step`` window (see :func:`overlap_optim.no_step`).
            NotImplementedError: called by torch's ``get_state_dict`` (see :meth:`load_state_dict`).
        """
        self._refuse_torch_state_dict_api()
        self._refuse_mid_window("state_dict()")
        self.init_state()  # every entry, so that dcp.load can fill even a fresh optimizer's state dict
        self._template_out = True
        real = set(self._keys_with_state())
        state = {self._key_of[p]: dict(s) for p, s in self.state.items()}
        for path, tables in self._sources:
            state.update({_join(path, k): v for k, v in tables.state_dict().items()})
        return {
            "state": state,
            # A tuple: one entry for torch.distributed.checkpoint whichever of its two layouts a load
            # reads (see _state_schema.PARAM_GROUPS_IN_DCP).
            "param_groups": tuple(self._group_state(g) for g in self._groups),
            _state_schema.PLACEHOLDERS: sorted(k for k in state if k not in real),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load state and hyperparameters saved by :meth:`state_dict`, under this plan or another.

        Everything is checked before anything changes: on any error the
        current weights, state and hyperparameters are exactly as they were,
        and a load interrupted while it copies (``KeyboardInterrupt``, out of
        memory) puts back what it had copied before it re-raises.
        With sharded tables this is a collective: each rank checks its own
        copy, then the ranks agree, so a check that fails on one rank raises
        on every rank (naming it). An entry split by another plan (or a
        ``ShardedTensor`` where this plan keeps a plain tensor) is gathered
        whole on every rank, then sliced as this plan holds it.

        Raises:
            ValueError: keys are missing or unexpected (both lists are given),
                a parameter that has state here has none in ``state_dict``,
                a parameter's optimizer or state names differ, or a state
                tensor's shape does not fit its parameter.
            RuntimeError: inside a ``no_step`` window.
            NotImplementedError: called by ``torch.distributed.checkpoint.state_dict``'s
                ``set_state_dict`` (or ``get_state_dict``, from :meth:`state_dict`), which re-key
                state between positions and names: ours is keyed by name already.
        """
        self._refuse_torch_state_dict_api()
        self._refuse_mid_window("load_state_dict()")
        ranks = self._sources[0][1].process_group if self._sources else None
        try:
            new_state, new_groups = _state_schema.split(state_dict)
            _state_schema.check_keys(self.params, new_state, new_groups)
            facts, failure = (_state_schema.signature(new_state), self._split_elsewhere(new_state)), None
        except ValueError as err:
            facts, failure = None, err
        gathered = _state_schema.agree(ranks, failure, facts)
        mismatched = [rank for rank, f in enumerate(gathered) if f[0] != gathered[0][0]]
        if mismatched:
            raise ValueError(
                f"the state dict differs across ranks: ranks {mismatched} hold other keys, state names or sharded "
                "entries than rank 0; load the same state dict on every rank"
                + _state_schema.stock_hint([n for s in new_state.values() for n in s])
            )
        # Entries split by another plan: every rank gathers each whole, in the same order.
        elsewhere = sorted({key for f in gathered for key in f[1]})
        for key in elsewhere:
            new_state[key] = {n: _state_schema.whole_tensor(v) if isinstance(v, ShardedTensor) else v
                              for n, v in sorted(new_state[key].items())}
        try:
            matched, loaded = self._checked(new_state, new_groups)
            failure = None
        except ValueError as err:
            failure = err
        _state_schema.agree(ranks, failure)
        restore = self._restore_point([k for k in self._tables if new_state.get(k)])
        try:
            for group, saved in matched:
                group.param_group.update({k: v for k, v in saved.items() if k not in ("params", _CLASS_KEY)})
            for key, (tables, table_key) in self._tables.items():
                if new_state.get(key):
                    tables.load(table_key, new_state[key])
            for key, param in self._in_backward.items():
                load_param_state(param, loaded[key])
        except BaseException:  # interrupted half-way (Ctrl-C, out of memory): as it was
            restore()
            raise
        self.drop_placeholder_state()  # what was not loaded over (dcp.load may have written it)
        self._template_out = False

    def _restore_point(self, table_keys: list[str]) -> Callable[[], None]:
        """A function that puts the hyperparameters, the state of the tables ``table_keys`` and of
        every other parameter back as they are now; it holds the state by reference, and a copy only
        of what a load writes in place (fused tables)."""
        groups = [(g.param_group, {k: v for k, v in g.param_group.items() if k != "params"}) for g in self._groups]
        restores = [self._tables[k][0].restore_point(self._tables[k][1]) for k in table_keys]
        restores += [param_restore_point(p) for p in self._in_backward.values()]

        def restore() -> None:
            for param_group, hypers in groups:
                param_group.update(hypers)
            for undo in restores:
                undo()
        return restore

    def param_groups_by_key(self) -> list[tuple[AnnotationGroup, list[str]]]:
        """Each annotation group with a dense (not table) parameter, and the keys of its parameters
        and tables, in ``param_groups`` order."""
        keys: dict[int, list[str]] = {}
        for key, param in self._in_backward.items():
            keys.setdefault(id(group_of(param)), []).append(key)
        return [(g, keys[id(g)] + self._table_keys_of.get(id(g), [])) for g in self._groups if id(g) in keys]

    def refuse_unloaded_template(self) -> None:
        """Raise if a state dict of this optimizer was filled in place (``dcp.load``) and never
        handed to :meth:`load_state_dict`: training on would silently drop what was read. Run
        before each forward of the model (:func:`get_optimizers` registers it); free unless a
        :meth:`state_dict` was taken since the last check."""
        if not self._template_out:
            return
        written = [k for k, p in self._in_backward.items() if placeholder_written(p)]
        for path, tables in self._sources:
            written += [_join(path, k) for k in tables.written_placeholders()]
        if written:
            raise RuntimeError(
                f"the optimizer state of {sorted(written)} was read into opt.state_dict() in place (dcp.load) "
                "but never loaded: this optimizer keeps step counts and hyperparameters outside that dict, "
                "and would drop what was read at the next step. Call opt.load_state_dict(state['optim']) after "
                "dcp.load, or pass the optimizer itself to dcp.load ({'optim': opt}), which does "
                "(docs/checkpoints.md). Nothing has been trained since the load"
            )
        self._template_out = False

    def _split_elsewhere(self, new_state: dict[str, Any]) -> list[str]:
        """Keys whose saved state this rank cannot take from its own part of it: a ``ShardedTensor``
        where a plain tensor is kept (a data-parallel table, a dense parameter), or split by
        another plan than this one's."""
        keys = [k for k in self._in_backward
                if any(isinstance(v, ShardedTensor) for v in new_state.get(k, {}).values())]
        keys += [k for k, (tables, table_key) in self._tables.items()
                 if not tables.held_locally(table_key, new_state.get(k, {}))]
        return sorted(keys)

    def _checked(self, new_state: dict[str, Any], new_groups: list | None) -> tuple[list, dict[str, Any]]:
        """Every check of :meth:`load_state_dict` (a collective with sharded tables): the matched param
        groups and the in-backward parameters' checked state."""
        dropped = sorted(k for k in self._keys_with_state() if not new_state.get(k))
        if dropped:
            raise ValueError(
                f"the state dict has no optimizer state for {dropped}, which have state here: loading it "
                "would drop that state (Adam's moments, Adagrad's sums...). Load a state dict saved from "
                "the whole optimizer after the same steps"
            )
        matched = self._match_groups(new_groups)
        loaded = {
            key: _state_schema.check_param_state(key, param, new_state.get(key, {}))
            for key, param in self._in_backward.items()
        }
        for key, (tables, table_key) in self._tables.items():
            tables.check(table_key, new_state.get(key, {}))
        return matched, loaded

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` where nothing was loaded over its placeholders."""
        for _, tables in self._sources:
            tables.drop_placeholder_state()
        for param in self._in_backward.values():
            drop_placeholder_state(param)

    def annotation_groups(self) -> dict[str, AnnotationGroup]:
        """Each parameter's annotation group, by key (its FQN), in ``params`` order."""
        tables = {key: group for group in self._groups for key in self._table_keys_of.get(id(group), [])}
        return {key: tables[key] if key in tables else group_of(self._in_backward[key]) for key in self.params}

    def _keys_with_state(self) -> list[str]:
        """Keys whose state is real (not an init_state placeholder); a collective with sharded tables."""
        keys = [k for k, p in self._in_backward.items() if has_real_state(p)]
        for path, tables in self._sources:
            keys += [_join(path, k) for k in tables.keys_with_state()]
        return keys

    def init_state(self, sparse_grad_parameter_names: set[str] | None = None) -> None:
        """Create every lazy state tensor, so a checkpoint can be loaded in place.

        It steps each parameter that has no state yet on a zero gradient and
        puts its weight back. The state it makes is a placeholder: if backward
        reaches the parameter before a ``load_state_dict``, the placeholder is
        dropped first, so training stays exactly that of ``torch.optim``.
        """
        for _, tables in self._sources:
            tables.init_state()
        for param in self._in_backward.values():
            init_placeholder_state(param)

    def _group_state(self, group: AnnotationGroup) -> dict[str, Any]:
        keys = {self._key_of[p] for p in group.param_group["params"] if p in self._key_of}
        keys = sorted(keys | set(self._table_keys_of.get(id(group), [])))
        cls = group.optimizer_class
        return {
            **group.hyperparameters(),
            _CLASS_KEY: f"{cls.__module__}.{cls.__qualname__}",
            "params": keys,
        }

    def _match_groups(
        self, new_groups: list[dict[str, Any]] | None
    ) -> list[tuple[AnnotationGroup, dict[str, Any]]]:
        if new_groups is None:
            return []
        saved_of = {key: g for g in new_groups for key in g["params"]}
        pairs = []
        for group in self._groups:
            mine = self._group_state(group)
            saved = saved_of[mine["params"][0]]
            if saved.get(_CLASS_KEY, mine[_CLASS_KEY]) != mine[_CLASS_KEY]:
                raise ValueError(
                    f"optimizer mismatch for {mine['params'][0]!r}: the state dict holds "
                    f"{saved[_CLASS_KEY]} state, the model now has {mine[_CLASS_KEY]}"
                )
            strays = sorted(set(mine["params"]) - set(saved["params"]))
            if strays:
                raise ValueError(
                    f"param group of {mine['params'][0]!r} was saved without {strays}: "
                    "annotate the same parameters together as when the state was saved"
                )
            pairs.append((group, saved))
        return pairs


def refuse_compiling_pipeline() -> None:
    """Raise ``NotImplementedError`` inside TorchRec's train pipelines that compile the model
    (``TrainPipelinePT2``, ``TrainPipelineSparseDistCompAutograd``): Dynamo and compiled autograd cannot
    trace the in-backward updates. They call the optimizer's ``zero_grad`` before their first forward,
    which is where the keyed optimizer refuses them, on every rank, before anything is trained."""
    name = _private.compiling_pipeline()
    if name is not None:
        raise NotImplementedError(
            f"TorchRec's {name} compiles the model (torch.compile or compiled autograd), and overlap-optim's "
            "in-backward updates (gradient hooks, end-of-backward rounds, clipping, live checks) do not trace "
            "under Dynamo: it would crash inside the compiler part-way through a step. Train with "
            "TrainPipelineSparseDist or TrainPipelineBase"
        )


def _scale_of(grad_scaler: Any) -> str:
    try:
        return f"{float(grad_scaler.get_scale()):g}"
    except Exception:  # any scaler-like object: the message must not fail
        return "GradScaler's scale"


def get_optimizers(model: torch.nn.Module) -> KeyedOptimizer:
    """The one keyed optimizer for every annotated parameter of ``model``.

    Parameters are keyed by their FQN in the unsharded model (the first name of a
    shared parameter), and state by torch.optim's names and shapes, so the
    keys are the same for every sharding plan, kernel and world size as for
    the unsharded model under plain torch.optim. Param groups are the
    annotation calls, in the order they were made. Tables sharded by
    :mod:`sharders` (fused or fallback) and every other annotated parameter
    are covered. It warns once, listing them, about trainable parameters that
    nothing here updates.

    Args:
        model: the module whose parameters were annotated with
            :func:`~overlap_optim.apply_optimizer_in_backward`, plain or sharded
            (``DistributedModelParallel``, or modules sharded one by one).

    Returns:
        An :class:`InBackwardOptimizer`; if another sharder sharded some module,
        a TorchRec ``CombinedOptimizer`` of that module's ``fused_optimizer``
        (with TorchRec's plan-dependent keys) and it.

    Example:
        >>> opt = get_optimizers(model)
        >>> torch.save(opt.state_dict(), "opt.pt")
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_optimizers takes an nn.Module, got {type(model).__name__}")
    prefixes = ddp_prefixes(model)
    refuse_lost(model, lambda fqn: unwrapped_name(unwrapped_path(fqn), prefixes))
    tables, foreign, annotated, bare = _discover(model)
    if bare and module_record(model).warned_bare != sorted(bare):
        module_record(model).warned_bare = sorted(bare)  # once per model and set of parameters
        warnings.warn(
            f"{len(bare)} trainable parameter(s) have no in-backward optimizer and are not updated by "
            f"get_optimizers(): {sorted(bare)}; overlap_optim.unoptimized_parameters(model) returns them "
            "for your own optimizer",
            stacklevel=2,
        )
    in_backward = InBackwardOptimizer(annotated, tables)
    in_backward._tracker = track_steps(model)
    in_backward._tracker.optimizers.add(in_backward)
    _check_before_forward(model, in_backward)
    if not foreign:
        return in_backward
    # Modules sharded by another sharder keep TorchRec's plan-dependent keys.
    # CombinedOptimizer wants one policy for saving param groups: TorchRec's (off).
    in_backward.save_param_groups(_private.saves_param_groups(foreign[0][1]))
    return CombinedOptimizer([*foreign, ("", in_backward)])


def _check_before_forward(model: torch.nn.Module, optimizer: InBackwardOptimizer) -> None:
    """Before each forward of ``model``, :meth:`DenseSettings.refuse_changes` of its dense groups, and
    :meth:`InBackwardOptimizer.refuse_unloaded_template` of every live keyed optimizer built for it
    (one hook per model, which holds them weakly)."""
    found = module_record(model)
    if found.keyed_optimizers is None:
        found.keyed_optimizers = weakref.WeakSet()
        model.register_forward_pre_hook(_refuse_before_forward)
    found.keyed_optimizers.add(optimizer)
    found.dense_settings = DenseSettings(optimizer.param_groups_by_key())


def _refuse_before_forward(model: torch.nn.Module, _inputs: Any) -> None:
    found = module_record(model)
    if found.dense_settings is not None:
        found.dense_settings.refuse_changes()
    for optimizer in list(found.keyed_optimizers or ()):
        optimizer.refuse_unloaded_template()


class DenseSettings:
    """The fixed settings of a model's annotation groups of dense parameters, checked before each
    forward (:func:`get_optimizers` installs it; it outlives the keyed optimizer, whose param groups
    are these groups' own dicts).

    A setting the annotation fixed, changed in a param group (by hand, or by ``load_state_dict``), is
    refused by the parameters' own steps too, but in backward, after other groups had stepped; here
    it is refused before anything steps. A group is checked only when its settings differ from those
    it last passed with. Groups of tables alone are left to their sharder, which checks them by table
    before the lookup (``sharders/live_settings.py``).

    Args:
        keys: each group of dense parameters, with the keys (FQNs) of its parameters and tables.
    """

    def __init__(self, keys: list[tuple[AnnotationGroup, list[str]]]) -> None:
        self.keys = keys
        self.passed: dict[int, tuple] = {}  # id(group) -> its settings when they last passed

    def refuse_changes(self) -> None:
        """Raise ValueError, naming the group's parameters and the setting, for a fixed setting changed."""
        for group, keys in self.keys:
            now = settings_of(group.param_group)
            if self.passed.get(id(group)) != now:
                names = f"{', '.join(sorted(keys)[:4])}{' ...' if len(keys) > 4 else ''}"
                group.spec.check_live(group.param_group, f"param group {group.index} ({group.spec.name}: {names})")
                self.passed[id(group)] = now


def unoptimized_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters that ``get_optimizers(model)`` does not update, by FQN.

    Build your own optimizer over them (``torch.optim`` or TorchRec's
    ``KeyedOptimizerWrapper``). They include the tables a sharder left without
    an annotation: their gradient is on the sharded weight's ``.grad`` after
    backward (this rank's shards; a table held by another rank is absent).

    Example:
        >>> user_opt = torch.optim.Adagrad(overlap_optim.unoptimized_parameters(model).values(), lr=0.01)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"unoptimized_parameters takes an nn.Module, got {type(model).__name__}")
    return dict(_discover(model)[3])


def _discover(model: torch.nn.Module) -> tuple[list, list, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(our sharded tables, other sharded modules, annotated parameters, bare trainable parameters)."""
    tables, foreign = _sharded_modules(model)
    covered = {_join(path, k) for path, t in tables for k in t.keys()}
    # By key: a fused optimizer may hold a ShardedTensor where the module has a view.
    covered |= {CombinedOptimizer.prepend_opt_key(k, path) for path, opt in foreign for k in opt.params}
    annotated: dict[str, torch.Tensor] = {}
    bare: dict[str, torch.Tensor] = {}
    for name, param in unwrapped_parameters(model):
        if name in covered:
            continue
        if group_of(param) is not None:
            annotated[name] = param
        elif param.requires_grad and param.numel() > 0:
            bare[name] = param
    return tables, foreign, annotated, bare


def unwrapped_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` named as in the unwrapped model (see :func:`unwrapped_name`)."""
    prefixes = ddp_prefixes(model)
    for name, param in model.named_parameters():
        yield unwrapped_name(name, prefixes), param


def ddp_prefixes(model: torch.nn.Module) -> list[str]:
    """The name prefixes, ``<path>.module.``, of the DistributedDataParallel (sub)modules of ``model``."""
    prefixes = []
    for path, module in model.named_modules():
        if isinstance(module, DistributedDataParallel) and path != _private.DMP_WRAPPED:
            clean = unwrapped_path(path)  # DMP's own names are already clean
            prefixes.append(f"{clean}.module." if clean else "module.")
    return prefixes


def unwrapped_name(name: str, prefixes: list[str]) -> str:
    """``name`` without the ``module.`` a DDP wrapper adds: a model whose parts were wrapped
    one by one gets the same names as under DistributedModelParallel, and as unwrapped."""
    for prefix in prefixes:
        if name.startswith(prefix):
            name = prefix[: -len("module.")] + name[len(prefix) :]
    return name


def unwrapped_path(path: str) -> str:
    """A module path without DistributedModelParallel's (and its DDP's) wrapper names."""
    for wrapper in (f"{_private.DMP_WRAPPED}.module.", f"{_private.DMP_WRAPPED}."):
        if path.startswith(wrapper):
            return path[len(wrapper) :]
    return path


def _sharded_modules(model: torch.nn.Module) -> tuple[list[tuple[str, Any]], list[tuple[str, KeyedOptimizer]]]:
    """(path, TableStates) of modules our sharders planned, and (path, fused_optimizer)
    of the outermost other sharded modules."""
    ours: list[tuple[str, Any]] = []
    foreign: list[tuple[str, KeyedOptimizer]] = []
    for path, module in model.named_modules():
        if not isinstance(module, ShardedModule):
            continue
        path = unwrapped_path(path)
        plan = plans.plan_of(module)
        if plan is not None:
            ours.append((path, plan.state))
        elif isinstance(getattr(module, "fused_optimizer", None), KeyedOptimizer):
            if not any(_inside(path, outer) for outer, _ in foreign):
                foreign.append((path, module.fused_optimizer))
    return ours, foreign


def _join(path: str, key: str) -> str:
    """The FQN of ``key`` inside the module at ``path`` ("" for the root)."""
    return f"{path}.{key}" if path else key


def _inside(path: str, outer: str) -> bool:
    return outer == "" or path == outer or path.startswith(outer + ".")
