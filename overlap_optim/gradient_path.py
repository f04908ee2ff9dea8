"""The gradient path: what happens to a final gradient before the update that reads it.

Whoever holds a gradient once it is final (a parameter's hook, a DDP bucket once
reduced, an FSDP group, a layer-wise step across FSDP shards, a fallback table
kernel, a fused kernel's held backward) hands it to :func:`take` with the update that
reads it, and the path is the same for all of them:

1. **Window.** Inside :func:`overlap_optim.no_step` the participant keeps its
   gradient (``keep``) and nothing steps (:mod:`overlap_optim.accumulation`).
2. **Clip.** In a clipping set (:mod:`overlap_optim.clipping`), by value: the
   gradient is clamped now. By norm: it joins the set's norm and waits for the
   CLIP phase of the end-of-backward round (:mod:`overlap_optim.round`).
3. **Step.** The update runs, now or once clipped. If the set refuses the step (a
   non-finite norm with ``error_if_nonfinite``), ``release`` runs instead: the
   participant frees what the update would have freed (its ``.grad``, what it held
   for the update), so that the next step starts clean, as a torch loop that skips
   the step and zeroes the gradients does.

A participant answers one question itself, whether its model's window is open
(it knows which tensors or module to ask); the rest is here. A step added to
every gradient (unscaling for AMP, say) is added here, once.

Example:
    >>> take(lambda: step_param(p), [p.grad], clip=clipping_of(p), held=accumulating(p))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from overlap_optim.clipping import GradientClipping

__all__ = ["take", "releasing_grad"]


def take(
    step: Callable[[], None],
    grads: Sequence[torch.Tensor] = (),
    *,
    clip: GradientClipping | None,
    held: bool = False,
    keep: Callable[[], None] | None = None,
    replicated: bool = False,
    norm: Callable[[], torch.Tensor] | None = None,
    release: Callable[[], None] | None = None,
) -> None:
    """Run ``step()``, the update that reads ``grads``, after the window and the clipping.

    Args:
        step: the update; it reads the clipped ``grads`` (changed in place), or, with ``norm``,
            ``clip.coefficient``.
        grads: the final gradients ``step`` reads.
        clip: their clipping set, or None.
        held: the participant's window is open: ``keep()`` instead, and nothing steps.
        keep: what the participant keeps of its gradient inside the window (None: it stays on ``.grad``).
        replicated: every rank holds these very gradients (DDP-averaged): rank 0 alone adds
            them to the norm.
        norm: for a participant that holds no gradient tensor to scale (its kernel forms it inside
            its update): its own partial norm, made only if needed (see
            :meth:`~overlap_optim.clipping.GradientClipping.hold`).
        release: what runs instead of ``step`` when the clipping set refuses the step: free what
            ``step`` would have freed, update nothing (None: nothing to free).
    """
    if held:
        if keep is not None:
            keep()
        return
    if clip is None:
        step()
        return
    clip.arm()  # from backward's thread, first in this backward; anywhere else, armed already
    if norm is not None:
        clip.hold(norm(), step, release=release)
    else:
        clip.clip(list(grads), step, replicated=replicated, release=release)


def releasing_grad(param: torch.Tensor) -> Callable[[], None]:
    """The ``release`` of a participant whose gradient lives on ``param.grad``: it sets it to None,
    as the update does once it has read it."""

    def release() -> None:
        param.grad = None

    return release
