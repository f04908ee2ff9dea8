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

:func:`from_torchrec` converts a stock TorchRec ``fused_optimizer.state_dict()``
(FBGEMM's names, plan-dependent keys) into this form, for ``load_state_dict``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from overlap_optim import local_sgd
from overlap_optim._state_schema import PLACEHOLDERS
from overlap_optim._private import Shard, ShardedTensor, sharded_tensor_from_local_shards, sharded_tensor_process_group
from overlap_optim.keyed import ddp_prefixes, unwrapped_name
from overlap_optim.torchrec_checkpoint import from_torchrec

__all__ = ["save", "load", "latest", "CheckpointError", "from_torchrec"]

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


def _read_validated(directory: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The checkpoint's model and optimizer state, checked against ours and read into scratch copies."""
    wanted = {"model": _model_state(model), "optim": optimizer.state_dict()}
    saved = _check_against_metadata(directory, wanted)
    if f"optim.{PLACEHOLDERS}" not in saved:  # written before state dicts listed their placeholders
        wanted["optim"].pop(PLACEHOLDERS, None)
    scratch = _scratch_copy(wanted)
    # Flattening would drop sharded tensors with no piece on this rank, and DCP
    # would then take the checkpoint for its older format.
    planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False)
    try:
        dcp.load(scratch, checkpoint_id=str(directory), planner=planner)
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
    differ = []
    for key, value in model_state.items():
        saved = metadata.get(f"model.{key}")
        ours = value.metadata().tensor_properties.dtype if isinstance(value, ShardedTensor) else getattr(
            value, "dtype", None)
        if isinstance(saved, TensorStorageMetadata) and ours is not None and saved.properties.dtype != ours:
            differ.append(f"{key}: saved {saved.properties.dtype}, the model holds {ours}")
    if differ:
        raise CheckpointError(
            f"checkpoint {directory.name} holds weights in another dtype than the model: {differ}; pass "
            "cast=True to cast them once (to nearest even), or build the tables with the dtype they were saved in"
        )


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
