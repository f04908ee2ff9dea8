"""Local SGD for the dense part, with the period set by the Quadratic Synchronization Rule.

Replicated (DDP-managed) parameters normally all-reduce their gradients every
step. With ``local_sgd=QSR(...)`` passed to
:func:`~overlap_optim.register_optimizer_hook` (or to
``sharders.DataParallelWrapper``), each rank instead takes ``H`` steps on its own
gradient, its in-backward optimizers stepping in backward as usual, and then the
ranks average their parameters (and the optimizer state named in
``average_state``) in one flattened all-reduce. The Quadratic Synchronization
Rule (Gu, Lyu, Arora, Zhang, Huang, ICLR 2024) sets ``H`` from the learning rate:

    H = max(base_period, floor((alpha / lr) ** power))

capped at ``total_steps - step`` when ``total_steps`` is given, so that training
ends on an averaging. ``lr`` is the largest current lr among the param groups of
the DDP-managed annotated parameters (the shortest period; every rank agrees on
it). ``alpha=0`` gives a constant period.

The contract:

- A step is a backward that reaches DDP's comm hook; micro-batches under
  ``no_sync`` do not count.
- Steps with index below ``warmup_steps`` are synchronous, exactly as without
  local SGD (the authors run local steps in warm-up; synchronous warm-up is
  safer for Adam).
- ``H`` is set at the first backward of each round, from the lr that step uses
  (the scheduler moves lr first, then ``H`` follows, as in the authors' code).
- After ``H`` local steps the round ends: at the end of that backward, after the
  optimizer steps, every DDP-managed parameter is averaged across ranks.
- Unannotated DDP parameters keep their local gradient on local steps.
- Sharded (model-parallel) embedding tables are untouched: synchronous as always.
  Data-parallel tables are DDP-managed: they follow the dense part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from overlap_optim.record import group_of, record, record_of

__all__ = ["QSR", "attached"]


def attached(model: torch.nn.Module) -> list[QSR]:
    """The QSRs attached to parameters of ``model`` (for checkpoints of a run between averagings)."""
    found = {id(r.local_sgd): r.local_sgd for p in model.parameters()
             if (r := record_of(p)) is not None and r.local_sgd is not None}
    return list(found.values())


class QSR:
    """The local-SGD schedule of one DDP model; see the module doc.

    Args:
        alpha: the rule's constant; 0 gives the constant period ``base_period``.
        base_period: the shortest period, at least 1.
        warmup_steps: steps run synchronously first.
        power: the rule's exponent (2 for the quadratic rule).
        average_state: optimizer-state names averaged with the parameters, such
            as ``("exp_avg", "exp_avg_sq")``.
        total_steps: when given, the period is capped so that training ends on an
            averaging, and a zero lr is allowed.

    Attributes:
        period: the current H (0 before the first local step).
        step: steps taken.
    """

    def __init__(
        self,
        alpha: float = 0.2,
        base_period: int = 2,
        warmup_steps: int = 0,
        power: float = 2.0,
        average_state: Iterable[str] = (),
        total_steps: int | None = None,
    ) -> None:
        if isinstance(average_state, str):
            raise TypeError(f"average_state takes state names, got the string {average_state!r}")
        checks = [
            (alpha >= 0, f"alpha must be >= 0, got {alpha!r}"),
            (isinstance(base_period, int) and base_period >= 1, f"base_period must be an int >= 1, got {base_period!r}"),
            (isinstance(warmup_steps, int) and warmup_steps >= 0, f"warmup_steps must be an int >= 0, got {warmup_steps!r}"),
            (power > 0, f"power must be > 0, got {power!r}"),
            (total_steps is None or (isinstance(total_steps, int) and total_steps >= 1),
             f"total_steps must be None or an int >= 1, got {total_steps!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.alpha, self.base_period, self.warmup_steps, self.power = float(alpha), base_period, warmup_steps, power
        self.average_state = tuple(average_state)
        self.total_steps = total_steps
        self.period = 0
        self.step = 0
        self._in_round = 0  # local steps taken in the current round
        self._model: Any = None  # the hook's state, once registered

    # -- the schedule --

    def is_local(self) -> bool:
        """Whether the step about to run (index ``self.step``) is a local one; at the first
        step of a round, sets the period from the current lr."""
        if self.step < self.warmup_steps:
            return False
        if self._in_round == 0:
            self.period = self._period_now()
        return True

    def _period_now(self) -> int:
        lr = self._model.largest_lr() if self._model is not None else 0.0
        if self.alpha == 0:
            period = self.base_period
        elif lr <= 0:
            if self.total_steps is None:
                raise ValueError(
                    f"local SGD at step {self.step}: the learning rate is {lr!r}, and QSR's period "
                    "(alpha / lr) ** power is then infinite; pass total_steps= to end on an averaging"
                )
            period = self.total_steps - self.step
        else:
            period = max(self.base_period, math.floor((self.alpha / lr) ** self.power))
        if self.total_steps is not None:
            period = min(period, max(1, self.total_steps - self.step))
        return period

    def finish_step(self, local: bool) -> bool:
        """After a step's optimizer updates: count it; True when the round ends here (average)."""
        self.step += 1
        if not local:
            return False
        self._in_round += 1
        if self._in_round < self.period:
            return False
        self._in_round = 0
        return True

    # -- averaging --

    def attach(self, model: AveragedModel) -> None:
        """Attach to the parameters a DDP hook manages (done by ``register_optimizer_hook``)."""
        self._model = model
        for param in model.params:
            record(param).local_sgd = self

    def mid_round(self) -> bool:
        """Whether local steps were taken since the last averaging (the ranks may differ)."""
        return self._in_round > 0

    def average_now(self) -> None:
        """Average the DDP-managed parameters (and ``average_state``) across ranks now, and start
        a new round. A collective: call it on every rank."""
        if self._model is None:
            raise RuntimeError("this QSR is not registered with a model: pass it as local_sgd= first")
        self._model.average(self.average_state)
        self._in_round = 0

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "period": self.period, "in_round": self._in_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.period, self._in_round = int(state["step"]), int(state["period"]), int(state["in_round"])

    def __repr__(self) -> str:
        return (f"QSR(alpha={self.alpha}, base_period={self.base_period}, warmup_steps={self.warmup_steps}, "
                f"power={self.power}, average_state={self.average_state}, total_steps={self.total_steps})")


class AveragedModel:
    """What a :class:`QSR` acts on: the DDP-managed parameters and their live optimizers."""

    def __init__(self, params: list[torch.Tensor], annotated: list[torch.Tensor], process_group) -> None:
        self.params, self.annotated, self.process_group = params, annotated, process_group

    def largest_lr(self) -> float:
        groups = {id(group_of(p)): group_of(p).param_group for p in self.annotated}
        return max((float(g["lr"]) for g in groups.values() if "lr" in g), default=0.0)

    @torch.no_grad()
    def average(self, state_names: tuple[str, ...]) -> None:
        """One flattened all-reduce of the parameters and the named state tensors, then divide."""
        from overlap_optim.update import live_optimizer

        tensors = [p.detach() for p in self.params]
        for param in self.annotated:
            optimizer = live_optimizer(param)
            state = optimizer.state.get(param, {}) if optimizer is not None else {}
            tensors += [state[name] for name in state_names if isinstance(state.get(name), torch.Tensor)]
        dtypes = {t.dtype for t in tensors}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        dist.all_reduce(flat, group=self.process_group)
        flat /= dist.get_world_size(self.process_group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
