"""The end-of-backward round: work that must wait until a backward pass has finished.

Most updates run as soon as a gradient is ready. Some cannot: a layer-wise
table split across ranks needs whole-table statistics that no shard has alone,
and the DDP hook must wait for every bucket's update before it releases the
gradients. Such work joins the round of the backward pass it belongs to:

1. **Contribute.** During backward, a participant hands the round a vector of
   partial sums for its slot (:meth:`EndOfBackwardRound.contribute`), or only
   a function to run at the end (:meth:`EndOfBackwardRound.defer`).
2. **Reduce.** When backward ends, the round sums every slot across the ranks
   of its process group in **one** ``all_reduce`` of one flat float64 buffer,
   however many participants there are. A rank that holds nothing for a slot
   contributes zeros, so every rank runs the same collective.
3. **Finish.** Each participant finishes its step with the reduced sums of its
   slot, in the order it contributed; deferred functions run after them.

Slots are registered (:meth:`EndOfBackwardRound.register`) in the same order
and with the same sizes on every rank, before the first backward. A participant
arms the round from backward (:meth:`EndOfBackwardRound.arm`); every rank must
arm it in the same backward, which holds when every rank runs some autograd
node that arms it (each sharded kernel does). A round with no slot runs no
collective.

The next features add their work here rather than a mechanism of their own:
a global gradient norm is one more slot, and a step that accumulates is one
more participant that does not finish yet.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from overlap_optim import _private

__all__ = ["EndOfBackwardRound"]

Finish = Callable[[torch.Tensor], None]


class EndOfBackwardRound:
    """One all-reduce of partial sums at the end of backward, then each participant's finish.

    Args:
        process_group: the group the slots are summed over (None: the default
            group; a single process reduces nothing).

    Attributes:
        rounds: how many rounds ran a collective so far (one per backward at most).

    Example:
        >>> round_ = EndOfBackwardRound(pg)
        >>> round_.register("t0", 2)                           # same order on every rank
        >>> # in backward:
        >>> round_.contribute("t0", partial_sums, finish=table.finish)
        >>> round_.arm()                                       # runs once backward ends
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.slots: dict[str, tuple[int, int]] = {}  # key -> (offset, size)
        self.size = 0
        self.rounds = 0
        self._contributed: list[tuple[str, torch.Tensor, Finish]] = []
        self._deferred: list[Callable[[], None]] = []
        self._armed = False

    def register(self, key: str, size: int) -> None:
        """Reserve ``size`` floats for ``key``. Call in the same order on every rank."""
        if key in self.slots:
            raise ValueError(f"the round already has a slot named {key!r}")
        if size < 0:
            raise ValueError(f"slot {key!r}: size must be >= 0, got {size}")
        self.slots[key] = (self.size, size)
        self.size += size

    def contribute(self, key: str, partials: torch.Tensor, finish: Finish) -> None:
        """Add ``partials`` to slot ``key``; ``finish(summed)`` runs once the round has reduced it."""
        offset, size = self.slots[key]
        assert partials.numel() == size, f"slot {key!r} holds {size} floats, got {partials.numel()}"
        self._contributed.append((key, partials, finish))

    def defer(self, finish: Callable[[], None]) -> None:
        """Run ``finish()`` when backward ends, after the participants with slots have finished."""
        self._deferred.append(finish)

    def arm_in_backward(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` unchanged, through an identity whose backward arms this round: a rank
        whose backward reaches ``output`` takes part in the round."""
        return _Arm.apply(output, self)

    def arm(self) -> None:
        """From backward: run the round when this backward ends (queued once per backward)."""
        if not self._armed:
            _private.queue_end_of_backward(self.run)
            self._armed = True

    @torch.no_grad()
    def run(self) -> None:
        """Reduce every slot in one all-reduce, then finish each participant."""
        contributed, self._contributed = self._contributed, []
        deferred, self._deferred = self._deferred, []
        self._armed = False
        if self.size:
            buffer = torch.zeros(self.size, dtype=torch.float64)
            for key, partials, _ in contributed:
                offset, size = self.slots[key]
                buffer[offset : offset + size] += partials.reshape(-1).to(torch.float64)
            if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
                dist.all_reduce(buffer, group=self.process_group)
            self.rounds += 1
            for key, _, finish in contributed:
                offset, size = self.slots[key]
                finish(buffer[offset : offset + size])
        for finish in deferred:
            finish()


class _Arm(torch.autograd.Function):
    """Identity; its backward arms the round."""

    @staticmethod
    def forward(ctx, output, round_):
        ctx.round = round_
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.round.arm()
        return grad, None
