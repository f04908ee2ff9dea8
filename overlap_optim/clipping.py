"""Gradient clipping for updates that run in backward: by global norm or by value, exact.

``torch.nn.utils.clip_grad_norm_`` after ``backward()`` clips nothing here: every
annotated gradient was applied and released during backward. Clipping is
therefore declared once, on the parameters, like the annotation, and every
update of a clipped parameter uses the clipped gradient:

- **By value** (``clip_value``): each gradient is clamped to ``[-c, c]`` just
  before its update, where the update runs; nothing waits.
- **By global norm** (``max_norm``): every gradient of the set waits for the
  norm. During backward each participant (a parameter's hook, a DDP bucket, a
  fallback table kernel, a cross-shard table) hands its final gradients to
  :meth:`GradientClipping.clip`, which adds their ``sum |g|^p`` (``max |g|``
  for ``inf``) to the set's :class:`~overlap_optim.round.EndOfBackwardRound`
  and holds them. When backward ends one all-reduce gives the global norm;
  every held gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))``,
  as ``clip_grad_norm_`` does, and then its update runs.

The norm is global: each shard of a sharded table or of an FSDP2 parameter adds
its own rows (or columns), and a gradient every rank holds alike (averaged by
DDP) is added by rank 0 only. Parameters of the set with no annotation are clipped too, at the
end of backward, for the user's own optimizer to read.

What a set holds until the end of backward with ``max_norm``: the gradients of
its annotated parameters (as plain torch does), the DDP buckets (views, no
copy), the summed gradients of the touched rows of its fallback tables.

A set whose parameters all take local steps of local SGD (QSR) clips by each
replica's own norm, with no collective, as a torch loop on each replica would;
a set that mixes those with synchronous parameters is refused.

Example:
    >>> clip = overlap_optim.apply_gradient_clipping(model.parameters(), max_norm=1.0)
    >>> loss.backward()          # every update used the clipped gradient
    >>> log(clip.total_norm)     # what clip_grad_norm_ would have returned
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from overlap_optim import _private
from overlap_optim.accumulation import accumulating
from overlap_optim.record import group_of, record, record_of
from overlap_optim.round import EndOfBackwardRound, Phase

__all__ = ["GradientClipping", "apply_gradient_clipping", "clipping_of", "mark_taken", "taken_by", "join_clipping"]

def clipping_of(param: torch.Tensor) -> GradientClipping | None:
    """The clipping set ``param`` belongs to, or None (its record's)."""
    found = record_of(param)
    return None if found is None else found.clipping


def join_clipping(param: torch.Tensor, clip: GradientClipping | None) -> None:
    """Make ``param`` a member of ``clip`` (a tensor that replaces one of its members: a
    materialized meta parameter, a data-parallel table's weight)."""
    if clip is not None:
        clip._join(param)


def mark_taken(params: Iterable[torch.Tensor], by: str) -> None:
    """Record that ``by`` (a DDP hook, a sharder) now runs ``params``' updates, so that clipping
    declared on them afterwards is refused with a clear error instead of being missed."""
    for param in params:
        record(param).taken_by = by


def taken_by(param: torch.Tensor) -> str | None:
    """What runs ``param``'s update since :func:`mark_taken` (a DDP hook, a sharder), or None."""
    found = record_of(param)
    return None if found is None else found.taken_by


class GradientClipping:
    """One clipping set: its settings, its norm, its round. Made by :func:`apply_gradient_clipping`.

    Attributes:
        max_norm: the norm to clip to (None: clipping by value); may change between steps.
        clip_value: the bound of each element (None: clipping by norm); may change between steps.
        norm_type: p of the p-norm, or ``inf``.
        error_if_nonfinite: raise, on every rank, when the global norm is inf or nan.
        total_norm: after each backward, the global norm of the set's gradients, a 0-d
            float32 tensor, as ``clip_grad_norm_`` returns it (None with ``clip_value``, or
            before the first backward).
        coefficient: after each backward, the 0-d float32 factor every gradient of the set was
            multiplied by (clipping by norm).
        params: the set's parameters in this process (a sharded table's weight leaves it).
        tables: names of the sharded tables of the set.
    """

    def __init__(
        self, max_norm: float | None, norm_type: float, clip_value: float | None, error_if_nonfinite: bool
    ) -> None:
        self._max_norm, self._clip_value = max_norm, clip_value
        self.norm_type, self.error_if_nonfinite = norm_type, error_if_nonfinite
        self.total_norm: torch.Tensor | None = None
        self.params: list[torch.Tensor] = []
        self.tables: list[str] = []
        self.local = False
        self._replicated: set[int] = set()  # ids of unannotated members every rank holds alike (DDP)
        op = "max" if math.isinf(norm_type) else "sum"
        self.round = EndOfBackwardRound(None, Phase.CLIP, op, start=self._start)
        if max_norm is not None:  # by value, the round only clips the unannotated members: no slot, no collective
            self.round.register("norm", 1)
        # each held update: its gradients, the update, and what frees them if the step is refused
        self._waiting: list[tuple[list[torch.Tensor], Callable[[], None], Callable[[], None] | None]] = []
        self.coefficient = torch.ones(())

    # -- settings --

    @property
    def max_norm(self) -> float | None:
        return self._max_norm

    @max_norm.setter
    def max_norm(self, value: float) -> None:
        if self._max_norm is None:
            raise ValueError("this set clips by value: set clip_value, or make another set with max_norm")
        self._max_norm = _check_bound("max_norm", value)

    @property
    def clip_value(self) -> float | None:
        return self._clip_value

    @clip_value.setter
    def clip_value(self, value: float) -> None:
        if self._clip_value is None:
            raise ValueError("this set clips by norm: set max_norm, or make another set with clip_value")
        self._clip_value = _check_bound("clip_value", value)

    @property
    def by_norm(self) -> bool:
        """Every update waits for the norm (False: clipping by value, nothing waits)."""
        return self._max_norm is not None

    def __repr__(self) -> str:
        how = f"max_norm={self._max_norm}, norm_type={self.norm_type}" if self.by_norm else f"clip_value={self._clip_value}"
        return f"GradientClipping({how}, {len(self.params)} params, tables={self.tables})"

    # -- participants --

    def arm(self) -> None:
        """From backward, on every rank that takes part: the set's round runs when backward ends
        (once per backward: the round keeps that rule)."""
        self.round.arm()

    def _start(self) -> None:
        """The round's first arming in a backward: a fresh norm."""
        self._waiting = []
        if self.by_norm:
            self.round.contribute("norm", torch.zeros(1, dtype=torch.float64), self._finish)
        self.round.before(self._gather_unannotated)

    def clip(self, grads: list[torch.Tensor], then: Callable[[], None], *, replicated: bool = False,
             release: Callable[[], None] | None = None) -> None:
        """Clip ``grads`` (final gradients, changed in place), then run ``then()``, the update
        that reads them: now when clipping by value; at the end of backward, once the global
        norm is known, when clipping by norm (call :meth:`arm` first in this backward).

        ``replicated``: every rank holds these very gradients (DDP-averaged), so only rank 0
        adds them to the norm. ``release``: run instead of ``then()`` when the norm is not finite
        and ``error_if_nonfinite`` refuses the step. Safe from DDP's communication thread.
        """
        grads = [g for g in grads if g is not None]
        if not self.by_norm:
            if grads:
                value = self._clip_value
                _private.foreach.clamp_min_(grads, -value)
                _private.foreach.clamp_max_(grads, value)
            then()
            return
        pieces, counted = [], []
        for grad in grads:
            piece, counts = _piece(grad)
            pieces.append(piece)
            if self.local or (counts if piece is not grad else self._counts_on_this_rank(replicated)):
                counted.append(piece)
        self.round.contribute("norm", self._partial(counted))
        self._waiting.append((pieces, then, release))

    def hold(self, partial: torch.Tensor, then: Callable[[], None], release: Callable[[], None] | None = None) -> None:
        """For a participant that holds no gradient tensor to scale (a fused table, whose
        gradient its kernel forms inside its update): add its own ``partial`` (``sum |g|^p``, or
        ``max |g|`` for inf, of this rank's gradient, one float64 element) to the norm, and
        run ``then()`` at the end of backward, which reads :attr:`coefficient`, the 0-d
        float32 factor every gradient of the set is multiplied by (``release()`` instead, if the
        step is refused). Clipping by norm only."""
        assert self.by_norm, "hold() serves clipping by norm"
        self.round.contribute("norm", partial.reshape(1).to(torch.float64))
        self._waiting.append(([], then, release))

    def _counts_on_this_rank(self, replicated: bool) -> bool:
        """Whether this rank adds such gradients to the norm: a gradient every rank holds alike
        is added once, by rank 0; a rank's own (a shard's rows, a local replica's) always."""
        return self.local or not replicated or _rank() == 0

    def _partial(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros(1, dtype=torch.float64)
        norms = torch.stack(_private.foreach.norm(grads, self.norm_type)).double()
        if math.isinf(self.norm_type):
            return norms.max().reshape(1)
        return norms.pow(self.norm_type).sum().reshape(1)

    def check_members(self) -> None:
        """Raise ValueError if an unannotated member's gradient may differ per rank: nothing of
        ours reduces it (our DDP hook marks those it averages). A sharded module checks it on
        every rank before its first lookup of a step, before any update; the end of backward
        checks it again for sets that hold no sharded table."""
        if self.local or _world() <= 1:
            return
        for param in self.params:
            unannotated = group_of(param) is None and param.requires_grad
            if unannotated and id(param) not in self._replicated and not _is_dtensor(param):
                raise ValueError(
                    f"gradient clipping: a parameter of shape {tuple(param.shape)} with no annotation is in the "
                    "clipping set, and no DDP hook of overlap_optim reduces it, so its gradient may differ per "
                    "rank; wrap the model with overlap_optim.register_optimizer_hook (or DMP's "
                    "sharders.DataParallelWrapper), or leave it out of the set"
                )

    def _gather_unannotated(self) -> None:
        """At the end of backward (after DDP's buckets): the set's unannotated parameters, whose
        gradients are final now, join the norm and are scaled with the rest."""
        self.check_members()
        grads, replicated = [], []
        for param in self.params:
            if param.grad is None or group_of(param) is not None:
                continue
            if _is_dtensor(param.grad):  # placed as it says: clip() reads its placements
                grads.append(param.grad)
                continue
            (replicated if id(param) in self._replicated else grads).append(param.grad)
        self.clip(grads, _nothing)
        self.clip(replicated, _nothing, replicated=True)

    def _finish(self, reduced: torch.Tensor) -> None:
        """The global norm is known: scale every held gradient, then run each update."""
        held, self._waiting = self._waiting, []
        total = reduced[0] if math.isinf(self.norm_type) else reduced[0] ** (1.0 / self.norm_type)
        total_norm = total.to(torch.float32)
        self.total_norm = total_norm
        if self.error_if_nonfinite and not torch.isfinite(total_norm):
            for _, _, release in held:  # the next step starts clean: nothing of this one is kept
                if release is not None:
                    release()
            raise RuntimeError(
                f"gradient clipping: the global {self.norm_type}-norm of the set's gradients is {total_norm.item()}, "
                "so they cannot be clipped (error_if_nonfinite=True); no update of the set ran this step, and its "
                "gradients are released: to skip the batch, go on to the next (no step() is needed after this one)"
            )
        coefficient = torch.clamp(self._max_norm / (total_norm + 1e-6), max=1.0)
        self.coefficient = coefficient
        for grads, then, _ in held:
            if grads:
                _private.foreach.mul_(grads, coefficient.to(grads[0].dtype))
            then()

    # -- membership --

    def _join(self, param: torch.Tensor) -> None:
        old = clipping_of(param)
        if old is not None and old is not self:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} is already in another clipping set ({old!r}): "
                "each parameter may be clipped by one set only"
            )
        record(param).clipping = self
        if not any(p is param for p in self.params):
            self.params.append(param)
        if group_of(param) is None and param.requires_grad:
            # Unannotated: nothing steps it in backward; this hook only arms the round.
            param.register_post_accumulate_grad_hook(lambda p: None if accumulating(p) else self.arm())

    def leave(self, param: torch.Tensor, table: str | None = None) -> None:
        """``param`` stops being a member here (a sharder took it as ``table``)."""
        self.params = [p for p in self.params if p is not param]
        if table is not None and table not in self.tables:
            self.tables.append(table)

    def mark_replicated(self, param: torch.Tensor) -> None:
        """``param`` has no annotation and our DDP hook averages it: every rank holds its gradient alike."""
        self._replicated.add(id(param))

    def make_local(self, members: list[torch.Tensor]) -> None:
        """Every update of the set takes local steps (QSR): clip by this replica's own norm.

        Raises:
            ValueError: the set also holds sharded tables, or parameters outside ``members``.
        """
        outside = [p for p in self.params if not any(p is m for m in members)]
        if self.tables or outside:
            what = f"sharded tables {self.tables}" if self.tables else f"{len(outside)} parameter(s) it does not hold"
            raise ValueError(
                f"gradient clipping: the set {self!r} mixes parameters that take local steps of local SGD (QSR) "
                f"with {what}, which step synchronously; each replica would clip them by a different norm. "
                "Clip the local-SGD parameters in a set of their own"
            )
        self.local = True
        self.round.local = True


def _nothing() -> None:
    pass


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _piece(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(this rank's piece of grad, whether this rank adds it to the norm)``: a DTensor's local
    tensor, added where this rank is the first of every mesh dimension the DTensor is replicated on
    (each piece of a split gradient once, a replicated one once per group); any other tensor is
    its own piece (the caller says who adds it)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad, True
    mesh = grad.device_mesh
    first = all(mesh.get_local_rank(m) == 0 for m, p in enumerate(grad.placements) if isinstance(p, Replicate))
    return grad.to_local(), first


def _is_dtensor(param: torch.Tensor) -> bool:
    """A DTensor (FSDP2's, tensor parallelism's): its placements say how each rank holds its gradient."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _check_bound(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def apply_gradient_clipping(
    params: Iterable[torch.Tensor],
    max_norm: float | None = None,
    norm_type: float = 2.0,
    *,
    clip_value: float | None = None,
    error_if_nonfinite: bool = False,
) -> GradientClipping:
    """Clip the gradients of ``params`` before every update, by global norm or by value.

    Declare it on the unsharded model, before sharding and wrapping (meta
    parameters too), as the annotations are; it holds through
    ``DistributedModelParallel``, the EBC sharder and DDP. The result equals
    one process that calls ``torch.nn.utils.clip_grad_norm_(params, max_norm,
    norm_type, error_if_nonfinite)`` (or ``clip_grad_value_(params,
    clip_value)``) after the step's backward and then steps each parameter's
    optimizer. On a lazy table (fused or fallback) the reference gradient is the
    coalesced one: untouched rows count as zero, clipping scales the touched rows.

    Several calls on disjoint sets each clip by their own norm. Parameters
    without an annotation are clipped too: their ``.grad`` is clipped at the end
    of backward for your own optimizer. Parameters that do not require grad
    never have a gradient and are ignored, as torch ignores them.

    Args:
        params: the parameters of the set.
        max_norm: clip to this global norm (``float("inf")``: only measure it).
        norm_type: p of the p-norm (> 0), or ``float("inf")``.
        clip_value: instead of ``max_norm``: clamp each element to ``[-clip_value, clip_value]``.
        error_if_nonfinite: raise if the global norm is inf or nan (then no update of the set runs, and its
            gradients are released: a loop that skips the batch goes on with the next).

    Returns:
        The set: read ``total_norm`` after each backward; ``max_norm`` or ``clip_value`` may
        be changed between steps.

    Raises:
        ValueError: both or neither of ``max_norm`` and ``clip_value``, a negative bound, a
            ``norm_type`` that is not > 0, no parameters, a parameter already in a set, or a
            parameter already sharded or wrapped (declare clipping before).
        TypeError: a param is not a tensor.

    Example:
        >>> apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-3})
        >>> clip = apply_gradient_clipping(model.parameters(), max_norm=1.0)
        >>> model(batch).sum().backward()
        >>> clip.total_norm
    """
    if (max_norm is None) == (clip_value is None):
        raise ValueError("apply_gradient_clipping takes exactly one of max_norm (clip by norm) and clip_value")
    if max_norm is not None:
        max_norm = _check_bound("max_norm", max_norm)
    else:
        clip_value = _check_bound("clip_value", clip_value)
    if isinstance(norm_type, str) and norm_type == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")
    params = _check_params(params)
    clip = GradientClipping(max_norm, float(norm_type), clip_value, bool(error_if_nonfinite))
    for param in params:
        clip._join(param)
    return clip


def _check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    unique: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
        unique.setdefault(id(p), p)
    if not unique:
        raise ValueError("params is empty: pass at least one parameter to clip")
    for i, p in enumerate(unique.values()):
        if taken_by(p) is not None:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) is already run by {taken_by(p)}: declare gradient "
                "clipping on the unsharded model, before DistributedModelParallel, the sharder or "
                "register_optimizer_hook, as the annotations are"
            )
        old = clipping_of(p)
        if old is not None:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) is already in a clipping set ({old!r}): each parameter "
                "may be clipped by one set only"
            )
    return list(unique.values())
