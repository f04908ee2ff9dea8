"""The gradient path: what happens to a final gradient before the update that reads it.

Whoever holds a gradient once it is final (a parameter's hook, a DDP bucket, an FSDP group, a
layer-wise step across FSDP shards, a table kernel, a fused kernel's held backward) hands it to
:func:`take` with the update that reads it, and the path is the same for all of them:

1. **Window.** Inside :func:`overlap_optim.no_step` nothing steps. A participant whose gradient
   torch accumulates on ``.grad`` keeps nothing; one that holds it elsewhere says how it would
   keep it (:class:`Keep`), and the window keeps it: summed, by key, on the model's
   :class:`~overlap_optim.accumulation.Window`. The micro-batch that closes the window gets the
   sums back, each with its own gradient added, and steps on them.
2. **Clip.** In a clipping set (:mod:`overlap_optim.clipping`), by value: the gradients are
   clamped now. By norm: they join the set's norm and wait for the CLIP phase of the
   end-of-backward round (:mod:`overlap_optim.round`).
3. **Step.** The update runs on the gradients, now or once clipped. If the set refuses the step
   (a non-finite norm with ``error_if_nonfinite``), ``release`` runs instead: the participant
   frees what the update would have freed, so that the next step starts clean, as a torch loop
   that skips the step and zeroes the gradients does.

Every participant hands ``take`` the gradients its update reads, so a step added to every
gradient (unscaling for AMP, say) would be added here, once; no participant keeps an
accumulator of its own or asks the window anything.

Example:
    >>> take(lambda grads: step_param(p), [p.grad], clip=clipping_of(p), window=window_of_params(p))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch

from overlap_optim.accumulation import Window
from overlap_optim.clipping import GradientClipping

__all__ = ["take", "Keep", "releasing_grad"]


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Keep:
    """How the window keeps a participant's gradients, handed to :func:`take` as ``(key, value)``
    pairs (one per table, per parameter...).

    Attributes:
        owner: the participant (its gradients are kept apart from every other's).
        add: ``add(kept, new)``, the sum of two values (it may reuse the storage of ``kept``).
        own: a value of this micro-batch made the window's, as it is kept and clipped: a copy where
            the participant reuses its buffers, a sum where it repeats keys; by default itself.
        tensors: the gradient tensors of a value, which clipping scales; by default the value.
    """

    owner: Hashable
    add: Callable[[Any, Any], Any]
    own: Callable[[Any], Any] = _same
    tensors: Callable[[Any], Sequence[torch.Tensor]] = lambda value: [value]


def take(
    step: Callable[[Any], None],
    grads: Any = (),
    *,
    clip: GradientClipping | None,
    window: Window | None = None,
    keep: Keep | None = None,
    replicated: bool = False,
    norm: Callable[[Any], torch.Tensor] | None = None,
    release: Callable[[], None] | None = None,
) -> bool:
    """Run ``step(grads)``, the update that reads ``grads``, after the window and the clipping.

    Args:
        step: the update, handed the gradients it reads (clipped in place, or, with ``norm``, read
            with ``clip.coefficient``).
        grads: the gradients: a list of tensors; with ``keep``, ``(key, value)`` pairs, an iterable
            read once (a participant may form them as they are read: with no window to close and no
            clipping, ``step`` reads them so).
        clip: their clipping set, or None.
        window: the window of the participant's model (None where no ``no_step`` ever ran).
        keep: how the window keeps ``grads`` (None: torch accumulates them on ``.grad``, nothing is
            kept here).
        replicated: every rank holds these very gradients (DDP-averaged): rank 0 alone adds
            them to the norm.
        norm: for a participant whose kernel forms the gradient inside its update: its own
            partial norm of ``grads``, made only if needed (see
            :meth:`~overlap_optim.clipping.GradientClipping.hold`).
        release: what runs instead of ``step`` when the clipping set refuses the step: free what
            ``step`` would have freed, update nothing (None: nothing to free).

    Returns:
        False where the window kept the gradients (nothing steps); True where the step ran or
        waits for the clipping round.
    """
    if window is not None and window.open:
        if keep is not None:
            held = window.kept.setdefault(keep.owner, {})
            for key, value in grads:
                held[key] = keep.own(value) if key not in held else keep.add(held[key], value)
        return False
    if keep is not None:
        kept = window.kept.get(keep.owner) if window is not None else None
        if kept:  # the micro-batch that closes the window: each key's sum, its own gradient added
            grads = _closing(window, keep, kept, grads, owned=clip is not None)
            if clip is not None:  # clipping reads them all before the step
                grads = list(grads)
        elif clip is not None:
            grads = [(key, keep.own(value)) for key, value in grads]
    if clip is None:
        step(grads)
        return True
    clip.arm()  # from backward's thread, first in this backward; anywhere else, armed already
    then = _bound(step, grads)
    if norm is not None:
        clip.hold(norm(grads), then, release=release)
    else:
        tensors = list(grads) if keep is None else [t for _, value in grads for t in keep.tensors(value)]
        clip.clip(tensors, then, replicated=replicated, release=release)
    return True


def _closing(window: Window, keep: Keep, kept: dict[Hashable, Any], grads: Iterable[tuple[Hashable, Any]],
             owned: bool) -> Iterator[tuple[Hashable, Any]]:
    """``grads`` with what the window kept under their keys added (``owned``: the others made the
    window's, as clipping reads them), as they are read; the window forgets what it handed back."""
    for key, value in grads:
        if key in kept:
            yield key, keep.add(kept.pop(key), value)
        else:
            yield key, keep.own(value) if owned else value
    if not kept:
        window.kept.pop(keep.owner, None)


def _bound(step: Callable[[Any], None], grads: Any) -> Callable[[], None]:
    return lambda: step(grads)


def releasing_grad(param: torch.Tensor) -> Callable[[], None]:
    """The ``release`` of a participant whose gradient lives on ``param.grad``: it sets it to None,
    as the update does once it has read it."""

    def release() -> None:
        param.grad = None

    return release
