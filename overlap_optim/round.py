"""The end-of-backward round: work that must wait until a backward pass has finished.

Most updates run as soon as a gradient is ready. Some cannot: a layer-wise
table split across ranks needs whole-table statistics that no shard has alone,
a clipped gradient needs the global norm of every gradient of its set, and the
DDP hook must wait for every bucket's update before it releases the gradients.
Such work joins a round of the backward pass it belongs to:

1. **Contribute.** During backward, a participant hands a round a vector of
   partial sums for its slot (:meth:`EndOfBackwardRound.contribute`), and the
   function that finishes its step once they are reduced.
2. **Reduce.** When backward ends, the round reduces every slot across the
   ranks of its process group in one flat float64 buffer (a sum, or a max),
   however many participants there are. A rank that holds nothing for a slot
   contributes zeros, so every rank runs the same collective. The rounds of one
   phase that reduce over the same process group with the same op share
   **one** ``all_reduce``: a step runs one per phase and group, however many
   clipping sets and sharded modules it has.
3. **Finish.** Each participant finishes its step with the reduced values of
   its slot, in the order it contributed.

The rounds armed in one backward run together, when it ends (after the other
callbacks queued during that backward: DDP's), in the order of
their :class:`Phase`: first each round's :meth:`~EndOfBackwardRound.before`
work (the DDP hook waits for its buckets), then clipping (the norm that every
clipped update waits for), then the statistics of layer-wise tables (computed
on clipped gradients), then the statistics that need those summed first, and last every
:meth:`~EndOfBackwardRound.defer`-red
function (the DDP hook releases its gradients). A round armed while they run
(a layer-wise table stepped by clipping's finish contributes to its module's
round) runs in its phase's turn.

Slots are registered (:meth:`EndOfBackwardRound.register`) in the same order
and with the same sizes on every rank, before the first backward. A participant
arms the round from backward (:meth:`EndOfBackwardRound.arm`); every rank must
arm it in the same backward, which holds when every rank runs some autograd
node that arms it (each sharded kernel does). Rounds that share an
``all_reduce`` lie in its buffer in the order they were first armed in that
backward, which is backward's own order on backward's thread, the same on every
rank. The round keeps the once-per-backward rule: its ``start`` runs when it is
first armed in a backward, and arming it again is nothing. A round with no slot, or
with empty slots only, runs no collective (its participants still finish); neither
does a ``local`` one (its sums are this process's own).

If a finish (or a ``before`` work) raises, the rest still run: the other
participants' finishes, the later phases' rounds and the deferred functions. So
every rank runs the same collectives, and one participant's refusal (a clipping
set whose global norm is not finite) neither drops the update of another set
nor leaves a layer-wise table's step half done. The first error is raised when
the rounds are done, the others noted on it; an error that depends only on
reduced values is raised on every rank alike.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from overlap_optim import _private

__all__ = ["EndOfBackwardRound", "Phase", "arm_in_backward", "when_raised"]

Finish = Callable[[torch.Tensor], None]


class Phase(enum.IntEnum):
    """When a round runs among the rounds of one backward (lower first)."""

    SETTLE = 0  # the DDP hook waits for every bucket's reduction and update; an FSDP group steps the rest
    CLIP = 1  # gradient clipping: the global norm, then every clipped update
    STATISTICS = 2  # layer-wise tables split across ranks: whole-table statistics
    # statistics that need the first ones summed (Adafactor on a matrix split along both axes: its
    # update's norm, from the summed factors)
    SECOND_STATISTICS = 3


class EndOfBackwardRound:
    """One all-reduce of partial sums at the end of backward, then each participant's finish.

    Args:
        process_group: the group the slots are reduced over (None: the default
            group; a single process reduces nothing).
        phase: when it runs among the rounds of one backward.
        op: how slots combine, within a process and across ranks: "sum" or "max".
        local: reduce nothing across ranks (each process's own sums).
        start: run when the round is first armed in a backward (a clipping set's fresh norm).

    Attributes:
        rounds: how many rounds reduced slots so far (one per backward at most).

    Example:
        >>> round_ = EndOfBackwardRound(pg)
        >>> round_.register("t0", 2)                           # same order on every rank
        >>> # in backward:
        >>> round_.contribute("t0", partial_sums, finish=table.finish)
        >>> round_.arm()                                       # runs once backward ends
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        phase: Phase = Phase.STATISTICS,
        op: str = "sum",
        local: bool = False,
        start: Callable[[], None] | None = None,
    ) -> None:
        assert op in _OPS, op
        self.process_group, self.phase, self.op, self.local = process_group, phase, op, local
        self.start = start
        self._armed_in: int | None = None  # the backward that armed it last
        self.slots: dict[str, tuple[int, int]] = {}  # key -> (offset, size)
        self.size = 0
        self.rounds = 0
        self._contributed: list[tuple[str, torch.Tensor, Finish | None]] = []
        self._before: list[Callable[[], None]] = []
        self._deferred: list[Callable[[], None]] = []

    def register(self, key: str, size: int) -> None:
        """Reserve ``size`` floats for ``key``. Call in the same order on every rank."""
        if key in self.slots:
            raise ValueError(f"the round already has a slot named {key!r}")
        if size < 0:
            raise ValueError(f"slot {key!r}: size must be >= 0, got {size}")
        self.slots[key] = (self.size, size)
        self.size += size

    @staticmethod
    def slot_bytes(size: int, partials_dtype: torch.dtype = torch.float64) -> int:
        """Bytes a slot of ``size`` floats takes at the peak of :meth:`run`: the partials contributed
        to it (in ``partials_dtype``, held until every participant has finished), its part of the
        float64 buffer, and, while the partials are summed into it, their float64 copy (none if
        they are float64) and the sum. For float64 partials, 24 bytes a float."""
        itemsize = torch.empty(0, dtype=partials_dtype).element_size()
        copy = 0 if partials_dtype == torch.float64 else 8
        return size * (itemsize + 8 + copy + 8)

    def contribute(self, key: str, partials: torch.Tensor, finish: Finish | None = None) -> None:
        """Add ``partials`` to slot ``key``; ``finish(reduced)`` runs once the round has reduced it.
        Safe from DDP's communication thread (a list append)."""
        offset, size = self.slots[key]
        assert partials.numel() == size, f"slot {key!r} holds {size} floats, got {partials.numel()}"
        self._contributed.append((key, partials, finish))

    def before(self, work: Callable[[], None]) -> None:
        """Run ``work()`` when this backward ends, before this round reduces (once per call)."""
        self._before.append(work)

    def defer(self, finish: Callable[[], None]) -> None:
        """Run ``finish()`` when this backward ends, after every round of it has finished."""
        self._deferred.append(finish)

    def arm_in_backward(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` unchanged, through an identity whose backward arms this round: a rank
        whose backward reaches ``output`` takes part in the round."""
        return arm_in_backward(output, [self.arm])

    def arm(self) -> None:
        """From backward: run the round when this backward ends. Once per backward: the first
        call runs ``start``, a later one is nothing. From another thread of the running backward
        (DDP's communication thread, where a bucket's update runs) it must be armed already."""
        backward = _private.backward_id()
        if backward == -1:  # not backward's thread: DDP's communication thread, inside the running backward
            assert self._armed_in is not None, "a round is armed first from backward's own thread"
            return
        if self._armed_in == backward:
            return
        self._armed_in = backward
        _SCHEDULE.arm(self, backward)
        if self.start is not None:
            self.start()

    @torch.no_grad()
    def run(self) -> None:
        """Run this round alone: its ``before`` work, its one all-reduce, each participant's finish
        (all of them; then the first error raised, see the module doc)."""
        errors: list[Exception] = []
        _run_together([self], errors)
        _raise_first(errors)

    def _gather(self, errors: list[Exception]) -> torch.Tensor:
        """Run the ``before`` work, then sum (or max) this process's contributions into a fresh buffer."""
        before, self._before = self._before, []
        for work in before:
            _attempt(work, errors)
        buffer = torch.zeros(self.size, dtype=torch.float64)
        combine = _OPS[self.op][0]
        for key, partials, _ in self._contributed:
            offset, size = self.slots[key]
            part = buffer[offset : offset + size]
            part.copy_(combine(part, partials.reshape(-1).to(torch.float64)))
        return buffer

    def _reduces(self) -> bool:
        """Whether the round reduces across ranks (False: local, one process, or no floats)."""
        return bool(self.size) and not self.local and dist.is_initialized() and dist.get_world_size(
            self.process_group) > 1

    def _finish(self, buffer: torch.Tensor, errors: list[Exception]) -> None:
        """Each participant's finish, with the reduced ``buffer``, in the order it contributed; one
        that raises adds its error to ``errors`` and the next still runs."""
        contributed, self._contributed = self._contributed, []
        if self.size:  # empty slots only (LARS on vectors): nothing to reduce, each still finishes
            self.rounds += 1
        for key, _, finish in contributed:
            if finish is not None:
                offset, size = self.slots[key]
                _attempt(functools.partial(finish, buffer[offset : offset + size]), errors)

    def discard(self) -> None:
        """Forget this backward's contributions and work (after an error; nothing after a run)."""
        self._contributed, self._before = [], []

    def take_deferred(self) -> list[Callable[[], None]]:
        deferred, self._deferred = self._deferred, []
        return deferred


_OPS = {
    "sum": (torch.add, dist.ReduceOp.SUM),
    "max": (torch.maximum, dist.ReduceOp.MAX),
}


def _attempt(work: Callable[[], None], errors: list[Exception]) -> None:
    """``work()``; an error it raises is added to ``errors`` instead (the caller raises the first)."""
    try:
        work()
    except Exception as error:  # noqa: BLE001 - kept and raised once the round's work is done
        errors.append(error)


def _raise_first(errors: list[Exception]) -> None:
    """Raise the first of ``errors``, the others noted on it; nothing if there are none."""
    if not errors:
        return
    first = errors[0]
    for later in errors[1:]:
        first.add_note(f"also raised when this backward ended: {type(later).__name__}: {later}")
    raise first


def _run_together(rounds: list[EndOfBackwardRound], errors: list[Exception]) -> None:
    """Run ``rounds`` (of one phase): each one's ``before`` work, one all-reduce for those that
    reduce over the same process group with the same op (their buffers laid end to end, in the
    order of ``rounds``), then each participant's finish, round by round. Errors of the work and
    the finishes are added to ``errors``; everything still runs."""
    buffers = [round_._gather(errors) for round_ in rounds]
    shared: dict[tuple[object, str], list[int]] = {}  # (group, op) -> indices into rounds
    for i, round_ in enumerate(rounds):
        if round_._reduces():
            group = round_.process_group if round_.process_group is not None else dist.group.WORLD
            shared.setdefault((group, round_.op), []).append(i)
    with torch.no_grad():
        for (group, op), members in shared.items():
            flat = torch.cat([buffers[i] for i in members]) if len(members) > 1 else buffers[members[0]]
            dist.all_reduce(flat, op=_OPS[op][1], group=group)
            if len(members) > 1:
                for i, part in zip(members, flat.split([rounds[i].size for i in members])):
                    buffers[i] = part
        for round_, buffer in zip(rounds, buffers):
            round_._finish(buffer, errors)


class _Schedule:
    """The rounds armed in the running backward: one callback at its end runs them by phase."""

    def __init__(self) -> None:
        self.armed: list[EndOfBackwardRound] = []
        self.queued: int | None = None  # the backward whose end runs them
        # (backward, listener): told if the rounds at the end of that backward raise
        self.listeners: list[tuple[int, Callable[[], None]]] = []

    def arm(self, round_: EndOfBackwardRound, backward: int) -> None:
        """Arm ``round_`` (not armed yet) for the running ``backward``."""
        if self.queued is not None and self.queued != backward:  # that backward raised before its end
            for stale in self.armed:
                stale.discard()
                stale.take_deferred()
            self.armed, self.queued = [], None
        self.armed.append(round_)
        if self.queued is None:
            _private.queue_end_of_backward(self._requeue)
            self.queued = backward

    def _requeue(self) -> None:
        """Run last: behind the callbacks queued so far, DDP's included. With ``static_graph``
        (TorchRec's default) DDP all-reduces its first iteration from a callback of its own,
        queued when backward reaches its output, which may come after the first round was
        armed; its buckets must be in before clipping reduces the norm."""
        _private.queue_end_of_backward(self.run)

    def run(self) -> None:
        ran: list[EndOfBackwardRound] = []
        errors: list[Exception] = []
        backward = self.queued
        try:
            while self.armed:  # a finish may arm a later phase's round
                phase = min(r.phase for r in self.armed)
                now = [r for r in self.armed if r.phase == phase]  # first armed first
                self.armed = [r for r in self.armed if r.phase != phase]
                ran += now
                _run_together(now, errors)
        finally:
            # Nothing is left after a round that ran; a collective that raised leaves the rest unfinished.
            for dropped in ran:
                dropped.discard()
            for dropped in self.armed:
                dropped.discard()
                ran.append(dropped)
            self.armed, self.queued = [], None
            for round_ in ran:
                for finish in round_.take_deferred():
                    _attempt(finish, errors)
        listeners = [f for b, f in self.listeners if b == backward]
        self.listeners = [(b, f) for b, f in self.listeners if b != backward]
        if errors:
            for listener in listeners:
                listener()
        _raise_first(errors)

    def listen(self, backward: int, listener: Callable[[], None]) -> None:
        """Tell ``listener`` if the rounds at the end of the running ``backward`` raise. Backwards
        run one at a time: a listener of another backward is stale (that one ended) and dropped."""
        self.listeners = [(b, f) for b, f in self.listeners if b == backward]
        self.listeners.append((backward, listener))


_SCHEDULE = _Schedule()


def when_raised(listener: Callable[[], None]) -> None:
    """Call ``listener`` if the rounds at the end of the running backward raise (a refused step:
    a non-finite norm, after which a loop skips the batch). Call it from inside that backward."""
    _SCHEDULE.listen(_private.backward_id(), listener)


def arm_in_backward(output: torch.Tensor, arms: list[Callable[[], None]]) -> torch.Tensor:
    """``output`` unchanged, through an identity whose backward calls each of ``arms`` (the
    ``arm`` of rounds, or of clipping sets): a rank whose backward reaches ``output`` takes part."""
    return _Arm.apply(output, arms)


class _Arm(torch.autograd.Function):
    """Identity; its backward arms."""

    @staticmethod
    def forward(ctx, output, arms):
        ctx.arms = arms
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        for arm in ctx.arms:
            arm()
        return grad, None
