"""FP16 and BF16 tables, against the stated exact reference (2 ranks, gloo).

Reference (``_precision_bodies``): ``torch.optim`` in float32 on a float32 copy of the stored
weights, re-read every step, on the float32 gradient of the global batch, the result rounded once
to the stored dtype, to nearest even. Ours runs such tables in the fallback on touched rows
(FBGEMM's CPU TBE rounds each FP16 update twice and has no BF16 kernels), fused where our compiled
backward steps FP16, and on data_parallel as the replicated kind (the whole table, its gradient
averaged across ranks). Compared after every step, ulp by ulp; batches that touch only half of the
rows alternate with full ones where lazy and dense ``torch.optim`` agree (on data_parallel, dense,
for every optimizer). Mutants must fail: the gradient rounded to the stored dtype before the
update, a float32 master copy kept between steps (the final rounding skipped), and on
data_parallel the ranks' gradients summed, not averaged, and a kernel blind to ``no_step``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from _precision_bodies import (
    checkpoint_dtypes, clipped_window, ddp_state, dense_first, frozen_lookup, refused, train,
)
from overlap_optim.testing import run_cases, selected_cases
from sharders import fused_rows

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")
EXACT = ("sgd", "sgd_momentum", "adagrad", "rowwise_adagrad", "adam", "adamw")
# One step, from the same weights: at most one ulp apart. A row's float32 gradient sums come in another
# order than the reference's (per id, then summed, across ranks; embedding_bag's backward), which may flip
# the one rounding where the float32 result lies near a tie. Measured here, free-running: 0 ulps at every
# step for BF16, and for FP16 but Adagrad (1 ulp at one step) and AdamW (its decay spreads results evenly
# between FP16 neighbours), where a flipped weight then feeds back through the loss (11 ulps after 4 steps).
ULPS = 1
FUSED_ON_CPU = ("sgd", "adagrad", "rowwise_adagrad")  # what FBGEMM fuses on CPU
COMPILED = fused_rows.applies(EmbOptimType.EXACT_SGD, "cpu")
FEEDS_BACK = {case for case in ("fp16/adamw/table_wise", "fp16/adamw/row_wise", "fp16/adamw/column_wise",
                                "fp16/adamw/table_row_wise")}

CASES = {}
for dtype_name, dtype in DTYPES.items():
    for optimizer in EXACT:
        for sharding_type in SHARDING_TYPES:
            CASES[f"{dtype_name}/{optimizer}/{sharding_type}"] = partial(train, dtype=dtype, optimizer=optimizer,
                                                                      sharding_type=sharding_type)
    # dense semantics: the whole shard stepped as a float32 copy, rounded once
    # FBGEMM's fused optimizers: FP16 tables fuse where our compiled backward runs; pinned to the fallback here
    for optimizer in FUSED_ON_CPU:
        for sharding_type in ("row_wise", "column_wise"):
            CASES[f"{dtype_name}/{optimizer}/{sharding_type}/fallback"] = partial(
                train, dtype=dtype, optimizer=optimizer, sharding_type=sharding_type, fallback=True)
    CASES[f"{dtype_name}/adafactor/table_wise"] = partial(train, dtype=dtype, optimizer="adafactor",
                                                          sharding_type="table_wise")
    CASES[f"{dtype_name}/adam/row_wise/ec"] = partial(train, dtype=dtype, optimizer="adam", sharding_type="row_wise",
                                                      pooled=False)
    CASES[f"{dtype_name}/sgd/table_wise/ec"] = partial(train, dtype=dtype, optimizer="sgd", sharding_type="table_wise",
                                                       pooled=False)
    # data_parallel: every rank's float32 gradient averaged across ranks, the whole table stepped (dense)
    for optimizer in EXACT:
        CASES[f"{dtype_name}/{optimizer}/data_parallel"] = partial(train, dtype=dtype, optimizer=optimizer,
                                                                   sharding_type="data_parallel")
    CASES[f"{dtype_name}/adafactor/data_parallel"] = partial(train, dtype=dtype, optimizer="adafactor",
                                                             sharding_type="data_parallel")
    CASES[f"{dtype_name}/adam/data_parallel/ec"] = partial(train, dtype=dtype, optimizer="adam",
                                                           sharding_type="data_parallel", pooled=False)
# Cross-shard tables: a layer-wise optimizer on a table split across ranks, RowWiseAdagrad on column shards. Each
# shard's step (both halves, the round between them) on a float32 copy, rounded once when the round finishes it.
CROSS_SHARD = {}
for dtype_name, dtype in DTYPES.items():
    for optimizer, sharding_type in (("adafactor", "row_wise"), ("adafactor", "column_wise"), ("lamb", "row_wise"),
                                     ("lamb", "column_wise"), ("rowwise_adagrad", "column_wise"),
                                     ("adafactor", "table_row_wise")):
        CROSS_SHARD[f"{dtype_name}/{optimizer}/{sharding_type}/cross_shard"] = partial(
            train, dtype=dtype, optimizer=optimizer, sharding_type=sharding_type, split=True)
# Optimizer state kept in BF16 or FP16 (state_dtype=): the reference rounds each state tensor after each step.
STATE = {
    "state/bf16_adam/fp16_table/table_wise": partial(train, dtype=torch.float16, optimizer="adam",
                                                     sharding_type="table_wise", state_dtype=torch.bfloat16),
    "state/fp16_adagrad/bf16_table/column_wise": partial(train, dtype=torch.bfloat16, optimizer="adagrad",
                                                         sharding_type="column_wise", state_dtype=torch.float16),
    "state/bf16_sgd_momentum/fp16_table/table_row_wise": partial(
        train, dtype=torch.float16, optimizer="sgd_momentum", sharding_type="table_row_wise",
        state_dtype=torch.bfloat16),
    "state/bf16_adam/fp16_table/reloaded": partial(train, dtype=torch.float16, optimizer="adam",
                                                   sharding_type="row_wise", state_dtype=torch.bfloat16, reload=True),
    # dense semantics: the whole shard's state stepped as float32 copies, rounded once
    "state/bf16_adam/fp16_table/dense_tables": partial(train, dtype=torch.float16, optimizer="adam",
                                                       sharding_type="row_wise", state_dtype=torch.bfloat16, dense=True),
    "state/fp16_adam/bf16_table/dense_tables": partial(train, dtype=torch.bfloat16, optimizer="adam",
                                                       sharding_type="table_wise", state_dtype=torch.float16,
                                                       dense=True),
    "state/bf16_adafactor/bf16_table/table_wise": partial(train, dtype=torch.bfloat16, optimizer="adafactor",
                                                          sharding_type="table_wise", state_dtype=torch.bfloat16),
    "state/bf16_adam/fp16_table/dense_tables/reloaded": partial(
        train, dtype=torch.float16, optimizer="adam", sharding_type="table_row_wise", state_dtype=torch.bfloat16,
        dense=True, reload=True),
    "state/bf16_adam/fp16_table/data_parallel": partial(train, dtype=torch.float16, optimizer="adam",
                                                        sharding_type="data_parallel", state_dtype=torch.bfloat16),
    "state/bf16_adam/fp16_table/data_parallel/reloaded": partial(
        train, dtype=torch.float16, optimizer="adam", sharding_type="data_parallel", state_dtype=torch.bfloat16,
        reload=True),
}
# cross-shard: the working copies live from the first half to the second. (state, optimizer, table, sharding, options)
for state, optimizer, table, sharding_type, options in (
        ("bf16", "adafactor", "fp16", "row_wise", {}), ("bf16", "lamb", "fp16", "column_wise", {}),
        ("bf16", "lamb", "bf16", "row_wise", {"reload": True}), ("fp16", "adafactor", "fp16", "column_wise", {}),
        ("fp16", "rowwise_adagrad", "bf16", "column_wise", {})):
    name = f"state/{state}_{optimizer}/{table}_table/{sharding_type}/cross_shard" + ("/reloaded" if options else "")
    STATE[name] = partial(train, dtype=DTYPES[table], optimizer=optimizer, sharding_type=sharding_type,
                          state_dtype=DTYPES[state], split=True, **options)
DDP_STATE = {
    "ddp_hook/bf16_adam": partial(ddp_state, state_dtype=torch.bfloat16),
}
# an FP16 data-parallel table beside a float32 one, clipped by norm together, two micro-batches a step
WINDOWS = {"data_parallel/clipped_window": clipped_window}
MUTANTS = {
    "mutant/round_gradient": partial(train, dtype=torch.float16, optimizer="sgd", sharding_type="table_wise",
                                     mutant="round_gradient", fallback=True),
    "mutant/master_copy": partial(train, dtype=torch.bfloat16, optimizer="adam", sharding_type="table_wise",
                                  mutant="master_copy"),
    "mutant/master_copy/cross_shard": partial(train, dtype=torch.bfloat16, optimizer="lamb", sharding_type="row_wise",
                                              split=True, mutant="dense_master_copy"),
    "mutant/master_copy/dense_tables": partial(train, dtype=torch.float16, optimizer="adam", sharding_type="row_wise",
                                               dense=True, mutant="dense_master_copy"),
    # data_parallel: the ranks' gradients summed, not averaged; the averaged gradient rounded to FP16
    "mutant/data_parallel/summed": partial(train, dtype=torch.float16, optimizer="sgd",
                                           sharding_type="data_parallel", mutant="dp_summed"),
    "mutant/data_parallel/window_ignored": partial(clipped_window, mutant=True),
    "mutant/data_parallel/round_gradient": partial(train, dtype=torch.float16, optimizer="sgd",
                                                   sharding_type="data_parallel", mutant="dp_round_gradient"),
}
REFUSED = {
    # stepped by the user's own optimizer on its FP16 .grad
    "refused/data_parallel_user": partial(refused, dtype=torch.bfloat16, optimizer="user",
                                          sharding_type="data_parallel"),
}
# Frozen tables (requires_grad=False): looked up in float32, never written.
FROZEN = {f"frozen/{dtype_name}/{sharding_type}{'' if pooled else '/ec'}": partial(
    frozen_lookup, dtype=dtype, sharding_type=sharding_type, pooled=pooled)
    for dtype_name, dtype in DTYPES.items() for sharding_type in ("table_wise", "row_wise", "data_parallel")
    for pooled in (True, False)}
CHECKPOINTS = {  # saved as, loaded into
    "checkpoint/fp32_into_fp16": (torch.float32, torch.float16),
    "checkpoint/fp32_into_bf16": (torch.float32, torch.bfloat16),
    "checkpoint/fp16_into_fp32": (torch.float16, torch.float32),
    "checkpoint/fp16_into_fp16": (torch.float16, torch.float16),
    "checkpoint/bf16_into_bf16": (torch.bfloat16, torch.bfloat16),
}
CAST = [name for name, (saved, loaded) in CHECKPOINTS.items() if saved != loaded]
SAME = [name for name, (saved, loaded) in CHECKPOINTS.items() if saved == loaded]
# How each load form asks for the cast, as its refusal says.
FORMS = {"checkpoint": "pass cast=True", "state_dict": "value.to({loaded})", "dcp": "LoadPlanner(cast=True)"}
ALL = {**CASES, **CROSS_SHARD, **STATE, **DDP_STATE, **WINDOWS, **MUTANTS, **REFUSED, **FROZEN,
       **{name: None for name in CHECKPOINTS}, "checkpoint/dense_layer_first": dense_first}


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("precision"))
    cases = {**ALL, **{name: partial(checkpoint_dtypes, directory=directory, saved=saved, loaded=loaded)
                       for name, (saved, loaded) in CHECKPOINTS.items()}}
    return run_cases(cases, selected_cases(request, cases), timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_each_step_equals_the_float32_reference_rounded_once(ranks, case):
    for result in ranks[case]:
        assert max(result["step_ulps"]) <= ULPS, (case, result["step_ulps"])
        if case not in FEEDS_BACK:  # free-running too
            assert max(result["ulps"]) <= ULPS, (case, result["ulps"])
        assert result["moved"] > 8, f"{case}: the reference must move ({result['moved']} ulps)"
        assert result["state"] in ([], ["torch.float32"]), (case, result["state"])
        assert all(_runs_as(case) in runs for runs in result["runs_as"]), (case, result["runs_as"])


def _runs_as(case: str) -> str:
    """What describe() must say runs a case: a data-parallel table, the fallback on the whole table
    with its gradient averaged across ranks; an FP16 table of an optimizer FBGEMM fuses, where our
    compiled backward steps it (in float32, rounded once), fuses; every other low-precision table
    runs in the fallback."""
    dtype, optimizer, *rest = case.split("/")
    if "data_parallel" in rest:
        return "fallback: torch.optim on the whole table, gradient averaged across ranks"
    fuses = dtype == "fp16" and optimizer in FUSED_ON_CPU and "fallback" not in rest and COMPILED
    return "compiled backward" if fuses else "fallback"


@pytest.mark.parametrize("case", list(CROSS_SHARD))
def test_a_cross_shard_table_steps_as_its_optimizer_on_the_whole_table_rounded_once(ranks, case):
    """The reference is the optimizer's own class on the whole unsharded float32 copy; the table is split
    (both ranks hold a shard) and runs as the cross-shard kind."""
    for result in ranks[case]:
        assert all("across shards" in runs for runs in result["runs_as"]), (case, result["runs_as"])
        assert max(result["step_ulps"]) <= ULPS, (case, result["step_ulps"])
        assert max(result["ulps"]) <= ULPS, (case, result["ulps"])
        assert result["moved"] > 8, f"{case}: the reference must move ({result['moved']} ulps)"
        assert result["state"] in ([], ["torch.float32"]), (case, result["state"])


@pytest.mark.parametrize("case", list(STATE))
def test_low_precision_state_is_the_update_with_each_state_tensor_rounded(ranks, case):
    dtype = "torch.float16" if case.startswith("state/fp16_") else "torch.bfloat16"
    runs = {"/cross_shard": "across shards", "/dense_tables": "the whole table"}
    for result in ranks[case]:
        for marker, runs_as in runs.items():
            assert marker not in case or all(runs_as in r for r in result["runs_as"]), (case, result["runs_as"])
        assert max(result["step_ulps"]) <= ULPS, (case, result["step_ulps"])
        assert max(result["ulps"]) <= ULPS, (case, result["ulps"])
        assert result["moved"] > 8, f"{case}: the reference must move ({result['moved']} ulps)"
        assert result["state"] == [dtype], (case, result["state"])
        for held, planned in result["memory"]:  # the planner sizes weights and state by their dtypes
            assert abs(held - planned) <= 0.01 * planned, (case, result["memory"])


@pytest.mark.parametrize("case", list(DDP_STATE))
def test_low_precision_state_in_the_ddp_hook(ranks, case):
    for result in ranks[case]:
        # each step from our weights and state: float32 weights (DDP averages in another order than one
        # process), the state exactly the reference's rounded (at most one BF16 ulp, a tie)
        assert max(result["diffs"]) <= 1e-6, (case, result["diffs"])
        assert max(result["state_ulps"]) <= 1, (case, result["state_ulps"])
        assert result["state"] == ["torch.bfloat16"], result["state"]


@pytest.mark.parametrize("case", list(WINDOWS))
def test_a_data_parallel_table_is_clipped_and_accumulated_as_torch(ranks, case):
    """Against torch's clip_grad_norm_ over both tables, on the window's summed gradient: the
    global norm as torch's, the FP16 table within one ulp, the float32 one (our DDP hook) within 1e-5."""
    for result in ranks[case]:
        assert max(result["ulps"]) <= ULPS, result
        assert max(result["diffs"]) <= 1e-5, result
        for theirs, ours in result["norms"]:
            assert theirs > 1.0 and abs(theirs - ours) <= 1e-5 * theirs, result["norms"]  # it clipped
        assert result["moved"] > 8, result


@pytest.mark.parametrize("case", list(MUTANTS))
def test_a_mutant_of_the_rounding_rule_is_caught(ranks, case):
    for result in ranks[case]:
        assert max(result["ulps"]) > ULPS, (case, result["ulps"])


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_meet_the_reference_is_refused_by_table(ranks, case):
    messages = ranks[case]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "table 't0'" in messages[0] and any(s in messages[0] for s in ("FP16", "BF16", "state_dtype")), messages[0]


@pytest.mark.parametrize("case", list(FROZEN))
def test_a_frozen_table_is_looked_up_in_float32_and_never_written(ranks, case):
    for result in ranks[case]:
        assert result["diff"] <= 1e-6, (case, result["diff"])  # measured: 0 in every case
        assert result["unchanged"], f"{case}: a frozen table changed"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", CAST)
def test_a_weight_of_another_dtype_is_refused_in_every_load_form_unless_cast(ranks, case, form):
    """checkpoint.load, plain load_state_dict and dcp.load with our planner refuse, on every rank alike,
    naming each table and both dtypes, with nothing changed; asked, each casts once, to nearest even."""
    saved, loaded = CHECKPOINTS[case]
    results = [result[form] for result in ranks[case]]
    assert results[0]["refused"] == results[1]["refused"], "not the same refusal on every rank"
    for result in results:
        message = result["refused"]
        assert message is not None, f"{form}: {saved} loaded into {loaded} without asking"
        for table in ("t0", "t1"):
            assert f"embedding_bags.{table}.weight: saved {saved}, the model holds {loaded}" in message, message
        assert FORMS[form].format(loaded=loaded) in message, message
        assert result["unchanged"], f"{form}: the refused load changed the tables"
        assert result["ulps"] == 0, f"{form}, cast: not the saved weights rounded once: {result}"
        assert result["state"], f"{form}: the optimizer state loaded is not the saved one"


@pytest.mark.parametrize("case", CAST)
def test_whole_tensors_of_another_dtype_are_refused(ranks, case):
    saved, loaded = CHECKPOINTS[case]
    for result in ranks[case]:
        message = result["plain_tensors"]["refused"]
        assert f"embedding_bags.t1.weight: saved {saved}, the model holds {loaded}" in message, message
        assert result["plain_tensors"]["unchanged"], "the refused load changed the tables"


def test_a_refused_load_state_dict_changes_no_layer_loaded_before_the_tables(ranks):
    """DMP loads module by module: the check runs at the model's root, before its dense layer."""
    results = ranks["checkpoint/dense_layer_first"]
    assert results[0]["refused"] == results[1]["refused"], "not the same refusal on every rank"
    message = results[0]["refused"]
    assert "tables.embedding_bags.t0.weight: saved torch.float32, the model holds torch.float16" in message, message
    assert all(result["unchanged"] for result in results), "the refused load changed the model"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", SAME)
def test_a_weight_of_the_same_dtype_loads_in_every_form(ranks, case, form):
    """No false refusal: the weights and the optimizer state load exactly."""
    for result in ranks[case]:
        assert result[form]["refused"] is None, result[form]["refused"]
        assert result[form]["ulps"] == 0 and result[form]["state"], result[form]


@pytest.mark.parametrize("options", [{}, {"foreach": True}], ids=["own_step", "foreach_group"])
def test_low_precision_state_in_one_process_is_bitwise_the_rounded_reference(options):
    """A parameter's own step and a foreach group's one step: bitwise the reference with each state
    tensor rounded to BF16 after each step; the state is kept in BF16."""
    from _precision_bodies import round_state
    from overlap_optim import apply_optimizer_in_backward, get_optimizers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in reference.parameters()]
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05, **options},
                                state_dtype=torch.bfloat16)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05, **options)
    for _ in range(5):
        batch = torch.randn(16, 8)
        model(batch).square().mean().backward()
        reference(batch).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        round_state(ref_opt, torch.bfloat16)
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine, theirs)
    assert min((p - s).abs().max().item() for p, s in zip(reference.parameters(), start)) > 1e-2, "must move"
    state = get_optimizers(model).state_dict()["state"]
    assert {v.dtype for entry in state.values() for v in entry.values() if v.dim()} == {torch.bfloat16}


def test_a_state_dtype_that_is_not_bf16_or_fp16_is_refused_by_name():
    from overlap_optim import apply_optimizer_in_backward

    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"state_dtype must be torch.bfloat16, torch.float16 or None .* torch.int8"):
        apply_optimizer_in_backward(torch.optim.Adam, layer.parameters(), {"lr": 0.1}, state_dtype=torch.int8)
    assert not hasattr(layer.weight, "_optimizer_classes"), "a refused annotation changed the parameter"


def test_a_kind_that_keeps_float32_state_only_refuses_state_dtype_by_table():
    """Every built-in kind that steps a table keeps state_dtype; a kind without the flag (a new one,
    here the tests' recording kind) is refused at sharding, naming the table, as docs/refusals.md says."""
    from _recording_kind import recording_kind
    from overlap_optim import apply_optimizer_in_backward
    from sharders.kinds import check_kinds
    from sharders.optimizer_table import decide
    from sharders.refusals import refusal

    weight = torch.nn.Parameter(torch.zeros(4, 2))
    apply_optimizer_in_backward(torch.optim.Adam, [weight], {"lr": 0.1}, state_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"table 'recorded' .* float32 only") as err:
        decide("recorded", weight, "table_wise", [[0, 0]], "fused", (4, 2), "cpu", {}, kinds=check_kinds([recording_kind()]))
    assert refusal("low_precision_state").matches(str(err.value)), err.value


@pytest.mark.parametrize("cls", [torch.optim.Adagrad, RowWiseAdagrad], ids=["adagrad", "rowwise_adagrad"])
def test_state_an_optimizer_makes_when_built_is_kept_in_state_dtype(cls):
    """Adagrad's constructor makes its state (float32): a whole-shard table keeps it in BF16 before any step,
    as a checkpoint's sharded metadata says (the promise matrix loaded one into a fresh model)."""
    from overlap_optim.spec import AnnotationGroup, describe_optimizer
    from overlap_optim.table_optimizer import DenseTableOptimizer

    group = AnnotationGroup(describe_optimizer(cls, {"lr": 0.1}), torch.bfloat16)
    table = DenseTableOptimizer(torch.zeros(4, 2, dtype=torch.float16), group, "t0")
    assert table.state["sum"].dtype == torch.bfloat16, table.state
    assert table.state["step"].dtype == torch.float32, table.state  # a step counter keeps its dtype


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd_fused", "adam_fallback"])
def test_tables_of_different_dtypes_never_share_a_kernel(world_of_one, optimizer):
    """FP32, FP16 and BF16 tables of one collection, one annotation, one sharding type: each kernel
    holds tables of one dtype, and describe() names it."""
    import torch.distributed as dist
    from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import sharders
    from overlap_optim import apply_optimizer_in_backward
    from sharders.describe import kernel_rows

    types = {"t0": DataType.FP32, "t1": DataType.FP16, "t2": DataType.BF16, "t3": DataType.FP16}
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=16, feature_names=[f"f_{n}"], data_type=t)
        for n, t in types.items()])
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.1})
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in types},
    ).collective_plan(ebc, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(ebc, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    names = {"FP32": DataType.FP32, "FP16": DataType.FP16, "BF16": DataType.BF16}
    kernels = [(row[4].split(", "), row[9].split(" / ")[0]) for row in kernel_rows(dmp)]
    assert sorted(t for tables, _ in kernels for t in tables) == sorted(types), kernels
    for tables, dtype in kernels:
        assert {types[t] for t in tables} == {names[dtype]}, kernels


@pytest.mark.parametrize("kwargs", [{"cast": "yes"}, {"cast": 1}, {"weights": 0}], ids=["str", "int", "weights"])
def test_the_load_planner_refuses_a_bad_argument_by_name(kwargs):
    from overlap_optim.checkpoint import LoadPlanner

    with pytest.raises(TypeError, match=r"LoadPlanner: (cast takes True or False|weights takes the name)"):
        LoadPlanner(**kwargs)
