"""Atomic checkpoints of a model, its keyed optimizer and extra state, on torch.distributed.checkpoint.

A checkpoint directory holds one sub-directory per save, ``step-00000012``. Each
is written under a temporary name and renamed only once complete (with a
``COMPLETE`` marker inside), so a save killed at any point leaves the previous
checkpoints as they were; :func:`load` takes the latest complete one. Saving
over an existing step is atomic too: after a kill at any point, the old or the
new copy of that step is complete and loadable.

Loading validates everything before it changes anything: every key and shape is
checked against the checkpoint's metadata, the data is read into scratch copies,
and only then copied into the model, the optimizer and the extra objects. On
any error the model, optimizer and extras are exactly as they were.

Models may be unsharded (one process, or replicated with DDP) or sharded
(``DistributedModelParallel`` with :mod:`sharders`). Weights and optimizer state
are saved by their unsharded names and shapes (sharded tables as
``ShardedTensor``, see ``get_optimizers``), so a checkpoint loads into another
sharding plan, another world size, or the unsharded model in one process:
``torch.distributed.checkpoint`` reads each rank's pieces from whatever pieces
were saved. Under ``torch.distributed``, :func:`save` and :func:`load` are
collectives: call them on every rank.

Weights keep their dtype: one saved in another dtype than the model holds is refused, naming it
with both dtypes, unless the cast is asked for (:func:`load`'s ``cast=True``). :class:`LoadPlanner`
is the same rule for a plain ``dcp.load``, :func:`refuse_other_dtypes` the rule itself (also run by
our sharded collections' ``load_state_dict``).

:func:`sharders.from_torchrec` converts a stock TorchRec ``fused_optimizer.state_dict()``
(its kernels' names, plan-dependent keys) into this form, for ``load_state_dict``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from overlap_optim import local_sgd
from overlap_optim._state_schema import PLACEHOLDERS, agree
from overlap_optim._private import Shard, ShardedTensor, sharded_tensor_from_local_shards, sharded_tensor_process_group
from overlap_optim.keyed import ddp_prefixes, unwrapped_name, unwrapped_path
from overlap_optim.record import module_record_of

__all__ = ["save", "load", "latest", "CheckpointError", "LoadPlanner", "refuse_other_dtypes"]


def __getattr__(name: str) -> Any:
    """``from_torchrec`` moved to ``sharders`` (it reads TorchRec's kernels' state): say where."""
    if name == "from_torchrec":
        raise AttributeError("overlap_optim.checkpoint.from_torchrec moved: use sharders.from_torchrec (docs/migration.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# DCP reports read failures as CheckpointException, a BaseException.
_READ_ERRORS = (Exception, CheckpointException)
_NAME = re.compile(r"^step-(\d{8,})$")
_INTERRUPTED = re.compile(r"^\.tmp-step-(\d{8,})-[0-9a-f]+$")
_MARKER = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; nothing was changed."""


def _rank_local_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any] | None:
    """Between two averagings of local SGD the ranks hold different dense parameters, and DCP keeps
    one copy of a replicated tensor. Then each rank's own dense parameters and their optimizer
    state, by name, to be saved in a file of its own; None when no local-SGD round is open."""
    open_rounds = [s for s in local_sgd.attached(model) if s.mid_round()]
    managed = {id(p) for s in open_rounds for p in s._model.params}
    prefixes = ddp_prefixes(model)
    names = [unwrapped_name(n, prefixes) for n, p in model.named_parameters() if id(p) in managed]
    if not names:
        return None
    optim_state = optimizer.state_dict()["state"]
    params = _model_state(model)
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "params": {n: params[n].detach().clone() for n in names},
        "optim": {n: optim_state[n] for n in names if n in optim_state},
    }


def _rank_file(directory: Path, world_size: int) -> Path:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return directory / f"local-sgd-rank-{rank}-of-{world_size}.pt"


def _read_rank_local(directory: Path) -> dict[str, Any] | None:
    """This rank's own dense state, if the checkpoint was taken between averagings; refused on
    another world size, where no rank's copy is the right one."""
    files = sorted(directory.glob("local-sgd-rank-*-of-*.pt"))
    if not files:
        return None
    saved_world = int(re.search(r"-of-(\d+)\.pt$", files[0].name).group(1))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != saved_world:
        raise CheckpointError(
            f"checkpoint {directory.name} was taken between two local-SGD averagings on {saved_world} ranks, "
            f"where each rank's dense parameters differ: it loads on {saved_world} ranks only, not {world}. "
            "Take checkpoints to reshard right after an averaging (QSR.average_now())"
        )
    return torch.load(_rank_file(directory, world), weights_only=False)


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any, extra: dict[str, Any] | None = None) -> Path:
    """Save ``model``, ``optimizer`` and ``extra`` as the next checkpoint under ``path``.

    Args:
        path: the checkpoint directory (created if missing).
        model: the model; its ``state_dict()`` is saved.
        optimizer: ``overlap_optim.get_optimizers(model)`` (any object with
            ``state_dict``/``load_state_dict`` whose state is keyed by name).
        extra: more state by name: objects with ``state_dict()`` (an LR
            scheduler, an ``overlap_optim.QSR``) are saved through it, anything
            else as is. ``extra["step"]`` (an int) names the checkpoint; without
            it, the step is one more than the latest checkpoint's.

    Between two averagings of local SGD (``overlap_optim.QSR``) the ranks' dense
    parameters differ: each rank then also saves its own dense parameters and
    their optimizer state, and the checkpoint resumes exactly on the same world
    size (only there).

    Returns:
        The directory of the new checkpoint.

    Example:
        >>> checkpoint.save("ckpt", model, opt, {"scheduler": sched, "step": step})
    """
    root = Path(path)
    extra = dict(extra or {})
    step = extra.get("step")
    if step is None:
        previous = latest(root)
        step = 0 if previous is None else _step_of(previous) + 1
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"extra['step'] must be a non-negative int, got {step!r}")
    extra["step"] = step
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}-{_shared_token()}"
    state = {"model": _model_state(model), "optim": optimizer.state_dict(), "extra": _extra_states(extra)}
    local = _rank_local_state(model, optimizer)
    if _is_writer():
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if local is not None:  # every rank its own file, inside the checkpoint before it is complete
        torch.save(local, _rank_file(tmp, local["world_size"]))
        _barrier()
    if _is_writer():
        (tmp / _MARKER).write_text(json.dumps({"step": step}))
        _swap_in(tmp, final)
    _barrier()
    return final


def _swap_in(tmp: Path, final: Path) -> None:
    """Make the complete ``tmp`` the checkpoint ``final``, replacing an older one of the same step.

    Each step is one rename, so a kill at any point leaves a complete copy that
    :func:`latest` finds: the old ``final``; or, while ``final`` is briefly
    absent, the complete ``tmp`` (the new one); or the new ``final``. A set-aside
    old copy is removed last and never read.
    """
    old = final.with_name(f".old-{final.name}-{tmp.name.rsplit('-', 1)[-1]}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def latest(path: str | os.PathLike) -> Path | None:
    """The latest complete checkpoint under ``path``, or None."""
    root = Path(path)
    if not root.is_dir():
        return None
    complete = {_step_of(d): d for d in root.iterdir() if _NAME.match(d.name) and (d / _MARKER).is_file()}
    for d in root.iterdir():  # a save killed between its two renames: its complete new copy
        interrupted = _INTERRUPTED.match(d.name)
        if interrupted and (d / _MARKER).is_file():
            complete.setdefault(int(interrupted.group(1)), d)
    return complete[max(complete)] if complete else None


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any, extra: dict[str, Any] | None = None,
         *, cast: bool = False) -> dict[str, Any]:
    """Load the latest complete checkpoint under ``path`` (or ``path`` itself, if it is one).

    ``optimizer`` may be fresh: its lazy state is created first (``init_state``).
    Objects in ``extra`` with ``load_state_dict`` (an LR scheduler) are restored in place.

    A weight saved in another dtype than the model holds (an FP32 table loaded into an FP16 one, or
    the other way) is refused, unless ``cast=True``: then it is cast once, rounded to nearest even.

    Returns:
        The saved extras, by name (``"step"`` included).

    Raises:
        CheckpointError: no complete checkpoint; keys missing or unexpected
            (both listed); a shape that differs; another optimizer's state;
            a truncated or corrupt file; a checkpoint of another model; a
            checkpoint taken between two local-SGD averagings, loaded on another
            world size; a weight of another dtype, without ``cast``. Nothing is changed.
    """
    directory = _resolve(Path(path))
    _check_dtypes(directory, _model_state(model), cast)
    saved_extra = _read_extras(directory)
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):  # DCP loads in place: lazy state must exist first
        init_state()
    try:
        scratch = _read_validated(directory, model, optimizer)
        _run_load_checks(model, scratch["model"])
        local = _read_rank_local(directory)
        if local is not None:  # taken between averagings: this rank's own dense state
            scratch["model"].update(local["params"])
            scratch["optim"]["state"].update(local["optim"])
        optimizer.load_state_dict(scratch["optim"])  # validates before changing anything
    except BaseException:
        # A refused load leaves no placeholder state behind: nothing changed.
        drop = getattr(optimizer, "drop_placeholder_state", None)
        if callable(drop):
            drop()
        raise
    prefixes = ddp_prefixes(model)
    own = {unwrapped_name(k, prefixes): k for k in model.state_dict()}
    model.load_state_dict({own[k]: v for k, v in scratch["model"].items()})
    for name, obj in (extra or {}).items():
        if hasattr(obj, "load_state_dict") and name in saved_extra:
            obj.load_state_dict(saved_extra[name])
    return saved_extra


def _run_load_checks(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """The checks sharders installed on ``model``'s modules (their records' ``load_checks``), each on
    the part of the model state (``state``, under unwrapped names) below its module."""
    prefixes = ddp_prefixes(model)
    for path, module in model.named_modules():
        found = module_record_of(module)
        if found is None or not found.load_checks:
            continue
        start = unwrapped_name(unwrapped_path(path + "."), prefixes) if path else ""  # "" under DMP's root too
        below = {k[len(start):]: v for k, v in state.items() if k.startswith(start)}
        for check in found.load_checks:
            check(below)


def _read_validated(directory: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The checkpoint's model and optimizer state, checked against ours and read into scratch copies."""
    wanted = {"model": _model_state(model), "optim": optimizer.state_dict()}
    saved = _check_against_metadata(directory, wanted)
    if f"optim.{PLACEHOLDERS}" not in saved:  # written before state dicts listed their placeholders
        wanted["optim"].pop(PLACEHOLDERS, None)
    _read_param_groups_as_saved(wanted, saved)
    scratch = _scratch_copy(wanted)
    try:  # dtypes were checked (_check_dtypes): cast if asked
        dcp.load(scratch, checkpoint_id=str(directory), planner=LoadPlanner(cast=True))
    except _READ_ERRORS as err:  # a damaged file surfaces in many forms
        raise CheckpointError(f"cannot read checkpoint {directory}: {type(err).__name__}: {err}") from None
    return scratch


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` under the unwrapped names (no DDP ``module.``), so that a checkpoint
    moves between a model wrapped part by part and the same model under DistributedModelParallel."""
    prefixes = ddp_prefixes(model)
    return {unwrapped_name(k, prefixes): v for k, v in model.state_dict().items()}


def _check_against_metadata(directory: Path, wanted: dict[str, Any]) -> set[str]:
    """Refuse a checkpoint whose tensors' keys or shapes differ from ``wanted``'s; its keys."""
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except _READ_ERRORS as err:
        raise CheckpointError(f"cannot read checkpoint metadata in {directory}: {type(err).__name__}: {err}") from None
    expected = _flat_tensors(wanted)
    saved = {k: v.size for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    saved_model = {k for k in metadata if k.startswith("model.")}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted((set(saved) - set(expected)) | (saved_model - {k for k in expected if k.startswith("model.")}))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {directory.name} does not match this model and optimizer: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    for key, shape in expected.items():
        if tuple(saved[key]) != shape:
            raise CheckpointError(f"shape mismatch for {key}: checkpoint {tuple(saved[key])}, model {shape}")
    return set(metadata)


def _check_dtypes(directory: Path, model_state: dict[str, Any], cast: bool) -> None:
    """Refuse model tensors saved in another dtype than the model holds, unless ``cast``."""
    if cast:
        return
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except _READ_ERRORS:
        return  # reported, with its cause, where the checkpoint is read
    refuse_other_dtypes({k: metadata.get(f"model.{k}") for k in model_state}, model_state,
                        f"checkpoint {directory.name}", "pass cast=True to cast them once (to nearest even)")


def refuse_other_dtypes(saved: Mapping[str, Any], held: Mapping[str, Any], source: str, how_to_cast: str,
                        group: Any = None) -> None:
    """Raise :class:`CheckpointError` naming each weight whose saved dtype differs from the held one.

    The one rule of every load form (:func:`load`, :class:`LoadPlanner`, a sharded collection's
    ``load_state_dict``): a weight keeps its dtype unless the user asks for the cast. Keys in only
    one of ``saved`` and ``held`` are left to the key checks.

    Args:
        saved: by key, what was saved: a tensor, a ``ShardedTensor`` (its metadata's dtype and its
            local shards'), or DCP's ``TensorStorageMetadata``; anything else is skipped.
        held: by key, the model's tensor or ``ShardedTensor``.
        source: what was saved, for the message ("checkpoint step-00000003", "the state dict").
        how_to_cast: how the user asks for the cast in this load form.
        group: a process group whose ranks all call this: each rank's mismatches (a local shard's
            dtype is the rank's own) are gathered, and every rank raises the same error. None: the
            mismatches are the same on every rank by construction (the checkpoint's metadata).

    Raises:
        CheckpointError: some weight's dtypes differ, listing each as
            ``"<key>: saved <dtype>, the model holds <dtype>"``.
    """
    differ = []
    for key in saved.keys() & held.keys():
        ours, theirs = _dtypes(held[key]), _dtypes(saved[key])
        if ours and theirs and theirs != ours:
            differ.append(f"{key}: saved {_names(theirs)}, the model holds {_names(ours)}")
    differ = sorted(set().union(*agree(group, None, differ)))
    if differ:
        raise CheckpointError(
            f"{source} holds weights in another dtype than the model: {differ}; {how_to_cast}, or build the "
            "tables with the dtype they were saved in"
        )


def _dtypes(value: Any) -> set[torch.dtype]:
    if isinstance(value, TensorStorageMetadata):
        return {value.properties.dtype}
    if isinstance(value, ShardedTensor):
        return {value.metadata().tensor_properties.dtype} | {s.tensor.dtype for s in value.local_shards()}
    if isinstance(value, torch.Tensor):
        return {value.dtype}
    return set()


def _names(dtypes: set[torch.dtype]) -> str:
    return " and ".join(sorted(str(d) for d in dtypes))


class LoadPlanner(dcp.DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s load planner for sharded models that keeps dtypes.

    torch's ``DefaultLoadPlanner`` reads each saved tensor into the destination with ``copy_``,
    casting silently: an FP32 checkpoint loads into an FP16 table, rounded, without a word. This
    planner compares the checkpoint's metadata with the destination before anything is read, and
    refuses every tensor of the model's entry saved in another dtype, naming each with both dtypes
    (a ``CheckpointError``, the same on every rank; ``dcp.load`` raises it inside its
    ``CheckpointException``, one per rank). With ``cast=True`` it reads as torch's does: each such
    tensor cast once, to nearest even. It keeps ``ShardedTensor`` entries whole
    (``flatten_sharded_tensors=False``): torch's default drops those with no piece on this rank, then
    takes their absence for a checkpoint of before torch 2.4 and reads the template in that layout,
    where a scheduler's state is one entry. It also reads an optimizer state dict whose
    ``param_groups`` were saved as a list, one entry per hyperparameter.

    Args:
        cast: cast weights of another dtype instead of refusing them.
        weights: the top-level entry of the state dict that holds the model's ``state_dict()``;
            the optimizer's state (float32 by default, or cast as its ``state_dtype`` says) is not
            checked.
        **kwargs: ``DefaultLoadPlanner``'s other arguments (``allow_partial_load``).

    Raises:
        TypeError: ``cast`` is not a bool, or ``weights`` not a string.

    Example:
        >>> state = {"model": model.state_dict(), "optim": opt.state_dict()}
        >>> dcp.load(state, checkpoint_id=path, planner=checkpoint.LoadPlanner())
    """

    def __init__(self, cast: bool = False, *, weights: str = "model", **kwargs: Any) -> None:
        if not isinstance(cast, bool):
            raise TypeError(f"LoadPlanner: cast takes True or False, got {cast!r}")
        if not isinstance(weights, str):
            raise TypeError(f"LoadPlanner: weights takes the name of the state dict's model entry, got {weights!r}")
        super().__init__(flatten_sharded_tensors=False, **kwargs)
        self.cast = cast
        self.weights = weights

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        """torch's, then the refusal: DCP calls it on every rank before it reads anything. An
        optimizer state dict whose ``param_groups`` were saved as a list is read in that layout."""
        if metadata is not None:
            _read_param_groups_as_saved(state_dict, set(metadata.state_dict_metadata))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.cast or metadata is None:
            return
        ours = {k: v for k, v in self.state_dict.items() if k.startswith(f"{self.weights}.")}
        saved = {k: metadata.state_dict_metadata.get(k) for k in ours}
        refuse_other_dtypes(saved, ours, "the checkpoint",
                            "pass overlap_optim.checkpoint.LoadPlanner(cast=True) to cast them once (to nearest even)")


def _read_param_groups_as_saved(state_dict: dict[str, Any], saved: set[str]) -> None:
    """Give each optimizer state dict in ``state_dict`` (a load template) the layout in which a
    checkpoint with the keys ``saved`` holds its ``param_groups``.

    Our keyed optimizer's ``param_groups`` is a tuple, one entry for DCP (``"optim.param_groups"``).
    A checkpoint whose ``param_groups`` were saved as a list (by an optimizer whose groups are a
    list, or by overlap-optim's earlier format) holds one entry per hyperparameter
    (``"optim.param_groups.0.lr"``): the template's tuple becomes a list of dicts with those names,
    which DCP fills.
    """
    for key, value in state_dict.items():
        prefix = f"{key}.param_groups"
        if not isinstance(value, dict) or not isinstance(value.get("param_groups"), tuple) or prefix in saved:
            continue
        groups: dict[int, dict[str, Any]] = {}
        for name in saved:
            index, _, field = name[len(prefix) + 1 :].partition(".")
            if name.startswith(prefix + ".") and index.isdigit() and field:
                groups.setdefault(int(index), {})[field] = None
        if groups:
            value["param_groups"] = [groups[i] for i in sorted(groups)]


def _flat_tensors(tree: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flat_tensors(value, f"{prefix}{key}."))
    elif isinstance(tree, ShardedTensor):
        out[prefix[:-1]] = tuple(tree.metadata().size)
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tuple(tree.shape)
    return out


def _scratch_copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _scratch_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_scratch_copy(v) for v in tree]
    if isinstance(tree, ShardedTensor):  # same pieces, fresh storage
        shards = [Shard(torch.empty_like(s.tensor), s.metadata) for s in tree.local_shards()]
        return sharded_tensor_from_local_shards(shards, tree.metadata(), sharded_tensor_process_group(tree))
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    return tree


def _extra_states(extra: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in extra.items()}


def _read_extras(directory: Path) -> dict[str, Any]:
    """The saved extras, read alone (their structure is not known in advance)."""
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except _READ_ERRORS as err:
        raise CheckpointError(f"cannot read checkpoint metadata in {directory}: {type(err).__name__}: {err}") from None
    tree = _nest({k: None for k in metadata if k.startswith("extra.")})
    if not tree:
        return {}
    try:
        dcp.load(tree, checkpoint_id=str(directory))
    except _READ_ERRORS as err:  # a damaged file surfaces in many forms
        raise CheckpointError(f"cannot read checkpoint {directory}: {type(err).__name__}: {err}") from None
    return tree["extra"]


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _lists(tree)


def _lists(node: Any) -> Any:
    """DCP flattens a list of dicts into keys ``name.0``, ``name.1``...: make those lists again."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and sorted(node) == sorted(str(i) for i in range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def _resolve(path: Path) -> Path:
    if (path / _MARKER).is_file():
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {path}")
    return found


def _step_of(directory: Path) -> int:
    return int((_NAME.match(directory.name) or _INTERRUPTED.match(directory.name)).group(1))


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shared_token() -> str:
    """One random name for the temporary directory, the same on every rank."""
    token = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]
