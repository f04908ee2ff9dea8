"""Layer-wise optimizers on split tables: Adafactor row_wise on 2 ranks against one process, state bytes, and the cost of the statistics round.

1. Step time. One Adafactor table (1M x 64; quick: 20k x 64), global batch 2 x 2048
   bags of 20 ids, a ``Linear(64, 1)`` head that nobody steps:

   - ``ours (2 ranks x 1 thread)``: the table annotated with ``torch.optim.Adafactor``,
     sharded ``row_wise`` by ``sharders.EmbeddingBagCollectionSharder`` under
     ``DistributedModelParallel`` on 2 gloo ranks, each with half the batch; the update
     runs in backward, whole-table statistics in one all-reduce (``overlap_optim/cross_shard_adafactor.py``);
   - ``one_process (2 threads)``: what a user does without us: ``nn.EmbeddingBag`` (dense
     gradient) holding the whole table in one process, the whole batch, and
     ``torch.optim.Adafactor`` stepped after backward; ``one_process (1 thread)`` the same
     on one thread.

   All peers run in the same two spawned processes, alternating round by round: both
   ranks take an ``ours`` step together (the time of a step is the slower rank's), then
   rank 0 takes a ``one_process`` step while rank 1 waits in a barrier. The 2 ranks share
   the machine's 2 cores, as the one-process peer's 2 threads do. After the timed steps,
   rank 0's shard is compared with the same rows of the one-process table (same start,
   same batches, same number of steps). At 1M rows they differ by ~1e-4 (0.6% of how far
   the rows moved): torch's fp32 ``param.norm()`` over 64M elements is off by ~0.6% on CPU
   and sets Adafactor's step size; ours sums ``||w||^2`` in float64 (in a side run it stayed
   within 4e-8 of torch's Adafactor run in float64, torch fp32 drifted 6e-6 per step).
2. Optimizer-state bytes of one 1M x 64 fp32 table (quick: 20k x 64): the state tensors of
   ``torch.optim.Adafactor`` and ``torch.optim.Adam`` after one step, and ours summed over
   the 2 ranks (every row shard also holds the whole column factor).
3. Communication: ``torch.distributed.all_reduce`` wrapped during one backward (the second
   step) of a model with 8 row_wise tables, all Adafactor, against the same model with 8
   Adam tables: the extra calls and bytes per step.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from benchmarks._sharded import DIM, Tower, batch
from benchmarks._timing import _summary, on_ranks
from overlap_optim import apply_optimizer_in_backward

LR = 1e-2
WORLD = 2
COMM_TABLES, COMM_ROWS = 8, 1_000
OURS, ONE_2, ONE_1 = "ours (2 ranks x 1 thread)", "one_process (2 threads)", "one_process (1 thread)"


def _shard(model: nn.Module, tables: list[str], world_size: int):
    """``model`` sharded row_wise by our sharder under DMP (gloo, CPU)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import sharders

    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={t: ParameterConstraints(sharding_types=["row_wise"]) for t in tables},
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def _local_pieces(dmp: nn.Module, table: str) -> list[tuple[int, torch.Tensor]]:
    """[(row offset, local tensor)] of ``table`` held by this rank."""
    value = dmp.state_dict()[f"ebc.embedding_bags.{table}.weight"]
    assert isinstance(value, ShardedTensor), type(value)
    return [(s.metadata.shard_offsets[0], s.tensor) for s in value.local_shards()]


def _kjt(ids: torch.Tensor, offsets: torch.Tensor, key: str = "f") -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(keys=[key], values=ids, offsets=torch.cat([offsets, torch.tensor([ids.numel()])]))


def _state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


# -- 1. step time ---------------------------------------------------------------------------------


def _one_process(table: torch.Tensor, head: nn.Module, whole: list) -> tuple:
    """(step, table module): ``nn.EmbeddingBag`` with a dense gradient, ``torch.optim.Adafactor`` after backward."""
    bag = nn.EmbeddingBag(table.shape[0], DIM, mode="sum", _weight=table.clone())
    head = copy.deepcopy(head)
    optimizer = torch.optim.Adafactor(bag.parameters(), lr=LR)
    count = [0]

    def step() -> None:
        ids, offsets = whole[count[0] % len(whole)]
        count[0] += 1
        head(bag(ids, offsets)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)

    return step, bag


def _timed(rank: int, world_size: int, rows: int, bags: int, pooling: int, warmup: int, repeats: int) -> dict:
    """Rank body: alternate ours (both ranks) and the one-process peers (rank 0); per-step seconds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tower(rows)  # table "t" on meta, head on CPU (the same on every rank: seeded)
    head = copy.deepcopy(model.head)
    apply_optimizer_in_backward(torch.optim.Adafactor, model.ebc.parameters(), {"lr": LR})
    dmp = _shard(model, ["t"], world_size)
    table = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1)) * 0.1
    with torch.no_grad():
        pieces = _local_pieces(dmp, "t")
        for offset, piece in pieces:
            piece.copy_(table[offset : offset + piece.shape[0]])
        start = [piece.clone() for _, piece in pieces]
    # Global batch s: the ranks' parts, rank after rank; rank r feeds its own part to ours.
    parts = [[batch(rows, bags, pooling, seed=4 * s + r) for r in range(world_size)] for s in range(4)]
    local = [_kjt(*p[rank]) for p in parts]
    whole = [(torch.cat([ids for ids, _ in p]), torch.arange(0, world_size * bags * pooling, pooling)) for p in parts]
    count = [0]

    def ours() -> None:
        kjt = local[count[0] % len(local)]
        count[0] += 1
        dmp(kjt).backward()

    peers = {OURS: ours}
    if rank == 0:  # each one-process peer on a table of its own, from the same start
        peers[ONE_2], reference = _one_process(table, head, whole)
        peers[ONE_1], one_thread = _one_process(table, head, whole)
    del table
    samples: dict[str, list[float]] = {name: [] for name in (OURS, ONE_2, ONE_1)}
    waiting_cpu = waiting_wall = 0.0
    for round_ in range(warmup + repeats):
        for name in (OURS, ONE_2, ONE_1):
            dist.barrier()
            if name in peers:
                torch.set_num_threads(2 if name == ONE_2 else 1)
                started = time.perf_counter()
                peers[name]()
                elapsed = time.perf_counter() - started
                torch.set_num_threads(1)
                dist.barrier()
                if round_ >= warmup:
                    samples[name].append(elapsed)
            else:  # rank 1 sits in this barrier while rank 0 takes a one-process step
                started, cpu = time.perf_counter(), time.process_time()
                dist.barrier()
                waiting_wall += time.perf_counter() - started
                waiting_cpu += time.process_time() - cpu
    result = {"samples": samples, "waiting_cpu_s": waiting_cpu, "waiting_wall_s": waiting_wall,
              "ours_state_bytes": sum(_state_bytes(s) for s in dmp.fused_optimizer.state.values()),
              "rounds": _round(dmp).rounds, "steps": count[0]}
    if rank == 0:  # rank 0's rows of the table: ours against the 2-thread peer, after as many steps
        with torch.no_grad():
            result["max_diff"] = max((piece - reference.weight[offset : offset + piece.shape[0]]).abs().max().item()
                                     for offset, piece in pieces)
            result["moved"] = max((piece - s).abs().max().item() for (_, piece), s in zip(pieces, start))
            # torch against itself (2 threads against 1): the float noise of the same computation
            result["torch_2_vs_1_thread"] = (reference.weight - one_thread.weight).abs().max().item()
    return result


def _round(dmp: nn.Module):
    import sharders

    return next(sharders.plan_of(m).round for m in dmp.modules() if sharders.plan_of(m) is not None)


# -- 3. communication -----------------------------------------------------------------------------


class _Tables(nn.Module):
    def __init__(self, rows: int, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.names = [f"t{i}" for i in range(count)]
        configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{n}"])
                   for n in self.names]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.head = nn.Linear(count * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.head(torch.cat([pooled[f"f_{n}"] for n in self.names], dim=1)).sum()


def _all_reduces(rank: int, world_size: int, optimizer: type) -> dict:
    """all_reduce calls and bytes in one backward (the second step) of 8 row_wise tables."""
    model = _Tables(COMM_ROWS, COMM_TABLES)
    for name in model.names:
        apply_optimizer_in_backward(optimizer, model.ebc.embedding_bags[name].parameters(), {"lr": LR})
    dmp = _shard(model, model.names, world_size)
    generator = torch.Generator().manual_seed(rank)
    bags, pooling = 64, 5

    def kjt() -> KeyedJaggedTensor:
        ids = torch.randint(0, COMM_ROWS, (COMM_TABLES * bags * pooling,), generator=generator)
        return KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in model.names], values=ids,
                                                   lengths=torch.full((COMM_TABLES * bags,), pooling))

    dmp(kjt()).backward()  # the first step makes the state
    calls: list[int] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        dmp(kjt()).backward()
    finally:
        dist.all_reduce = original
    found = [_round(dmp)]
    return {"calls": len(calls), "bytes": sum(calls), "round_floats": found[0].size if found else 0}


def _body(rank: int, world_size: int, rows: int, bags: int, pooling: int, warmup: int, repeats: int) -> dict:
    timed = _timed(rank, world_size, rows, bags, pooling, warmup, repeats)
    comm = {cls.__name__: _all_reduces(rank, world_size, cls) for cls in (torch.optim.Adafactor, torch.optim.Adam)}
    return {"timed": timed, "comm": comm}


# -- 2. state bytes (one process) -----------------------------------------------------------------


def _torch_state_bytes(rows: int) -> dict[str, int]:
    """Bytes of the state tensors of torch's optimizer on one rows x DIM fp32 table after one step."""
    found = {}
    for cls in (torch.optim.Adafactor, torch.optim.Adam):
        weight = nn.Parameter(torch.zeros(rows, DIM))
        optimizer = cls([weight], lr=LR)
        weight.grad = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(0))
        optimizer.step()
        found[cls.__name__] = _state_bytes(optimizer.state[weight])
        del optimizer, weight
    return found


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows = 20_000 if quick else 1_000_000
    bags, pooling = (256, 20) if quick else (2048, 20)
    warmup, repeats = (1, 3) if quick else (3, 15)
    ranks = on_ranks(_body, rows, bags, pooling, warmup, repeats, quick=quick, world_size=WORLD,
                  timeout=300 if quick else 1800)
    timed = [r["timed"] for r in ranks]
    per_step = [max(values) for values in zip(*(t["samples"][OURS] for t in timed))]  # the slower rank
    timings = {OURS: _summary(per_step), ONE_2: _summary(timed[0]["samples"][ONE_2]),
               ONE_1: _summary(timed[0]["samples"][ONE_1])}
    ours = timings[OURS]["median_s"]
    state = _torch_state_bytes(rows)
    ours_state = sum(t["ours_state_bytes"] for t in timed)
    comm = ranks[0]["comm"]
    extra_calls = comm["Adafactor"]["calls"] - comm["Adam"]["calls"]
    extra_bytes = comm["Adafactor"]["bytes"] - comm["Adam"]["bytes"]
    from overlap_optim.cross_shard_adafactor import AdafactorTable
    from overlap_optim.cross_shard_base import Geometry

    slot = AdafactorTable.slot_size(Geometry((COMM_ROWS, DIM), (0, 0), 0))
    expected = COMM_TABLES * slot * 8
    return {
        "setup": {"rows": rows, "dim": DIM, "ranks": WORLD, "bags_per_rank": bags, "pooling": pooling,
                  "lr": LR, "repeats": repeats, "warmup": warmup,
                  "max_abs_diff_ours_vs_torch_rank0_rows": timed[0]["max_diff"],
                  "max_abs_moved_rank0_rows": timed[0]["moved"],
                  "max_abs_diff_torch_2_vs_1_thread": timed[0]["torch_2_vs_1_thread"],
                  "statistics_rounds_per_ours_step": [t["rounds"] / t["steps"] for t in timed],
                  "rank1_cpu_s_while_waiting": timed[1]["waiting_cpu_s"],
                  "rank1_wall_s_while_waiting": timed[1]["waiting_wall_s"],
                  "comm_tables": COMM_TABLES, "comm_rows": COMM_ROWS, "slot_floats": slot},
        "timings": timings,
        "state_bytes": {"torch Adafactor": state["Adafactor"], "torch Adam": state["Adam"],
                        "ours Adafactor (sum over 2 ranks)": ours_state},
        "communication": {"all_reduce per step": {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in comm.items()},
                          "extra_calls": extra_calls, "extra_bytes": extra_bytes, "expected_extra_bytes": expected,
                          "round_floats": comm["Adafactor"]["round_floats"]},
        "ratios": {
            f"step time {ONE_2} / {OURS} (target >= 1.0)": timings[ONE_2]["median_s"] / ours,
            f"step time {ONE_1} / {OURS}": timings[ONE_1]["median_s"] / ours,
            f"optimizer-state bytes Adam / Adafactor ({rows} x {DIM} table)": state["Adam"] / state["Adafactor"],
            "optimizer-state bytes ours (2 ranks) / torch Adafactor": ours_state / state["Adafactor"],
            f"extra all-reduce calls per step, {COMM_TABLES} Adafactor vs Adam tables (target == 1)": float(extra_calls),
            f"extra all-reduce bytes per step / ({COMM_TABLES} tables x {slot} floats x 8 B = {expected} B)":
                extra_bytes / expected,
        },
    }
