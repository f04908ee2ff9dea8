"""Rank bodies for the local-SGD tests (spawned; not collected by pytest).

The reference is :class:`Simulation`: one process, one replica per rank, each with its own
plain ``torch.optim`` optimizer and scheduler, stepping on its own rank's batch, averaging by
the rule. It shares no code with overlap_optim.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

import overlap_optim


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _batches(step, world_size):
    generator = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 5, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(world_size)]


def _loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


class Simulation:
    """Local SGD with the QSR period, by the formula, on ``world_size`` replicas in one process."""

    def __init__(self, world_size, make_optimizer, alpha, base_period, warmup_steps=0, power=2.0,
                 average_state=(), total_steps=None, schedule=None):
        self.replicas = [_mlp() for _ in range(world_size)]
        self.optimizers = [make_optimizer(r) for r in self.replicas]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers] if schedule else []
        self.alpha, self.base_period, self.warmup, self.power = alpha, base_period, warmup_steps, power
        self.average_state, self.total_steps = average_state, total_steps
        self.step, self.in_round, self.period, self.averaged_at = 0, 0, 0, []

    def _period(self):
        lr = max(g["lr"] for g in self.optimizers[0].param_groups)
        period = self.base_period if self.alpha == 0 else max(self.base_period, math.floor((self.alpha / lr) ** self.power))
        return min(period, self.total_steps - self.step) if self.total_steps else period

    def run_step(self, batches):
        synchronous = self.step < self.warmup
        if not synchronous and self.in_round == 0:
            self.period = self._period()
        for replica, batch in zip(self.replicas, batches):
            _loss(replica, batch).backward()
        if synchronous:  # the global batch's mean loss: the replicas' gradients averaged
            for params in zip(*(r.parameters() for r in self.replicas)):
                mean = torch.stack([p.grad for p in params]).mean(0)
                for p in params:
                    p.grad = mean.clone()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()
        self.step += 1
        if not synchronous:
            self.in_round += 1
            if self.in_round == self.period:
                self._average()
                self.in_round = 0
                self.averaged_at.append(self.step - 1)
        for scheduler in self.schedulers:
            scheduler.step()

    @torch.no_grad()
    def _average(self):
        for params in zip(*(r.parameters() for r in self.replicas)):
            mean = torch.stack([p.detach() for p in params]).mean(0)
            for p in params:
                p.copy_(mean)
            for name in self.average_state:
                states = [o.state[p][name] for o, p in zip(self.optimizers, params) if name in o.state[p]]
                if len(states) == len(params):
                    mean = torch.stack(states).mean(0)
                    for s in states:
                        s.copy_(mean)


def simulation_matches_periodic_model_averager(rank, world_size, period=3, steps=9):
    """Our reference against torch's PeriodicModelAverager (constant period, SGD with momentum):
    the averager averages after steps warmup, warmup + period, ...; warmup = period - 1 puts its
    averagings where the simulation's rounds end."""
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    sim = Simulation(world_size, make, alpha=0.0, base_period=period)
    model = _mlp()
    optimizer = make(model)
    averager = PeriodicModelAverager(period=period, warmup_steps=period - 1, process_group=dist.group.WORLD)
    worst = 0.0
    for step in range(steps):
        batches = _batches(step, world_size)
        sim.run_step(batches)
        _loss(model, batches[rank]).backward()
        optimizer.step()
        averager.average_parameters(list(model.parameters()))  # it averages parameters that have a grad
        optimizer.zero_grad()
        for p, q in zip(model.parameters(), sim.replicas[rank].parameters()):
            worst = max(worst, (p - q).abs().max().item())
    return {"worst": worst, "averaged_at": sim.averaged_at}


CASES = {
    "sgd_momentum_constant": dict(optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                  qsr=dict(alpha=0.0, base_period=3)),
    "adam_qsr_decaying": dict(optimizer=(torch.optim.Adam, {"lr": 0.02}),
                              qsr=dict(alpha=0.03, base_period=2, warmup_steps=2, average_state=("exp_avg", "exp_avg_sq"),
                                       total_steps=12),
                              schedule=lambda step: 0.85 ** step),
    "sgd_period_one": dict(optimizer=(torch.optim.SGD, {"lr": 0.1}), qsr=dict(alpha=0.0, base_period=1)),
}


def _counting_all_reduce(calls):
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    return original, counting


def ours_against_simulation(rank, world_size, name, steps=12):
    """One case through our DDP hook with local_sgd, against the simulation, every step: per step
    (all-reduces, sync.period, simulation's period), the worst difference, and whether ranks differ."""
    case = CASES[name]
    cls, kwargs = case["optimizer"]
    sim = Simulation(world_size, lambda m: cls(m.parameters(), **kwargs), schedule=case.get("schedule"), **case["qsr"])
    model = _mlp()
    overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs)
    sync = overlap_optim.QSR(**case["qsr"])
    ddp = DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ddp, local_sgd=sync)
    scheduler = None
    if case.get("schedule"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(overlap_optim.get_optimizers(ddp), case["schedule"])
    trace, worst = [], 0.0
    for step in range(steps):
        batches = _batches(step, world_size)
        sim.run_step(batches)
        calls = []
        original, counting = _counting_all_reduce(calls)
        dist.all_reduce = counting
        try:
            _loss(ddp, batches[rank]).backward()
        finally:
            dist.all_reduce = original
        if scheduler is not None:
            scheduler.step()
        for p, q in zip(model.parameters(), sim.replicas[rank].parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            worst = max(worst, diff)
            assert diff <= 1e-6, f"{name}, step {step}: {diff:.3g} from the simulation"
        trace.append((len(calls), sync.period, sim.period, sync.step))
    out = {"trace": trace, "worst": worst, "averaged_at": sim.averaged_at, "spread": _spread(model)}
    if name == "sgd_period_one":  # against synchronous training: every step a warm-up step
        synchronous = Simulation(world_size, lambda m: cls(m.parameters(), **kwargs), warmup_steps=steps, **case["qsr"])
        for step in range(steps):
            synchronous.run_step(_batches(step, world_size))
        out["vs_synchronous"] = max((p.detach() - q.detach()).abs().max().item()
                                    for p, q in zip(model.parameters(), synchronous.replicas[0].parameters()))
    return out


def _spread(model):
    """Largest difference of the parameters across ranks."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def _adam_under_qsr(seed):
    """(model, its DDP with our hook and a period-3 QSR, keyed optimizer, the QSR)."""
    model = _mlp(seed=seed)
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.02})
    sync = overlap_optim.QSR(alpha=0.0, base_period=3, average_state=("exp_avg",))
    ddp = DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ddp, local_sgd=sync)
    return model, ddp, overlap_optim.get_optimizers(ddp), sync


def mid_round_checkpoint(rank, world_size, directory, steps=10, saved_at=4):
    """A checkpoint taken between averagings (each rank's own dense state) resumes bit-identically
    on the same world size: (largest difference from the uninterrupted run, the QSR's state then)."""
    model, ddp, keyed, sync = _adam_under_qsr(seed=3)
    for step in range(steps):
        if step == saved_at:
            overlap_optim.checkpoint.save(directory, ddp, keyed, {"local_sgd": sync, "step": step})
            saved_state = sync.state_dict()
        _loss(ddp, _batches(step, world_size)[rank]).backward()
    resumed, ddp2, keyed2, sync2 = _adam_under_qsr(seed=5)  # other weights, fresh optimizer state
    overlap_optim.checkpoint.load(directory, ddp2, keyed2, {"local_sgd": sync2})
    assert sync2.state_dict() == saved_state
    for step in range(saved_at, steps):
        _loss(ddp2, _batches(step, world_size)[rank]).backward()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), resumed.parameters()))
    return {"resume_diff": diff, "saved": saved_state}


def load_on_one_rank(rank, world_size, directory):
    """The mid-round 2-rank checkpoint on 1 rank: refused, naming why."""
    _, ddp, keyed, sync = _adam_under_qsr(seed=0)
    try:
        overlap_optim.checkpoint.load(directory, ddp, keyed, {"local_sgd": sync})
    except overlap_optim.checkpoint.CheckpointError as err:
        return str(err)
    return "loaded"


def dmp_with_local_sgd(rank, world_size, steps=7, period=3):
    """Sharded tables (fused Adagrad, fallback Adam; row_wise) stay synchronous and exact while the
    dense part runs local SGD: against one shared set of tables stepped on the global batch and
    one dense replica per rank (its own optimizer on its own rank's batch, averaged every
    ``period`` steps). Returns, per step, the dense spread across ranks."""
    import sharders
    from _models import ManyTableModel, covering_batch, loss_of
    from _sharded_parity import local_pieces
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names, settings = ["fused", "fallback"], [(torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.05})]
    dense_setting = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    model = ManyTableModel(names, seed=4)
    reference = copy.deepcopy(model)
    for name, (cls, kwargs) in zip(names, settings):
        overlap_optim.apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    overlap_optim.apply_optimizer_in_backward(dense_setting[0], model.dense.parameters(), dense_setting[1])
    sync = overlap_optim.QSR(alpha=0.0, base_period=period)
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=["row_wise"], min_partition=4) for n in names},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper(local_sgd=sync))
    with torch.no_grad():
        for name in names:
            ref = reference.ebc.embedding_bags[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
    table_opts = [cls(reference.ebc.embedding_bags[n].parameters(), **kw) for n, (cls, kw) in zip(names, settings)]
    replicas = [copy.deepcopy(reference.dense) for _ in range(world_size)]
    dense_opts = [dense_setting[0](r.parameters(), **dense_setting[1]) for r in replicas]
    ours_dense = [p for n, p in dmp.named_parameters() if n.startswith("dense.")]
    spreads = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(60 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        total = 0
        for replica, part in zip(replicas, parts):  # the global mean loss, each rank's dense replica
            reference.dense = replica
            total = total + loss_of(reference, part) / world_size
        total.backward()
        for opt in table_opts:
            opt.step()
            opt.zero_grad()
        for replica, opt in zip(replicas, dense_opts):  # a local step: each replica on its own mean loss
            for p in replica.parameters():
                p.grad.mul_(world_size)
            opt.step()
            opt.zero_grad()
        if (step + 1) % period == 0:
            with torch.no_grad():
                for params in zip(*(r.parameters() for r in replicas)):
                    mean = torch.stack([p.detach() for p in params]).mean(0)
                    for p in params:
                        p.copy_(mean)
        for name in names:  # tables: synchronous, exact
            ref = reference.ebc.embedding_bags[name].weight.detach()
            for row, col, piece in local_pieces(dmp, name):
                diff = (piece - ref[row : row + piece.shape[0], col : col + piece.shape[1]]).abs().max().item()
                assert diff <= 1e-5, f"step {step}, table {name}: {diff:.3g}"
        for p, q in zip(ours_dense, replicas[rank].parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            assert diff <= 1e-5, f"step {step}, dense: {diff:.3g} from this rank's replica"
        flat = torch.cat([p.detach().reshape(-1) for p in ours_dense])
        gathered = [torch.zeros_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        spreads.append(max((g - gathered[0]).abs().max().item() for g in gathered))
    return {"spreads": spreads, "periods": sync.period}
