"""The table-kernel protocol: every kind registered, state sizes as measured, a step's bytes as
measured, no import circles, TorchRec's private names confined to ``sharders/_private.py``."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from came_pytorch import CAME
from pytorch_optimizer import LARS, GaLore, Lamb
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

import sharders
from _layerwise_bodies import GALORE_OPTIONS
from _memory import allocated_peak
from _models import ManyTableModel, covering_batch, loss_of
from overlap_optim import apply_optimizer_in_backward
from overlap_optim.round import EndOfBackwardRound
from overlap_optim.spec import AnnotationGroup, describe_optimizer
from sharders.cross_shard import CrossShardTable
from sharders.kernels import BuildContext, KernelChoice, KernelKind, TableDecision, TableKernel, split_axis
from sharders.kinds import KINDS, Kind
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("overlap_optim", "sharders")
# Only sharders/_private.py may spell these TorchRec internals.
CONFINED = ("._lookups", "._optim.", "_model_parallel_name_to_sharded_tensor", "._emb_modules", "_feature_table_map",
            "._original_tensor", '"_batch_key"', "_dmp_wrapped_module")


def test_every_kernel_kind_has_one_registry_line_and_its_class_names_it():
    assert sorted(kind.name for kind in KINDS) == sorted(KernelKind)
    assert all(kind.cls.kind is KernelKind(kind.name) for kind in KINDS)


def test_added_kinds_are_checked_where_they_enter():
    class Mine(TableKernel):
        kind = "mine"

    class Clash(TableKernel):
        kind = "lazy"

    assert sharders.EmbeddingBagCollectionSharder(kinds=[Kind(Mine, bool)]).kinds[0].cls is Mine
    with pytest.raises(TypeError, match=r"kinds takes sharders\.kinds\.Kind\(cls, runs\) lines .*got <class"):
        sharders.EmbeddingBagCollectionSharder(kinds=[Mine])
    with pytest.raises(ValueError, match=r"kinds: Clash is named 'lazy', as LazyTable is"):
        sharders.EmbeddingBagCollectionSharder(kinds=[Kind(Clash, bool)])


def _imports() -> dict[str, set[str]]:
    """module -> the modules of our two packages it imports at run time (not under TYPE_CHECKING)."""
    graph = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"{package}.{path.stem}" if path.stem != "__init__" else package
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    node.body = []
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
            graph[name] = found
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_circles_and_arrows_from_sharders_to_the_core_only():
    graph = _imports()
    back = sorted(m for m, deps in graph.items() if m.startswith("overlap_optim") and any(d.startswith("sharders") for d in deps))
    assert not back, f"the core imports sharders: {back}"
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError(f"import circle: {' -> '.join(stack[stack.index(module):] + [module])}")
        if module in done:
            return
        stack.append(module)
        for dep in sorted(graph[module] - {p for p in PACKAGES}):
            visit(dep)
        stack.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_torchrec_internals_are_spelled_only_in_sharders_private():
    offenders = [
        f"{path.relative_to(ROOT)}: {needle}"
        for path in sorted((ROOT / "sharders").glob("*.py")) if path.name != "_private.py"
        for needle in CONFINED if needle in path.read_text()
    ]
    assert not offenders, f"TorchRec internals outside sharders/_private.py: {offenders}"




SIZED = {  # table -> (optimizer, kwargs, sharding type): one per kind that keeps state
    "fused_adagrad": (torch.optim.Adagrad, {"lr": 0.1}, "table_wise"),
    "fused_rowwise": (RowWiseAdagrad, {"lr": 0.1}, "row_wise"),
    "lazy_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}, "table_wise"),
    "dense_adafactor": (torch.optim.Adafactor, {"lr": 0.01}, "table_wise"),
    "cross_adafactor": (torch.optim.Adafactor, {"lr": 0.01}, "column_wise"),
    "dp_adam": (torch.optim.Adam, {"lr": 0.01}, "data_parallel"),
}


def test_state_bytes_per_shard_are_the_bytes_each_kind_holds_after_a_step(world_of_one):
    names = list(SIZED)
    model = ManyTableModel(names, dim=8)
    for name, (cls, kwargs, _) in SIZED.items():
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    sharder = sharders.EmbeddingBagCollectionSharder()
    constraints = {n: ParameterConstraints(sharding_types=[SIZED[n][2]], min_partition=4) for n in names}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    loss_of(dmp, covering_batch(names, torch.Generator().manual_seed(0))).backward()
    tables = sharders.plan_of(dmp.module.ebc).tables
    assert {n: t.kind.value for n, t in tables.items()} == {
        "fused_adagrad": "fused", "fused_rowwise": "fused", "lazy_amsgrad": "lazy", "dense_adafactor": "dense",
        "cross_adafactor": "cross_shard", "dp_adam": "data_parallel"}
    for name, table in tables.items():
        if name == "dp_adam":
            weight = dmp.module.ebc.embedding_bags[name].weight
            held = [(tuple(weight.shape), weight._in_backward_optimizers[0].state[weight])]
        else:
            held = [(tuple(s.metadata.shard_sizes), s.state.state) for s in table.shards]
        assert held, name
        for shape, state in held:
            measured = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
            measured -= 4 * sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.dim() == 0) * (
                name.startswith("fused"))  # the fused step is our count, not FBGEMM's memory
            assert table.state_bytes(shape) == measured, (name, shape, table.state_bytes(shape), measured)
            assert measured > 0, name


TABLE = (4096, 64)  # 1 MB; a batch of 8 rows makes buffers of 2 KB
STEPPED = {  # cross-shard tables: (optimizer, kwargs, sharding type)
    "adafactor/row_wise": (torch.optim.Adafactor, {"lr": 0.01}, "row_wise"),
    "adafactor/column_wise": (torch.optim.Adafactor, {"lr": 0.01}, "column_wise"),
    "lamb/row_wise": (Lamb, {"lr": 0.01}, "row_wise"),
    "came/row_wise": (CAME, {"lr": 0.01}, "row_wise"),
    "came/column_wise": (CAME, {"lr": 0.01}, "column_wise"),
    "lars/row_wise": (LARS, {"lr": 0.01}, "row_wise"),
    "muon/row_wise": (torch.optim.Muon, {"lr": 0.01}, "row_wise"),
    "galore/column_wise": (GaLore, {"lr": 0.01}, "column_wise"),
    "rowwise_adagrad/column_wise": (RowWiseAdagrad, {"lr": 0.01}, "column_wise"),
    # FP16 and BF16 shards step a float32 copy, held through both halves, with float32 temporaries
    "lamb/row_wise/bf16": (Lamb, {"lr": 0.01}, "row_wise", torch.bfloat16),
    "adafactor/row_wise/fp16": (torch.optim.Adafactor, {"lr": 0.01}, "row_wise", torch.float16),
    "muon/row_wise/bf16": (torch.optim.Muon, {"lr": 0.01}, "row_wise", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(STEPPED))
def test_step_bytes_per_shard_are_the_peak_of_a_cross_shard_step(case):
    """The first of two shards of a 4096 x 64 table, a batch of 8 rows, its third step (the state
    is made): ``step_bytes`` is within 5% of a shard (26 KB) of the most the step allocated beyond
    what it held, the round (local: one process) included. Adafactor's is no shard-sized gradient
    (on row shards, under 5% of one); LAMB's is its three shard-sized temporaries. A low-precision
    shard's adds its float32 copy."""
    cls, kwargs, sharding_type, *dtype = STEPPED[case]
    dtype = dtype[0] if dtype else torch.float32
    shard = (TABLE[0] // 2, TABLE[1]) if split_axis(sharding_type) == 0 else (TABLE[0], TABLE[1] // 2)
    options = GALORE_OPTIONS if cls is GaLore else None  # its projection: rank 2, a new one every 2 steps
    group = AnnotationGroup(describe_optimizer(cls, kwargs, group_options=options))
    kind = next(k for k in KINDS if k.cls is CrossShardTable)
    table = CrossShardTable(TableDecision("t", sharding_type, TABLE, group, KernelChoice(False), kind))
    round_ = EndOfBackwardRound(local=True)
    table.join_round(round_)
    context = BuildContext(sharded=None, process_group=None, device_type="cpu", round=round_, tables={"t": table})
    config = SimpleNamespace(local_metadata=SimpleNamespace(shard_offsets=[0, 0]))  # TorchRec's: only this is read
    generator = torch.Generator().manual_seed(0)
    optimizer = table.make_optimizer(torch.randn(shard, generator=generator).to(dtype), config, context)
    batches = [(torch.randperm(shard[0], generator=generator)[:8], torch.randn(8, shard[1], generator=generator))
               for _ in range(3)]

    def step(ids, grads):
        optimizer.step(ids, grads)
        round_.run()

    for batch in batches[:2]:
        step(*batch)
    measured = allocated_peak(lambda: step(*batches[2]))
    counted, shard_bytes = table.step_bytes(shard, dtype), shard[0] * shard[1] * 4
    assert abs(counted - measured) <= 0.05 * shard_bytes, (case, counted, measured)
    if case == "adafactor/row_wise":
        assert measured < 0.05 * shard_bytes and counted < 0.05 * shard_bytes, (counted, measured)
    if case == "rowwise_adagrad/column_wise":  # the round's row sums (3 float64 copies of R), no shard-sized buffer
        assert counted == 3 * 8 * TABLE[0] and measured < 0.2 * shard_bytes, (counted, measured)
    if case.startswith("lamb"):
        assert counted >= 3 * shard_bytes + (shard_bytes if dtype != torch.float32 else 0), counted


def test_step_bytes_of_a_replicated_table_are_the_peak_of_its_step(world_of_one):
    """An FP16 data-parallel table of 4096 x 64 (the replicated kind), Adam, its third step:
    ``step_bytes`` (its float32 gradient in the round, 28 bytes an element) is within 5% of a float32
    table (1 MB) of the most its backward allocated beyond what it held."""
    from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t", embedding_dim=TABLE[1], num_embeddings=TABLE[0], feature_names=["f"], data_type=DataType.FP16,
    )], device=torch.device("cpu"))
    apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.01})
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                       constraints={"t": ParameterConstraints(sharding_types=["data_parallel"])})
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder],
                                   plan=planner.collective_plan(ebc, [sharder], dist.group.WORLD))
    batch = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.arange(8), lengths=torch.tensor([2, 2, 2, 2]))

    def step():
        dmp(batch)["f"].sum().backward()

    step()
    step()
    measured = allocated_peak(step)
    table = sharders.plan_of(dmp.module).tables["t"]
    assert table.kind is KernelKind.REPLICATED
    counted, table_bytes = table.step_bytes(TABLE), TABLE[0] * TABLE[1] * 4
    assert counted == 28 * TABLE[0] * TABLE[1]
    assert abs(counted - measured) <= 0.05 * table_bytes, (counted, measured)
