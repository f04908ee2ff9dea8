"""Virtual parameter groups: one multi-tensor update for tensors whose settings differ only in floats.

Per-layer and per-table learning rates make many param groups. ``torch.optim``
steps each group on its own, with scalar hyperparameters. Here tensors whose
optimizer class and fixed settings agree (the optimizer model's
:attr:`~overlap_optim.spec.OptimizerSpec.share_key`: Adam's ``amsgrad``, SGD's
``nesterov``, ``maximize`` ...) and whose device and dtype agree form one
*virtual group*: one multi-tensor update, every float hyperparameter (lr,
betas, eps, weight_decay, momentum, ...) a per-tensor list of scalars read from
each tensor's own param group at the moment of the step. 48 learning rates
cost what one does. On CPU, for float32 tensors of Adam, AdamW, SGD and Adagrad,
torch's fused kernel runs instead (:mod:`overlap_optim.fused`): one pass per
tensor, one call per distinct float setting, faster than the foreach ops there.

The math is ``torch.optim``'s (its single-tensor reference, op for op where the
foreach ops allow), for SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam and
RAdam; the state is created and named as ``torch.optim`` creates and names it,
so it is the live optimizers' own state. Any other class, or a group that sets
``foreach``/``fused``/``capturable``/``differentiable``, has no virtual group
(:func:`virtual_key` is None) and keeps ``torch.optim``'s own step: per tensor, or
for ``foreach``/``fused`` one call per annotation group (:func:`overlap_optim.update.step_params`).

The update takes tensors, gradients, state dicts and param-group dicts, so the
same call serves dense parameters (the DDP comm hook, data-parallel tables), the
gathered rows of fallback tables (:mod:`overlap_optim.table_optimizer`) and FSDP2's sharded
DTensor parameters (:mod:`overlap_optim.fsdp`). Every class here is element-wise,
so a DTensor steps on its local shard (torch's fused kernels have no DTensor
rule); its state stays a DTensor sharded as the parameter is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from overlap_optim import compiled
from overlap_optim._private import foreach, splits
from overlap_optim.fused import fused_step
from overlap_optim.spec import OptimizerSpec

__all__ = ["virtual_key", "multi_tensor_step", "fused_kernel_step", "step_counters", "MULTI_TENSOR", "LocalState"]

VirtualKey = tuple[Any, ...]
_OPT_OUT = ("foreach", "fused", "capturable", "differentiable")
_ADD_ONE = compiled.op("add_one_")


def virtual_key(spec: OptimizerSpec, param_group: dict[str, Any], tensor: torch.Tensor) -> VirtualKey | None:
    """Tensors with equal keys share one multi-tensor update; None: the tensor steps alone."""
    if spec.optimizer_class not in MULTI_TENSOR or tensor.is_sparse:
        return None
    if any(param_group.get(flag) for flag in _OPT_OUT):
        return None
    return (spec.share_key, tensor.device, tensor.dtype)


def multi_tensor_step(
    spec: OptimizerSpec,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    hypers: list[dict[str, Any]],
) -> None:
    """One update of ``params`` (in place) with ``grads``; ``states[i]`` is ``params[i]``'s
    ``torch.optim`` state (created here if empty) and ``hypers[i]`` its param group. torch's
    fused kernels where they apply (:mod:`overlap_optim.fused`), the foreach ops otherwise."""
    assert len(params) == len(grads) == len(states) == len(hypers)
    if not params:
        return
    if isinstance(params[0], DTensor):  # a virtual group's tensors agree in type
        states = [LocalState(state, param) for state, param in zip(states, params)]
        params, grads = [p.to_local() for p in params], [g.to_local() for g in grads]
    if fused_kernel_step(spec, params, grads, states, hypers):
        return
    with torch.no_grad():
        if spec.fixed.get("maximize"):
            grads = foreach.neg(grads)
        MULTI_TENSOR[spec.optimizer_class](params, grads, states, hypers, spec.fixed)


def fused_kernel_step(
    spec: OptimizerSpec,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    hypers: list[dict[str, Any]],
) -> bool:
    """The update of :func:`multi_tensor_step` by torch's fused CPU kernel, the one
    ``torch.optim.<class>(fused=True)`` calls, with the same arguments (:mod:`overlap_optim.fused`);
    False, nothing done, where it does not apply."""
    with torch.no_grad():
        return fused_step(spec.optimizer_class, spec.fixed, params, grads, states, hypers, step_counters, _state)


class LocalState(MutableMapping):
    """A DTensor parameter's ``torch.optim`` state seen on its local shard: a DTensor entry reads as
    its local tensor (the same storage), and a new entry that is sharded as the parameter is gets
    stored as a DTensor placed as the parameter is; others (the step counter, a factor that every
    shard holds whole) pass as they are.

    Args:
        state: the parameter's state dict in its live optimizer, or a function that returns it
            (looked up at each access: a checkpoint load replaces the dict).
        param: the DTensor parameter.
        sharded: the names of the entries sharded as the parameter is (an element-wise moment, a
            factor along the split dim); None: every entry shaped as the local shard.
    """

    def __init__(self, state: dict[str, Any] | Callable[[], dict[str, Any]], param: DTensor,
                 sharded: set[str] | None = None) -> None:
        self._state, self.param, self.sharded = state, param, sharded

    @property
    def state(self) -> dict[str, Any]:
        return self._state() if callable(self._state) else self._state

    def __getitem__(self, key: str) -> Any:
        value = self.state[key]
        return value.to_local() if isinstance(value, DTensor) else value

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            self.state[key] = value
            return
        if self.sharded is None and value.shape != self.param.to_local().shape or (
                self.sharded is not None and key not in self.sharded):
            self.state[key] = value
            return
        shape, placements = self._placed(value)
        self.state[key] = DTensor.from_local(value, self.param.device_mesh, placements, run_check=False,
                                             shape=shape, stride=torch.empty(shape, device="meta").stride())

    def _placed(self, value: torch.Tensor) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The whole shape and the placements of an entry sharded as the parameter is: as many dims
        as the parameter, the parameter's size along each dim it is split on; or (a row or column
        vector of a matrix split along one dim) that dim's size, split along the vector's only dim."""
        placements, mesh = self.param.placements, self.param.device_mesh
        split = sorted({p.dim for m, p in enumerate(placements) if splits(p) and mesh.size(m) > 1})  # one rank: whole
        if value.dim() == self.param.dim():
            return tuple(self.param.shape[d] if d in split else n for d, n in enumerate(value.shape)), placements
        assert value.dim() == 1 and len(split) <= 1, (value.shape, placements)
        length = self.param.shape[split[0]] if split else value.shape[0]
        return (length,), tuple(p if not splits(p) or (mesh.size(m) > 1 and p.dim == 0)  # a row vector: as it is
                                else Shard(0) if mesh.size(m) > 1 else Replicate()  # a column vector: its dim 0
                                for m, p in enumerate(placements))

    def __delitem__(self, key: str) -> None:
        del self.state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _floats(hypers: list[dict[str, Any]], key: str, index: int | None = None) -> list[float]:
    if index is None:
        return [float(h[key]) for h in hypers]
    return [float(h[key][index]) for h in hypers]


def _state(states: list[dict], params: list[torch.Tensor], name: str, fill: list[float] | None = None) -> list:
    for i, (state, p) in enumerate(zip(states, params)):
        if name not in state:
            state[name] = (
                torch.zeros_like(p, memory_format=torch.preserve_format)
                if fill is None
                else torch.full_like(p, fill[i], memory_format=torch.preserve_format)
            )
    return [s[name] for s in states]


def _steps(states: list[dict]) -> list[float]:
    """Advance every ``step`` counter (made as torch makes it) and return the new values."""
    return [float(c) for c in step_counters(states)]


def step_counters(states: list[dict]) -> list[torch.Tensor]:
    """Advance every ``step`` counter (made as torch makes it) and return the counters: in one
    compiled call where the library is built (:mod:`overlap_optim.compiled`; the same float32
    ``+ 1``), else as torch.optim does, one foreach add."""
    for state in states:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    counters = [s["step"] for s in states]
    if _ADD_ONE is None or not _ADD_ONE(counters):
        foreach.add_(counters, 1)
    return counters


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _l2(grads, params, hypers):
    """``grad + weight_decay * param``, per tensor (coupled weight decay)."""
    wds = _floats(hypers, "weight_decay")
    return foreach.add(grads, foreach.mul(params, wds)) if any(wds) else grads


def _decay(params, hypers):
    """``param *= 1 - lr * weight_decay`` (decoupled weight decay)."""
    factors = [1 - float(h["lr"]) * float(h["weight_decay"]) for h in hypers]
    if any(f != 1 for f in factors):
        foreach.mul_(params, factors)


def _moments(exp_avgs, exp_avg_sqs, grads, hypers):
    beta1, beta2 = _floats(hypers, "betas", 0), _floats(hypers, "betas", 1)
    foreach.lerp_(exp_avgs, grads, [1 - b for b in beta1])
    foreach.mul_(exp_avg_sqs, beta2)
    foreach.addcmul_(exp_avg_sqs, grads, grads, [1 - b for b in beta2])
    return beta1, beta2


def _adam(params, grads, states, hypers, fixed):
    decoupled = bool(fixed.get("decoupled_weight_decay"))
    exp_avgs, exp_avg_sqs = _state(states, params, "exp_avg"), _state(states, params, "exp_avg_sq")
    max_sqs = _state(states, params, "max_exp_avg_sq") if fixed.get("amsgrad") else None
    steps = _steps(states)
    if decoupled:
        _decay(params, hypers)
    else:
        grads = _l2(grads, params, hypers)
    beta1, beta2 = _moments(exp_avgs, exp_avg_sqs, grads, hypers)
    if max_sqs is not None:
        foreach.maximum_(max_sqs, exp_avg_sqs)
    denom = foreach.sqrt(max_sqs if max_sqs is not None else exp_avg_sqs)
    foreach.div_(denom, [(1 - b**s) ** 0.5 for b, s in zip(beta2, steps)])
    foreach.add_(denom, _floats(hypers, "eps"))
    step_size = [-float(h["lr"]) / (1 - b**s) for h, b, s in zip(hypers, beta1, steps)]
    foreach.addcdiv_(params, exp_avgs, denom, step_size)


def _adagrad(params, grads, states, hypers, fixed):
    sums = _state(states, params, "sum", _floats(hypers, "initial_accumulator_value"))
    steps = _steps(states)
    grads = _l2(grads, params, hypers)
    minus_clr = [-float(h["lr"]) / (1 + (s - 1) * float(h["lr_decay"])) for h, s in zip(hypers, steps)]
    foreach.addcmul_(sums, grads, grads, [1.0] * len(params))
    std = foreach.sqrt(sums)
    foreach.add_(std, _floats(hypers, "eps"))
    foreach.addcdiv_(params, foreach.mul(grads, minus_clr), std)


def _adamax(params, grads, states, hypers, fixed):
    exp_avgs, exp_infs = _state(states, params, "exp_avg"), _state(states, params, "exp_inf")
    steps = _steps(states)
    grads = _l2(grads, params, hypers)
    beta1, beta2 = _floats(hypers, "betas", 0), _floats(hypers, "betas", 1)
    foreach.lerp_(exp_avgs, grads, [1 - b for b in beta1])
    foreach.mul_(exp_infs, beta2)
    bound = foreach.abs(grads)
    foreach.add_(bound, _floats(hypers, "eps"))
    foreach.maximum_(exp_infs, bound)
    clr = [-float(h["lr"]) / (1 - b**s) for h, b, s in zip(hypers, beta1, steps)]
    foreach.addcdiv_(params, exp_avgs, exp_infs, clr)


def _nadam(params, grads, states, hypers, fixed):
    exp_avgs, exp_avg_sqs = _state(states, params, "exp_avg"), _state(states, params, "exp_avg_sq")
    for state in states:
        state.setdefault("mu_product", torch.tensor(1.0, dtype=_scalar_dtype()))
    steps = _steps(states)
    if fixed.get("decoupled_weight_decay"):
        _decay(params, hypers)
    else:
        grads = _l2(grads, params, hypers)
    beta1 = _floats(hypers, "betas", 0)
    decay = _floats(hypers, "momentum_decay")
    mu = [b * (1.0 - 0.5 * 0.96 ** (s * d)) for b, s, d in zip(beta1, steps, decay)]
    mu_next = [b * (1.0 - 0.5 * 0.96 ** ((s + 1) * d)) for b, s, d in zip(beta1, steps, decay)]
    products = [s["mu_product"] for s in states]
    foreach.mul_(products, mu)
    _, beta2 = _moments(exp_avgs, exp_avg_sqs, grads, hypers)
    denom = foreach.div(exp_avg_sqs, [1 - b**s for b, s in zip(beta2, steps)])
    foreach.sqrt_(denom)
    foreach.add_(denom, _floats(hypers, "eps"))
    product = [float(p) for p in products]
    lrs = _floats(hypers, "lr")
    foreach.addcdiv_(params, grads, denom, [-lr * (1 - m) / (1 - p) for lr, m, p in zip(lrs, mu, product)])
    foreach.addcdiv_(
        params, exp_avgs, denom, [-lr * n / (1 - p * n) for lr, n, p in zip(lrs, mu_next, product)]
    )


def _radam(params, grads, states, hypers, fixed):
    exp_avgs, exp_avg_sqs = _state(states, params, "exp_avg"), _state(states, params, "exp_avg_sq")
    steps = _steps(states)
    if fixed.get("decoupled_weight_decay"):
        _decay(params, hypers)
    else:
        grads = _l2(grads, params, hypers)
    beta1, beta2 = _moments(exp_avgs, exp_avg_sqs, grads, hypers)
    rectified, plain = [], []
    for i, (h, b1, b2, s) in enumerate(zip(hypers, beta1, beta2, steps)):
        bc1, bc2 = 1 - b1**s, 1 - b2**s
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * s * b2**s / bc2
        lr = float(h["lr"])
        if rho > 5.0:
            rect = ((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)) ** 0.5
            rectified.append((i, -lr * rect * bc2**0.5 / bc1))
        else:
            plain.append((i, -lr / bc1))
    if rectified:
        index = [i for i, _ in rectified]
        denom = foreach.sqrt([exp_avg_sqs[i] for i in index])
        foreach.add_(denom, [float(hypers[i]["eps"]) for i in index])
        foreach.addcdiv_([params[i] for i in index], [exp_avgs[i] for i in index], denom,
                         [c for _, c in rectified])
    if plain:
        index = [i for i, _ in plain]
        foreach.add_([params[i] for i in index],
                     foreach.mul([exp_avgs[i] for i in index], [c for _, c in plain]))


def _sgd(params, grads, states, hypers, fixed):
    grads = _l2(grads, params, hypers)
    momenta = _floats(hypers, "momentum")
    if any(momenta):
        grads = list(grads)
        for i, (state, grad, h, momentum) in enumerate(zip(states, grads, hypers, momenta)):
            if momentum == 0:
                continue
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = buf = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - float(h["dampening"]))
            grads[i] = grad.add(buf, alpha=momentum) if fixed.get("nesterov") else buf
    foreach.add_(params, foreach.mul(grads, [-float(h["lr"]) for h in hypers]))


def _rmsprop(params, grads, states, hypers, fixed):
    centered = bool(fixed.get("centered"))
    momenta = _floats(hypers, "momentum")
    square_avgs = _state(states, params, "square_avg")
    grad_avgs = _state(states, params, "grad_avg") if centered else []
    _steps(states)
    grads = _l2(grads, params, hypers)
    alphas = _floats(hypers, "alpha")
    foreach.mul_(square_avgs, alphas)
    foreach.addcmul_(square_avgs, grads, grads, [1 - a for a in alphas])
    if centered:
        foreach.lerp_(grad_avgs, grads, [1 - a for a in alphas])
        avg = foreach.addcmul(square_avgs, grad_avgs, grad_avgs, [-1.0] * len(params))
        foreach.sqrt_(avg)
    else:
        avg = foreach.sqrt(square_avgs)
    foreach.add_(avg, _floats(hypers, "eps"))
    lrs = [-float(h["lr"]) for h in hypers]
    moving = [i for i, m in enumerate(momenta) if m > 0]
    still = [i for i, m in enumerate(momenta) if m <= 0]
    if moving:
        bufs = _state([states[i] for i in moving], [params[i] for i in moving], "momentum_buffer")
        foreach.mul_(bufs, [momenta[i] for i in moving])
        foreach.addcdiv_(bufs, [grads[i] for i in moving], [avg[i] for i in moving])
        foreach.add_([params[i] for i in moving], foreach.mul(bufs, [lrs[i] for i in moving]))
    if still:
        foreach.addcdiv_([params[i] for i in still], [grads[i] for i in still], [avg[i] for i in still],
                         [lrs[i] for i in still])


Update = Callable[[list, list, list, list, dict], None]
# The classes with a multi-tensor update; exactly these classes (a subclass may change step()).
MULTI_TENSOR: dict[type, Update] = {
    torch.optim.SGD: _sgd,
    torch.optim.Adam: _adam,
    torch.optim.AdamW: _adam,
    torch.optim.Adagrad: _adagrad,
    torch.optim.RMSprop: _rmsprop,
    torch.optim.Adamax: _adamax,
    torch.optim.NAdam: _nadam,
    torch.optim.RAdam: _radam,
}
