"""The decision table, and the refusals the sharder makes at sharding time (world size 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import sharders
from _sharded_parity import build
from sharders.optimizer_table import ALL_OPTIMIZERS, DOC_EXAMPLES, choose_kernel, decision_table_markdown, support_table_markdown

# Every kwarg that may reach FBGEMM: the translated ones, never a torch.optim name.
FBGEMM_NAMES = {"optimizer", "learning_rate", "eps"}


@pytest.mark.parametrize(
    "cls, kwargs, expected",
    [
        (torch.optim.SGD, {"lr": 0.1}, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}),
        (torch.optim.Adagrad, {"lr": 0.1},
         {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-10}),  # torch's default eps
        (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6},
         {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-6}),
    ],
)
def test_fusable_settings_are_translated_name_by_name(cls, kwargs, expected):
    for device in ("cpu", "cuda"):
        choice = choose_kernel(cls, kwargs, device)
        assert choice.fused and choice.fbgemm_kwargs == expected and set(choice.fbgemm_kwargs) <= FBGEMM_NAMES


@pytest.mark.parametrize(
    "cls, kwargs, reason",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9"),
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay=0.1"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "momentum=0.9"),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}, "lr_decay=0.1"),
        (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}, "initial_accumulator_value=0.1"),
        (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay=0.1"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.1}, "weight_decay=0.1: FBGEMM's CPU kernel ignores it"),
        (torch.optim.Adam, {"lr": 0.1}, "Adam: FBGEMM has no kernel verified exact on cpu"),
        (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, "Adam: "),
        (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop: "),
    ],
)
def test_what_fbgemm_cannot_reproduce_goes_to_the_fallback_with_the_reason(cls, kwargs, reason):
    choice = choose_kernel(cls, kwargs, "cpu")
    assert not choice.fused and choice.fbgemm_kwargs == {}
    assert reason in choice.reason


def test_refusals_name_the_table():
    with pytest.raises(ValueError, match="table 't3': LBFGS needs a closure"):
        choose_kernel(torch.optim.LBFGS, {}, "cpu", table="t3")
    with pytest.raises(ValueError, match="table 't3': no optimizer rules for device type 'mtia'"):
        choose_kernel(torch.optim.SGD, {"lr": 0.1}, "mtia", table="t3")
    with pytest.raises(ValueError, match=r"fused_params \['learning_rate', 'optimizer'\] set an optimizer"):
        sharders.EmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd", "learning_rate": 0.1})


@pytest.mark.parametrize("sharder", [sharders.EmbeddingBagCollectionSharder, sharders.EmbeddingCollectionSharder])
def test_fused_params_that_change_the_update_are_refused(sharder):
    # Accepted on the main of 2026-11-26: FBGEMM clamped the pooled output gradient, fused SGD ended 0.043 from
    # torch.optim (which moved 0.044), and describe() still said fused EXACT_SGD.
    for params in ({"gradient_clipping": True, "max_gradient": 1e-3}, {"weight_decay_mode": "COWCLIP"},
                   {"momentum": 0.5}, {"output_dtype": "FP16"}):
        with pytest.raises(ValueError, match=rf"fused_params \[.*'{sorted(params)[0]}'.*\]: FBGEMM would change"):
            sharder(fused_params=params)
    sharder(fused_params={"cache_load_factor": 0.2, "stochastic_rounding": False})  # placement only: accepted


def test_docs_show_the_decision_table():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
    assert decision_table_markdown(DOC_EXAMPLES) in docs, "regenerate: python -m sharders.optimizer_table"
    assert support_table_markdown(ALL_OPTIMIZERS) in docs, "regenerate: python -m sharders.optimizer_table"




def test_a_table_without_annotation_gets_a_dense_kernel_not_fbgemms_default(world_of_one):
    dmp = _build_with_bare(["ok", "bare"])
    rows = {r.split(" | ")[4]: r for r in sharders.describe(dmp).splitlines()[2:]}
    assert "dense: .grad handed back to your optimizer" in rows["bare"] and "fused EXACT_SGD" in rows["ok"]


def _build_with_bare(names):
    from _models import ManyTableModel
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from overlap_optim import apply_optimizer_in_backward

    model = ManyTableModel(names)
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.embedding_bags["ok"].parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
        model, [sharder], dist.group.WORLD
    )
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def test_sharding_refuses_closure_optimizers_annotated_through_torch(world_of_one):
    from _models import ManyTableModel

    model = ManyTableModel(["t0"])
    _apply_optimizer_in_backward(torch.optim.LBFGS, model.ebc.parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder()
    with pytest.raises(ValueError, match="table 't0': LBFGS needs a closure in step"):
        sharder.shard(model.ebc, _plan_for(model, sharder)["ebc"], _env(), torch.device("cpu"))


def test_sharding_refuses_rowwise_adagrad_with_weight_decay_split_into_column_shards(world_of_one):
    with pytest.raises(ValueError, match="table 'rw': RowWiseAdagrad's update is not separable by columns .* and "
                                         "weight_decay=0.01 decays every row under dense semantics .* use table_wise, "
                                         "data_parallel, row_wise, table_row_wise for this table"):
        build(["rw"], [(RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01})], "column_wise", 1)


def _plan_for(model, sharder):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    return EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
        model, [sharder], dist.group.WORLD
    ).plan


def _env():
    from torchrec.distributed.types import ShardingEnv

    return ShardingEnv.from_process_group(dist.group.WORLD)


def test_register_optimizer_hook_refusals(world_of_one):
    from torch.nn.parallel import DistributedDataParallel

    from overlap_optim import apply_optimizer_in_backward, register_optimizer_hook

    with pytest.raises(TypeError, match="register_optimizer_hook takes a DistributedDataParallel, got Linear"):
        register_optimizer_hook(torch.nn.Linear(2, 2))
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"comm must be one of \('allreduce', 'fp16', 'bf16'\), got 'int8'"):
        register_optimizer_hook(ddp, comm="int8")
    model = torch.nn.Linear(2, 2)
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    with pytest.raises(NotImplementedError, match="find_unused_parameters=True with in-backward optimizers"):
        register_optimizer_hook(DistributedDataParallel(model, find_unused_parameters=True))


def test_dmp_built_on_meta_keeps_dense_annotations_and_drops_the_meta_parameters(world_of_one):
    from _models import TinyModel
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from overlap_optim import apply_optimizer_in_backward, unoptimized_parameters

    model = TinyModel(device="meta")
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    group = apply_optimizer_in_backward(torch.optim.Adam, model.dense[0].parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
        model, [sharder], dist.group.WORLD
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    params = dict(dmp.named_parameters())
    assert [p for p in group.param_group["params"] if p.is_meta] == []
    assert {id(p) for p in group.param_group["params"]} == {id(params["dense.0.weight"]), id(params["dense.0.bias"])}
    assert sorted(unoptimized_parameters(dmp)) == ["dense.2.bias", "dense.2.weight"]  # left to the user


def test_dense_tables_input_is_checked_by_name(world_of_one):
    from _models import TinyModel
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from overlap_optim import apply_optimizer_in_backward

    with pytest.raises(TypeError, match="dense_tables takes table names, got the string 't0'"):
        sharders.EmbeddingBagCollectionSharder(dense_tables="t0")
    for dense, message in ((["t0", "t9"], r"dense_tables names 't9', which is no table of the model; its tables are "
                                          r"\['ebc.t0', 'ebc.t1'\]"),
                           (["t1"], r"dense_tables names tables with no in-backward optimizer: \['t1'\]")):
        model = TinyModel()
        apply_optimizer_in_backward(torch.optim.Adam, model.ebc.embedding_bags["t0"].parameters(), {"lr": 0.1})
        sharder = sharders.EmbeddingBagCollectionSharder(dense_tables=dense)
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
            model, [sharder], dist.group.WORLD
        )
        with pytest.raises(ValueError, match=message):
            DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def test_a_qualified_table_name_needs_the_module_path_when_shard_is_called_by_hand(world_of_one):
    """``sharder.shard(module, ...)`` called by hand: ``dense_tables=["ebc.t0"]`` names the module's
    table ``t0`` by its path, which only ``module_fqn`` gives. Without it, refused by name (the option
    was silently ignored: t0 ran lazy); with it, t0 runs dense."""
    from _models import TinyModel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv

    from overlap_optim import apply_optimizer_in_backward

    model = TinyModel()
    apply_optimizer_in_backward(torch.optim.Adam, model.ebc.parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder(dense_tables=["ebc.t0"])
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
        model, [sharder], dist.group.WORLD
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    with pytest.raises(ValueError, match=r"dense_tables names \['ebc.t0'\], qualified by a module's path, and this "
                                         r"module was sharded without its path: pass module_fqn"):
        sharder.shard(model.ebc, plan.plan["ebc"], env, torch.device("cpu"))
    sharded = sharder.shard(model.ebc, plan.plan["ebc"], env, torch.device("cpu"), module_fqn="ebc")
    from sharders.describe import kernel_rows

    assert [row[7] for row in kernel_rows(sharded)] == ["t0: dense; t1: lazy"]


def test_materialized_dense_part_keeps_its_annotation_under_dmp(world_of_one):
    from _models import TinyModel
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from overlap_optim import apply_optimizer_in_backward, materialize

    model = TinyModel(device="meta")
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 0.1})
    materialize(model.dense, "cpu")
    for layer in (model.dense[0], model.dense[2]):
        layer.reset_parameters()
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).collective_plan(
        model, [sharder], dist.group.WORLD
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    dense = [p for n, p in dmp.named_parameters() if n.startswith("dense.")]
    assert len(dense) == 4 and all(p._optimizer_classes == [torch.optim.Adam] for p in dense)


def test_tables_annotated_by_torchs_function_train_exactly_and_share_a_param_group(world_of_one):
    import copy

    from _models import ManyTableModel, covering_batch, loss_of
    import overlap_optim

    names = ["t0", "t1"]
    model = ManyTableModel(names)
    reference = copy.deepcopy(model)
    settings = {"lr": 0.1, "momentum": 0.9}
    _apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), settings)
    ref_opt = torch.optim.SGD(reference.ebc.parameters(), **settings)
    sharder = sharders.EmbeddingBagCollectionSharder()
    dmp = _dmp(model, sharder)
    with torch.no_grad():
        for name in names:
            dmp.state_dict()[f"ebc.embedding_bags.{name}.weight"].local_shards()[0].tensor.copy_(
                reference.ebc.embedding_bags[name].weight)
    with pytest.warns(UserWarning, match="dense.0.weight"):  # the MLP is left to the user here
        keyed = overlap_optim.get_optimizers(dmp)
    assert [g["params"] for g in keyed.state_dict()["param_groups"] if "momentum" in g] == [
        ["ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"]]
    start = reference.ebc.embedding_bags["t0"].weight.detach().clone()
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = covering_batch(names, generator)
        loss_of(dmp, batch).backward()
        loss_of(reference, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.dense.zero_grad()
        for name in names:  # compare tables only: the MLP has no optimizer here
            got = dmp.state_dict()[f"ebc.embedding_bags.{name}.weight"].local_shards()[0].tensor
            torch.testing.assert_close(got, reference.ebc.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)
    assert (reference.ebc.embedding_bags["t0"].weight.detach() - start).abs().max() > 1e-3


def _dmp(model, sharder):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def test_local_sgd_registration_refusals(world_of_one):
    from torch.nn.parallel import DistributedDataParallel

    import overlap_optim
    from overlap_optim import QSR, apply_optimizer_in_backward, register_optimizer_hook

    def ddp(annotated=True, **kwargs):
        model = torch.nn.Linear(2, 2)
        if annotated:
            apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.1})
        return DistributedDataParallel(model, **kwargs)

    with pytest.raises(ValueError, match="compressed all-reduce is not supported with local SGD"):
        register_optimizer_hook(ddp(), comm="bf16", local_sgd=QSR())
    with pytest.raises(ValueError, match="local_sgd with find_unused_parameters=True is not supported"):
        register_optimizer_hook(ddp(annotated=False, find_unused_parameters=True), local_sgd=QSR(alpha=0))
    with pytest.raises(ValueError, match="QSR reads the lr of the annotated DDP parameters, and this model has none"):
        register_optimizer_hook(ddp(annotated=False), local_sgd=QSR(alpha=0.2))
    with pytest.raises(ValueError, match=r"average_state names \['momentum_buffer'\], which no annotated optimizer"):
        register_optimizer_hook(ddp(), local_sgd=QSR(average_state=("exp_avg", "momentum_buffer")))
    sync = QSR(alpha=0.2)
    model = ddp()
    register_optimizer_hook(model, local_sgd=sync)
    with pytest.raises(ValueError, match="registered with another model already"):
        register_optimizer_hook(ddp(), local_sgd=sync)
    for group in overlap_optim.get_optimizers(model).param_groups:
        group["lr"] = 0.0
    with pytest.raises(ValueError, match=r"local SGD at step 0: the learning rate is 0.0.*pass total_steps="):
        model(torch.ones(1, 2)).sum().backward()
