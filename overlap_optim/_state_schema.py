"""Checks of a saved optimizer state against the model it is loaded into.

Each check raises ``ValueError`` naming the offending key and changes nothing,
so a loader can run them all before it mutates any state. With several ranks,
:func:`agree` makes every rank raise the same error before any of them goes on
to a collective, and :func:`whole_tensor` gathers a ``ShardedTensor`` split
by another plan than the one it is loaded into.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlap_optim import _private
from overlap_optim._private import ShardedTensor
from overlap_optim.record import group_of

# The state dict entry listing the keys whose state is a placeholder: state made so that a state
# dict always carries every entry (a template that dcp.load fills in place), which a parameter
# that has not stepped yet does not have in torch.optim. Loading it gives such a key no state.
PLACEHOLDERS = "placeholders"




class _Shape(tuple):
    """The expected shape of a state tensor (a plain tuple is a saved value)."""


def split(state_dict: Any) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """The ``state`` and ``param_groups`` entries, checked for form; a key listed in
    ``placeholders`` has empty state."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise ValueError(
            "not an optimizer state dict: expected a mapping with a 'state' mapping, got "
            f"{type(state_dict).__name__} with keys {sorted(state_dict) if isinstance(state_dict, Mapping) else '-'}"
        )
    groups = state_dict.get("param_groups")
    if groups is not None and not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise ValueError("param_groups must be a list of mappings, each with 'params'")
    state = dict(state_dict["state"])
    placeholders = state_dict.get(PLACEHOLDERS, [])
    if not isinstance(placeholders, (list, tuple)) or not all(isinstance(k, str) for k in placeholders):
        raise ValueError(f"{PLACEHOLDERS!r} must be a list of parameter names, got {placeholders!r}")
    for key in placeholders:  # saved before their first step: no state, as in torch.optim
        if key in state:
            state[key] = {}
    return state, None if groups is None else [dict(g) for g in groups]


def check_keys(
    params: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    groups: list[dict[str, Any]] | None,
) -> None:
    """Every saved key must name a parameter, and every parameter must be saved.

    A parameter that never stepped has no state, so the saved param groups,
    when present, say which parameters the saving side had.
    """
    saved = set(state)
    if groups is not None:
        saved |= {key for g in groups for key in g["params"]}
    missing = sorted(set(params) - saved)
    unexpected = sorted(saved - set(params))
    if missing or unexpected:
        names = [n for s in state.values() if isinstance(s, Mapping) for n in s]
        raise ValueError(
            f"optimizer state does not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected}{stock_hint(names)}"
        )


def stock_hint(names: Any) -> str:
    """A pointer to the converter when state ``names`` are qualified by a table's name
    (``"t0.momentum1"``), as stock TorchRec's ``fused_optimizer.state_dict()`` names them (a
    torch.optim state name has no dot); else nothing."""
    if any("." in str(n) for n in names):
        return (". State names qualified by a table's name: this is stock TorchRec's fused_optimizer.state_dict(); "
                "convert it with sharders.from_torchrec(state_dict, model, fused_params) (docs/migration.md)")
    return ""


def check_param_state(key: str, param: torch.Tensor, saved: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one parameter's saved state and return a private copy of it.

    The names must be those the parameter's optimizer keeps, and each tensor
    must have the shape that optimizer would give it for this parameter.
    """
    if not saved:
        return {}
    if param.is_meta:
        raise ValueError(f"{key!r} is still on the meta device: materialize the model before loading")
    expected = _expected_state(param)
    cls = group_of(param).optimizer_class.__name__
    if set(saved) != set(expected):
        raise ValueError(
            f"optimizer mismatch for {key!r}: saved state names {sorted(saved)}, but its "
            f"{cls} keeps {sorted(expected)}{stock_hint(saved)}"
        )
    copy = {}
    for name, value in saved.items():
        want = expected[name]
        if isinstance(want, _Shape):
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"shape mismatch for {key!r} state {name!r}: saved {got}, "
                    f"expected {tuple(want)} for a parameter of shape {tuple(param.shape)}"
                )
            device = param.device if value.dim() else value.device
            copy[name] = value.detach().to(device=device, copy=True)
        else:
            copy[name] = value
    return copy


def _expected_state(param: torch.Tensor) -> dict[str, Any]:
    """``name -> shape`` (tensors) or a non-tensor value, from the param's optimizer model."""
    return {
        name: _Shape(value) if isinstance(value, tuple) else value
        for name, value in group_of(param).spec.state_shapes(param.shape).items()
    }


def signature(state: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Per key, its state names and which of them are ``ShardedTensor``s: what every rank's copy of
    a state dict must have alike before a collective reads it."""
    return [(key, tuple(sorted(s)), tuple(sorted(n for n, v in s.items() if isinstance(v, ShardedTensor))))
            for key, s in sorted(state.items())]


def agree(group: Any, failure: Exception | None, facts: Any = None) -> list[Any]:
    """Every rank's ``facts``, once every rank has reached this point. If any rank has a
    ``failure`` (its own check failed), or ranks' facts' signatures differ, every rank raises
    the lowest such rank's error, naming it: no rank goes on to a collective alone. Without
    several ranks in ``group``, the local failure is raised as it is."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return [facts]
    local = (None if failure is None else (type(failure).__name__, str(failure)), facts)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    for rank, (error, _) in enumerate(gathered):
        if error is not None:
            cls = {"ValueError": ValueError, "TypeError": TypeError}.get(error[0], RuntimeError)
            raise cls(f"{error[1]} (found on rank {rank})") from failure
    return [f for _, f in gathered]


def whole_tensor(value: ShardedTensor) -> torch.Tensor:
    """``value`` as one plain tensor on every rank of its process group (a collective): each rank
    contributes its local shards."""
    group = _private.sharded_tensor_process_group(value)
    local = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()]
    gathered: list[Any] = [local]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    whole = torch.zeros(value.size(), dtype=value.dtype)
    for part in gathered:
        for offsets, tensor in part:
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))] = tensor
    return whole
