"""Optimizer state kept in low precision, opt-in per annotation (``state_dtype=``).

``apply_optimizer_in_backward(Adam, params, {"lr": 1e-3}, state_dtype=torch.bfloat16)`` keeps
each state tensor of those parameters in BF16 (or FP16) between steps: half the bytes of float32
state. The contract, and the reference the tests build in plain torch: each step is
``torch.optim``'s update in float32 (the stored state read in float32), and each state tensor is
rounded to ``state_dtype`` after the step, to nearest even. Step counters (0-d tensors) keep
their own dtype.

Every update of such a parameter runs inside :func:`in_float32`, which hands the step float32
working copies of the stored state and writes them back rounded: the per-parameter step, the
multi-tensor update of a virtual group (the DDP hook, FSDP2 groups), and the table optimizer of
a fallback table (which keeps its rows' state in ``state_dtype`` and reads the touched rows in
float32). A whole-shard or cross-shard table's step, whose two halves a round may separate, takes
:func:`working` copies when it starts and :func:`write_back` when it ends; so does the whole-table
step of an FP16 or BF16 data-parallel table (``sharders.replicated``). The fused kernels on CPU
cannot: such tables do not fuse.

Example:
    >>> apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.05}, state_dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["STATE_DTYPES", "check_state_dtype", "stored", "working", "write_back", "in_float32"]

STATE_DTYPES = (torch.bfloat16, torch.float16)


def check_state_dtype(state_dtype: object) -> torch.dtype | None:
    """``state_dtype`` as given to ``apply_optimizer_in_backward``: None (float32 state) or one of
    :data:`STATE_DTYPES`; float32 means None.

    Raises:
        ValueError: anything else, named.
    """
    if state_dtype is None or state_dtype == torch.float32:
        return None
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.bfloat16, torch.float16 or None (float32 state), got {state_dtype!r}")
    return state_dtype


def stored(value: Any, state_dtype: torch.dtype | None) -> Any:
    """``value`` as a state of ``state_dtype`` keeps it: a floating tensor with dims rounded to it
    (to nearest even); step counters and everything else as they are."""
    if state_dtype is None or not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.dim():
        return value
    return value.to(state_dtype)


def _working(value: Any) -> Any:
    """A float32 working copy of a stored low-precision state tensor (anything else as it is)."""
    if isinstance(value, torch.Tensor) and value.dtype in STATE_DTYPES:
        return value.float()
    return value


def working(states: list[dict[str, Any]], state_dtypes: list[torch.dtype | None]) -> list[dict[str, Any]]:
    """Float32 working dicts for ``states`` (one per tensor, each kept in its ``state_dtypes``
    entry): a new dict of float32 copies for a low-precision state, the dict itself for float32
    state (None). :func:`write_back` stores them once stepped."""
    return [state if dtype is None else {k: _working(v) for k, v in state.items()}
            for state, dtype in zip(states, state_dtypes)]


def write_back(
    states: list[dict[str, Any]], work: list[dict[str, Any]], state_dtypes: list[torch.dtype | None]
) -> None:
    """Write each stepped working dict of :func:`working` into its stored dict, rounded to its
    state dtype (to nearest even); the stored dicts stay the same objects (live optimizers hold them)."""
    for state, stepped, dtype in zip(states, work, state_dtypes):
        if dtype is not None:
            state.update({k: stored(v, dtype) for k, v in stepped.items()})


@contextlib.contextmanager
def in_float32(
    states: list[dict[str, Any]], state_dtypes: list[torch.dtype | None]
) -> Iterator[list[dict[str, Any]]]:
    """:func:`working` dicts for ``states`` (one per tensor, each kept in its ``state_dtypes``
    entry; None: float32, the dict itself); once the body has stepped them, :func:`write_back`.
    If the body raises, nothing is written back."""
    work = working(states, state_dtypes)
    yield work
    write_back(states, work, state_dtypes)
