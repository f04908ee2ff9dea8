"""The promise matrix: every sampled combination is exact, or refused as docs/refusals.md lists.

Hypothesis draws a whole configuration (:class:`_matrix.Config`): EBC, EC or both, tables whose
rows do not divide by the world size, each with a sharding type its collection supports, an
optimizer (fused, fallback, layer-wise, third-party), none, frozen, or dense semantics; batches that
touch every row or a third; weighted features, MEAN pooling, a table shared by two features; FP16 and
BF16 tables, BF16 optimizer state on tables and on the MLP; our DDP hook or the user's optimizer on
the MLP; clipping by norm or value over a set (by norm over everything, a step whose norm is not finite,
refused and skipped), ``no_step`` micro-batches, a scheduler, a checkpoint mid-run (in place, ``torch.save`` into fresh objects,
``overlap_optim.checkpoint`` under another plan or on one rank, a rollback, plain DCP under the same plan or another,
``load_state_dict`` under another plan); a model built on meta (handed to DMP,
materialized, or moved by ``to_empty``); VBE batches, declared; a managed-collision collection (its ids
remapped, slots evicted every step; row_wise, float32, not on meta, VBE or one rank); the loop by hand or through TorchRec's
``TrainPipelineSparseDist`` or ``TrainPipelineSparseDistLite``; 1 or 2 ranks. Each example runs in the spawned
group that the previous one left (:func:`overlap_optim.testing.run_cases`).

CI runs the "ci" profile: a fixed set of examples (tests/conftest.py). ``make test-matrix`` runs
thousands; ``--hypothesis-seed=N`` repeats a run. A failing example is shrunk; keep it below as an
``@example``.
"""

from __future__ import annotations

import functools
import hashlib
import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _matrix import (
    EBC_SHARDING_TYPES, EC_SHARDING_TYPES, NO_OPTIMIZER, OPTIMIZERS, TOL, Config, Table, new_directory, run,
)
from overlap_optim.testing import run_cases
from sharders.collection import SAFE_FUSED_PARAMS
from sharders.refusals import REFUSALS

COLUMN_SPLITS = ("column_wise", "table_column_wise")

# refusal name -> does ``config`` ask for it (read from the config alone, as the docs say it)
PREDICATES = {
    "not_separable": lambda c: any(t.optimizer == "rowwise_adagrad_wd" and t.sharding in COLUMN_SPLITS
                                   for t in c.tables),
    "clipped_user_table": lambda c: c.clip is not None and any(t.optimizer == "user" for t in c.tables),
    "clipped_unreduced_dense": lambda c: (c.clip is not None and c.clip[1] == "everything" and c.dense_part == "user_ddp"
                                          and c.world_size > 1),
    "fused_params_update_keys": lambda c: bool({k for k, _ in c.fused_params} - SAFE_FUSED_PARAMS),
    "unrunnable_compute_kernel": lambda c: any(t.kernel not in (None, "fused", "dense") for t in c.tables),
    # FP16 and BF16 run in the fallback: lazy, dense, cross-shard, and data_parallel (the whole table, its
    # gradient averaged across ranks); frozen ones are looked up in float32; user tables are float32 only.
    # BF16 state runs in every kind that steps a table (low_precision_state: FSDP2, not drawn here)
    "low_precision_table": lambda c: any(t.precision != "fp32" and t.optimizer == "user" for t in c.tables),
    # the matrix declares VBE (variable_batch=True): fused tables that cannot take it go to the fallback
    "variable_batch": lambda c: c.vbe and (
        c.micro > 1 or any(t.sharding == "data_parallel" or t.optimizer in NO_OPTIMIZER
                           or (t.mean and _type_of(c, t.name) in ("row_wise", "table_row_wise")) for t in c.tables)),
    "meta_dense_foreign_wrapper": lambda c: c.meta == "dmp" and c.dense_part == "user_ddp" and c.clip is not None
    and c.clip[1] == "everything",
    "managed_collision_state": lambda c: any(t.managed and t.optimizer in ("user", "adafactor", "galore")
                                             for t in c.tables),
    "managed_collision_weighted": lambda c: c.weighted and any(t.managed for t in c.tables),
    "ambiguous_table_option": lambda c: not c.qualified and any(
        t.dense and sum(u.bagged and u.name == t.name for u in c.tables) > 1 for t in c.tables if t.bagged),
}


def _type_of(config: Config, name: str) -> str:
    """The sharding type tables named ``name`` get (TorchRec's constraints go by name: the last one's)."""
    return {t.name: t.sharding for t in config.tables}[name]


def test_every_documented_refusal_has_a_predicate():
    assert sorted(PREDICATES) == sorted(r.name for r in REFUSALS if r.sampled)


@st.composite
def tables(draw, collection: str, index: int, cover: bool, weighted: bool, sharding: str | None = None) -> Table:
    """``sharding``: the type of the other EBC's table of the same name (TorchRec's constraints are by name)."""
    managed = collection == "mc"  # managed collision: row_wise, float32 (TorchRec's remapping runs on row shards)
    types = EC_SHARDING_TYPES if collection == "ec" else ("row_wise",) if managed else EBC_SHARDING_TYPES
    sharding = sharding or draw(st.sampled_from(types))
    dense = draw(st.booleans()) and sharding != "data_parallel"
    optimizers = list(OPTIMIZERS) + list(NO_OPTIMIZER)
    # lazy: only those with a lazy reference (a managed table's slots are never all touched)
    if (not cover or managed) and sharding != "data_parallel" and not dense:
        optimizers = [o for o in optimizers if o in NO_OPTIMIZER or OPTIMIZERS[o][2] or OPTIMIZERS[o][3]]
    optimizer = draw(st.sampled_from(optimizers))
    dense = dense and optimizer not in NO_OPTIMIZER
    return Table(
        # the EC's are named apart from the EBCs' (TorchRec's constraints go by table name)
        name=f"{'s' if collection == 'ec' else 'm' if managed else 't'}{index}", collection=collection,
        rows=draw(st.sampled_from([4, 6, 9] if managed else [1, 2, 5, 7, 9, 11, 13])),  # 1 row: an empty row shard
        sharding=sharding, optimizer=optimizer, dense=dense,
        mean=collection != "ec" and not weighted and draw(st.booleans()), shared=draw(st.booleans()),
        # the edges of a user's own inputs, now and then (most of them refused: rare, so that most
        # examples train)
        precision="fp32" if managed else draw(st.sampled_from(["fp32"] * 36 + ["fp16"] * 2 + ["bf16"] * 2)),
        state_bf16=optimizer not in NO_OPTIMIZER and draw(st.sampled_from([False] * 9 + [True])),
        kernel=None if sharding == "data_parallel" or managed else draw(st.sampled_from(
            [None] * 24 + ["fused", "dense", "key_value", "fused_uvm_caching"])),
    )


@st.composite
def configs(draw) -> Config:
    collections = draw(st.sampled_from([("ebc",), ("ec",), ("ebc", "ec"), ("ebc", "ebc_b"), ("mc",), ("ebc", "mc")]))
    managed = "mc" in collections
    cover = draw(st.booleans())
    weighted = ("ebc" in collections or managed) and draw(st.sampled_from([False] * 4 + [True] if managed else [False, True]))
    drawn = []
    for collection in collections:
        for index in range(draw(st.integers(1, 3 if len(collections) == 1 else 2))):
            twin = [t.sharding for t in drawn if t.bagged and collection == "ebc_b" and t.name == f"t{index}"]
            drawn.append(draw(tables(collection, index, cover, weighted, twin[0] if twin else None)))
    clip = draw(st.none() | st.tuples(st.sampled_from(["norm", "value"]), st.sampled_from(["tables", "everything"])))
    if clip is not None and clip[1] == "tables" and all(t.optimizer == "frozen" for t in drawn):
        clip = None  # an empty set: nothing to clip
    dense_part = draw(st.sampled_from(["hook", "fsdp", "tp", "tp_fsdp", "user", "user_ddp"]))
    non_finite = clip == ("norm", "everything") and draw(st.booleans())
    return Config(
        tables=tuple(drawn), world_size=draw(st.sampled_from([2, 2, 1])), weighted=weighted, cover=cover,
        qualified=draw(st.booleans()),
        fused_params=draw(st.sampled_from([()] * 20 + [
            (("cache_load_factor", 0.2),), (("stochastic_rounding", False),),
            (("gradient_clipping", True), ("max_gradient", 1e-3)), (("weight_decay_mode", "COWCLIP"),),
            (("momentum", 0.5),), (("output_dtype", "FP16"),),
        ])),
        dense_part=dense_part, clip=clip, micro=draw(st.sampled_from([1, 1, 2])),
        non_finite=non_finite,
        # the annotated MLP's Adam with BF16 state, as the tables' (state_bf16)
        dense_state_bf16=dense_part not in ("user", "user_ddp") and draw(st.sampled_from([False] * 4 + [True])),
        dense_optimizer="adam" if dense_part in ("user", "user_ddp") else draw(st.sampled_from(["adam", "adam", "adafactor", "galore"])),
        schedule=draw(st.booleans()),
        # a managed table's checkpoint on another world size is refused (tests/test_managed_collision.py)
        checkpoint=draw(st.sampled_from([None, "in_place", "rollback", "torch_save", "other_plan", "dcp",
                                         "dcp_other_plan", "state_dict_other_plan"] + ([] if managed else ["one_rank"]))),
        # tensor parallelism places real parameters: a meta MLP is not drawn with it
        meta=None if managed or dense_part.startswith("tp") else draw(
            st.sampled_from([None] * 12 + ["dmp", "materialize", "to_empty"])),
        seed=draw(st.integers(0, 1000)),
        vbe="ec" not in collections and not managed and draw(st.sampled_from([False] * 4 + [True])),
        compiled=draw(st.sampled_from([True] * 3 + [False])),
        # the synchronous pipelines that take a new iterator each step (Base stops for good at the end of
        # one); the others, SemiSync's order among them, in tests/test_pipelines.py. A step whose norm is
        # not finite raises inside progress(), which then repeats the batch: not drawn with one
        pipeline=None if clip == ("norm", "everything") and non_finite else draw(st.sampled_from(
            [None] * 4 + ["TrainPipelineSparseDist", "TrainPipelineSparseDistLite"])),
    )


T = Table


@pytest.fixture(scope="module")
def directory():
    return new_directory()


@given(config=configs())
# Fused tables, clipped by norm across row and column shards in a window: our compiled backward
# (issue 42) and FBGEMM's own, where the extension is not built.
@example(config=Config((T("t0", "ebc", 11, "row_wise", "adagrad", shared=True), T("t1", "ebc", 9, "column_wise", "sgd"),
                        T("s0", "ec", 7, "row_wise", "rowwise_adagrad")), weighted=True, cover=False,
                       clip=("norm", "tables"), micro=2, checkpoint="other_plan"))
@example(config=Config((T("t0", "ebc", 11, "row_wise", "adagrad", mean=True), T("t1", "ebc", 9, "column_wise", "sgd"),
                        T("s0", "ec", 7, "row_wise", "rowwise_adagrad")), cover=False,
                       clip=("norm", "everything"), micro=2, compiled=False))
# Regressions: each failed on the main of 2026-11-26 (issue 38).
# The keyed optimizer could not load its own state dict beside a plain-SGD table (fused, EBC and EC).
@example(config=Config((T("t0", "ebc", 7, "row_wise", "sgd"), T("t1", "ebc", 9, "table_wise", "adam")),
                       checkpoint="in_place"))
@example(config=Config((T("t0", "ec", 7, "column_wise", "sgd"),), checkpoint="torch_save"))
# A dense_tables table and a lazy fallback table of one sharding type share a TorchRec kernel.
@example(config=Config((T("t0", "ebc", 7, "column_wise", "sgd_momentum"),
                        T("t1", "ebc", 9, "column_wise", "sgd_momentum", dense=True))))
@example(config=Config((T("t0", "ec", 7, "column_wise", "sgd"), T("t1", "ec", 9, "column_wise", "adamw", dense=True)),
                       cover=False))
# Clipping by norm where a rank runs no model-parallel kernel of the collection.
@example(config=Config((T("t0", "ebc", 7, "data_parallel", "adam"), T("t1", "ebc", 9, "data_parallel", "sgd")),
                       clip=("norm", "tables")))
@example(config=Config((T("t0", "ebc", 7, "table_wise", "adam"),), clip=("norm", "everything")))
# A refusal in the second collection left the first one sharded (found by the matrix).
@example(config=Config((T("t0", "ebc", 5, "data_parallel", "sgd"), T("t0", "ec", 5, "data_parallel", "user")),
                       clip=("norm", "tables"), cover=False))
# dense_tables on two EBCs: a bare name failed in the first EBC, qualified names were not understood.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam", dense=True), T("t1", "ebc_b", 9, "table_wise", "sgd")),
                       cover=False))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t0", "ebc_b", 9, "row_wise", "adam", dense=True)),
                       qualified=True, cover=False))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t0", "ebc_b", 9, "row_wise", "adam", dense=True))))
# A row-split MEAN table made TorchRec divide every other feature of its EBC by its bag's length.
@example(config=Config((T("t0", "ebc", 5, "data_parallel", "sgd"), T("t1", "ebc", 5, "row_wise", "sgd", mean=True)),
                       cover=False))
@example(config=Config((T("t0", "ebc", 5, "column_wise", "sgd", mean=True), T("t1", "ebc", 5, "table_row_wise", "adam", mean=True))))
# A fused table with an empty row shard crashed in FBGEMM's CPU kernel on one rank; the other waited.
@example(config=Config((T("t0", "ebc", 1, "row_wise", "sgd"), T("t1", "ebc", 5, "table_wise", "adam"))))
@example(config=Config((T("s0", "ec", 1, "row_wise", "adagrad"),), clip=("norm", "tables")))
# LAMB on a one-row table: float32 rounding alone moves the reference 1.3e-5 from float64 in one step.
@example(config=Config((T("t0", "ebc", 1, "table_wise", "lamb"),), weighted=True))
# An EC row shard that got no id crashed the norm of its clipped fused kernel (one rank; the other waited).
@example(config=Config((T("s0", "ec", 11, "row_wise", "sgd", shared=True),), cover=False, clip=("norm", "tables")))
@example(config=Config((T("t0", "ebc", 5, "data_parallel", "sgd"), T("t1", "ebc", 7, "row_wise", "lamb", mean=True)),
                       world_size=1, cover=False, seed=296))
# TorchRec's mean-pooling divisor added 1e-6 to every bag length of an EBC with a row-split MEAN table:
# LAMB and Adagrad on rows with tiny gradients amplified it to 2e-5 and 4e-5 (make test-matrix, seeds 99, 4242).
@example(config=Config((T("t0", "ebc", 9, "row_wise", "lamb", mean=True, shared=True),), cover=False, micro=2, seed=66))
@example(config=Config((T("t0", "ebc", 13, "row_wise", "sgd", mean=True), T("t1", "ebc", 2, "data_parallel", "sgd", shared=True),
                        T("t2", "ebc", 13, "data_parallel", "adagrad", mean=True)), micro=2, seed=5))
@example(config=Config((T("t0", "ebc", 9, "data_parallel", "sgd"),
                        T("t1", "ebc", 5, "row_wise", "lamb", dense=True, mean=True, shared=True),
                        T("t2", "ebc", 13, "data_parallel", "sgd", mean=True)), cover=False, seed=273))
# Clipping binds hard on a two-row SGD table that a third of a batch touches: the reference moves 6e-5.
@example(config=Config((T("t0", "ebc", 2, "table_wise", "sgd"), T("t0", "ebc_b", 2, "table_wise", "sgd", mean=True,
                                                                      shared=True)),
                       world_size=1, cover=False, clip=("norm", "tables"), seed=1))
# A tensor-parallel MLP under FSDP2 over dp: each rank counted the replicated bias's whole gradient into the
# global norm (FSDP's group step handed clipping its local tensors, not the DTensor), and its BF16 state was
# placed as if split on dim 0 (full_tensor of a Shard(1) weight's moment failed).
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"),), dense_part="tp_fsdp", clip=("norm", "everything")))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"),), dense_part="tp_fsdp", dense_state_bf16=True,
                       checkpoint="dcp"))
# Every rank reading the same batch (a tensor-parallel MLP): LAMB with BF16 state on a two-row table moved
# 8e-4 from the reference, within its own bound, and through the next forwards the MLP and an Adagrad table.
@example(config=Config((T("t0", "ebc", 2, "table_wise", "sgd", precision="fp16"),
                        T("t0", "ebc_b", 2, "table_wise", "lamb", mean=True, state_bf16=True),
                        T("t1", "ebc_b", 5, "data_parallel", "adagrad", mean=True)),
                       cover=False, dense_part="tp", micro=2, seed=2))
# Adafactor on a tensor-parallel MLP over one rank (every mesh dimension of one rank): its state entries were
# placed as split along the weight's Shard(1), on a mesh that splits nothing (a (1, 1) factor read as (1, 4)),
# and a checkpoint of it refused to load; the same into a model sharded for one rank.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 5, "table_wise", "sgd")),
                       dense_part="tp_fsdp", dense_optimizer="adafactor", world_size=1, checkpoint="torch_save"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 5, "table_wise", "sgd")),
                       dense_part="tp", dense_optimizer="adafactor", checkpoint="one_rank"))
# A refusal at sharding beside a tensor-parallel MLP: the user parallelizes it once annotated, before DMP
# (the harness did it inside the sharding step, and so saw the refused call change the model).
@example(config=Config((T("s0", "ec", 1, "table_wise", "user", kernel="key_value"),), cover=False, dense_part="tp"))
# Built and annotated on meta: handed to DMP, materialized, or moved by to_empty (which trained nothing, silently).
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("s0", "ec", 5, "data_parallel", "adagrad")),
                       dense_part="fsdp", meta="dmp", checkpoint="torch_save"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 9, "data_parallel", "frozen")),
                       meta="materialize", clip=("norm", "everything")))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("s1", "ec", 5, "column_wise", "user")),
                       dense_part="user_ddp", meta="to_empty"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "user"),), dense_part="user", meta="to_empty"))
# VBE batches (declared): the fallback had no variable-batch lookup, FBGEMM's Adagrad no variable-batch backward.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 9, "table_wise", "adagrad", shared=True),
                        T("t2", "ebc", 5, "column_wise", "sgd")), vbe=True, weighted=True))
@example(config=Config((T("t0", "ebc", 7, "table_row_wise", "lamb", mean=True),
                        T("t0", "ebc_b", 9, "column_wise", "rowwise_adagrad")),
                       vbe=True, clip=("norm", "tables"), cover=False, checkpoint="other_plan"))
@example(config=Config((T("t0", "ebc", 7, "table_wise", "adam", dense=True),
                        T("t1", "ebc", 7, "column_wise", "adafactor", shared=True)),
                       vbe=True, checkpoint="one_rank", dense_part="fsdp"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "sgd"), T("t1", "ebc", 5, "data_parallel", "adam")), vbe=True))
# A meta-built MLP clipped under TorchRec's default wrapper lost its clipping set (make test-matrix, seed 5150).
@example(config=Config((T("s0", "ec", 1, "data_parallel", "sgd"),), cover=False, dense_part="user_ddp",
                       clip=("norm", "everything"), meta="dmp"))
# VBE, two fallback kernels in one lookup: TorchRec joined their outputs kernel after kernel (0.34 off),
# and a fused and a fallback kernel in one lookup made TorchRec refuse (make test-matrix, seed 271828).
@example(config=Config((T("t0", "ebc", 1, "table_wise", "sgd"), T("t0", "ebc_b", 1, "table_wise", "adagrad"),
                        T("t1", "ebc_b", 1, "table_wise", "sgd")), cover=False, checkpoint="other_plan", vbe=True))
@example(config=Config((T("t0", "ebc", 1, "table_wise", "sgd"), T("t0", "ebc_b", 2, "table_wise", "sgd"),
                        T("t1", "ebc_b", 1, "table_wise", "sgd")), cover=False, checkpoint="other_plan", vbe=True))
# LAMB in its eps regime (|g| sqrt(1 - beta2) near eps): ours' gradient is as accurate as the reference's
# (1.6e-8 from float64, both), and the package's LAMB on the two ends 1.2e-5 apart (make test-matrix, seed 9001).
@example(config=Config((T("t0", "ebc", 11, "row_wise", "sgd"), T("s0", "ec", 7, "table_wise", "lamb", shared=True)),
                       micro=2, seed=122))
# A checkpoint of 2 ranks loaded on 1, which trains on with the global batch.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 9, "column_wise", "rowwise_adagrad"),
                        T("s0", "ec", 5, "table_wise", "adafactor")), clip=("norm", "everything"), schedule=True,
                       checkpoint="one_rank", micro=2))
@example(config=Config((T("t0", "ebc", 5, "data_parallel", "lamb"), T("t1", "ebc", 9, "table_row_wise", "adam")),
                       dense_part="fsdp", cover=False, checkpoint="one_rank", meta="to_empty"))
# Row-wise Adagrad on column shards, refused before (stock TorchRec keeps an accumulator per shard):
# its row statistic now crosses the shards in the round.
@example(config=Config((T("t0", "ebc", 7, "column_wise", "rowwise_adagrad"),
                        T("s0", "ec", 9, "column_wise", "rowwise_adagrad", shared=True)),
                       cover=False, clip=("norm", "tables"), checkpoint="other_plan", micro=2))
@example(config=Config((T("t0", "ebc", 5, "table_column_wise", "rowwise_adagrad", mean=True),), world_size=1,
                       schedule=True, checkpoint="torch_save"))
# Cross-shard Adafactor under MEAN pooling: its variance floor bound (make test-matrix, seed 8086).
@example(config=Config((T("t0", "ebc", 7, "data_parallel", "sgd", mean=True),
                        T("t1", "ebc", 11, "column_wise", "adafactor", mean=True),
                        T("t2", "ebc", 11, "data_parallel", "sgd", mean=True)), seed=4))
# Adam on an MLP gradient that two micro-batches nearly cancel: summation order alone moves the float32
# reference 8.9e-5 from float64 (make test-matrix, seed 8086); the MLP is held to the same rule as tables.
@example(config=Config((T("s0", "ec", 11, "data_parallel", "sgd", shared=True),
                        T("s1", "ec", 11, "data_parallel", "sgd", shared=True),
                        T("s2", "ec", 11, "data_parallel", "sgd", shared=True)), micro=2, seed=385))
# Plain DCP into a fresh model and optimizer was silently wrong (nothing lazy to fill: SGD momentum
# 0.0875 off), and the state dict held in memory under another plan crashed or split the ranks (issue 39).
@example(config=Config((T("t0", "ebc", 7, "row_wise", "sgd_momentum"), T("t1", "ebc", 9, "table_wise", "adagrad"),
                        T("s0", "ec", 5, "column_wise", "adafactor"), T("t2", "ebc", 5, "data_parallel", "frozen")),
                       schedule=True, checkpoint="dcp"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 9, "column_wise", "lamb"),
                        T("t2", "ebc", 5, "table_wise", "sgd")), dense_part="user", micro=2,
                       clip=("norm", "tables"), checkpoint="dcp_other_plan"))
# Plain DCP under the same plan, every table table_wise (so each rank lacks some tables): torch's default
# planner re-read the template in its pre-2.4 layout and raised "Missing key in checkpoint state_dict:
# optim.param_groups" on both ranks (issue 52).
@example(config=Config((T("t0", "ebc", 7, "table_wise", "sgd"), T("t1", "ebc", 9, "table_wise", "adagrad"),
                        T("t2", "ebc", 5, "table_wise", "adam"), T("t3", "ebc", 7, "table_wise", "adafactor"),
                        T("t4", "ebc", 9, "table_wise", "sgd_momentum")), schedule=True, checkpoint="dcp"))
# An optimizer that keeps no tensor (only the user's optimizer), through dcp.load of the objects: torch's default
# planner reads its state dict as one entry when a table has no piece on a rank (make test-matrix, seed 5252).
@example(config=Config((T("s0", "ec", 1, "column_wise", "user"),), cover=False, dense_part="user",
                       checkpoint="dcp_other_plan"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("s0", "ec", 9, "table_wise", "sgd_momentum"),
                        T("t1", "ebc", 5, "column_wise", "lamb", dense=True)), schedule=True, dense_part="fsdp",
                       checkpoint="rollback"))
@example(config=Config((T("t0", "ebc", 7, "table_row_wise", "rowwise_adagrad"), T("s0", "ec", 9, "row_wise", "adam"),
                        T("s1", "ec", 5, "data_parallel", "sgd_momentum")), cover=False,
                       checkpoint="state_dict_other_plan"))
# VBE and a MEAN table split by rows: TorchRec's mean divisor reads one batch size (5e-3 off, or an IndexError
# in _create_mean_pooling_divisor; make test-matrix, seed 5555, reached through a checkpoint under another plan).
@example(config=Config((T("t0", "ebc", 1, "row_wise", "sgd"), T("t1", "ebc", 1, "row_wise", "sgd", mean=True)),
                       cover=False, vbe=True))
@example(config=Config((T("t0", "ebc", 1, "table_wise", "sgd"), T("t1", "ebc", 1, "table_wise", "sgd", mean=True),
                        T("t2", "ebc", 1, "table_wise", "sgd")), cover=False, checkpoint="other_plan", vbe=True))
# FP16 and BF16 tables, lazy and dense (a layer-wise table split under the other plan: the cross-shard kind), and
# BF16 state, through a checkpoint under another plan and with clipping.
@example(config=Config((T("t0", "ebc", 7, "table_wise", "adafactor", precision="fp16"),
                        T("t1", "ebc", 9, "row_wise", "adam", precision="bf16", state_bf16=True)),
                       checkpoint="other_plan", clip=("norm", "everything")))
@example(config=Config((T("t0", "ebc", 7, "column_wise", "adam", precision="bf16", state_bf16=True),
                        T("s0", "ec", 9, "row_wise", "adagrad", precision="fp16")), micro=2, cover=False,
                       checkpoint="dcp_other_plan"))
# FP16 and BF16 data-parallel tables (the replicated kind) beside a float32 one: clipped by norm with the MLP,
# in a window, BF16 state, a checkpoint under another plan; an EC's layer-wise one, through DCP; a frozen one.
@example(config=Config((T("t0", "ebc", 7, "data_parallel", "adam", precision="fp16"),
                        T("t1", "ebc", 9, "data_parallel", "sgd_momentum", precision="bf16", state_bf16=True),
                        T("t2", "ebc", 5, "data_parallel", "adagrad")), cover=False,
                       clip=("norm", "everything"), micro=2, checkpoint="other_plan"))
@example(config=Config((T("s0", "ec", 9, "data_parallel", "lamb", precision="bf16"),
                        T("s1", "ec", 7, "row_wise", "adam", precision="fp16")), schedule=True, checkpoint="dcp"))
@example(config=Config((T("t0", "ebc", 7, "data_parallel", "frozen", precision="fp16"),
                        T("t1", "ebc", 9, "data_parallel", "adam"))))
# BF16 Adam state on the MLP (our DDP hook), beside a BF16-state table, clipped over everything, in a window,
# through a checkpoint under another plan.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam", state_bf16=True), T("t1", "ebc", 9, "table_wise", "sgd")),
                       dense_state_bf16=True, clip=("norm", "everything"), micro=2, checkpoint="other_plan"))
# The other plan of a VBE MEAN table with weight-decayed RowWiseAdagrad moved it to column shards, which
# refuse it (the matrix's plan, not the library; the "ci" draws).
@example(config=Config((T("t0", "ebc", 1, "table_wise", "rowwise_adagrad_wd", mean=True),), dense_part="user",
                       checkpoint="dcp_other_plan", vbe=True))
# A one-row BF16 SGD table whose clipped updates are below half a BF16 unit: the reference stands still,
# rightly (make test-matrix, seed 6161).
@example(config=Config((T("t0", "ebc", 1, "data_parallel", "sgd"), T("s0", "ec", 1, "data_parallel", "sgd"),
                        T("s1", "ec", 1, "table_wise", "sgd", precision="bf16")), clip=("norm", "tables"), seed=546))
# A layer-wise FP16 table row_wise on one rank: one shard, the dense kind (on 2 ranks: the cross-shard kind).
@example(config=Config((T("t0", "ebc", 1, "row_wise", "adafactor", precision="fp16"),), world_size=1, weighted=True))
# Low-precision cross-shard tables with BF16 state (LAMB's moments, RowWiseAdagrad's row sums on column shards).
@example(config=Config((T("t0", "ebc", 9, "row_wise", "lamb", precision="bf16", state_bf16=True),
                        T("t1", "ebc", 7, "column_wise", "rowwise_adagrad", precision="fp16", state_bf16=True)),
                       checkpoint="other_plan"))
# BF16 state on a dense Adagrad table whose constructor makes its state (float32): loaded before a step.
@example(config=Config((T("s0", "ec", 1, "table_wise", "adagrad", dense=True, state_bf16=True),), cover=False,
                       checkpoint="other_plan"))
# A step whose norm is inf, refused on every rank and skipped, in a window, before a checkpoint in place: fused
# tables (what our compiled backward kept of its first half is dropped), a cross-shard one, a lazy one, the MLP
# in our DDP hook.
@example(config=Config((T("t0", "ebc", 9, "row_wise", "adagrad"), T("t1", "ebc", 8, "row_wise", "adafactor"),
                        T("t2", "ebc", 7, "table_wise", "adam")), clip=("norm", "everything"), non_finite=True,
                       micro=2, checkpoint="in_place"))
@example(config=Config((T("t0", "ebc", 9, "row_wise", "rowwise_adagrad"), T("s0", "ec", 5, "table_wise", "sgd")),
                       clip=("norm", "everything"), non_finite=True, dense_part="fsdp", schedule=True, compiled=False))
# TorchRec's train pipelines run the loop (the input dist of the next micro-batch ahead): in a window, clipped,
# through checkpoints into fresh objects and under another plan, with VBE and FSDP2.
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("s0", "ec", 5, "table_wise", "adagrad", shared=True)),
                       pipeline="TrainPipelineSparseDist", micro=2, clip=("norm", "everything"), checkpoint="torch_save"))
@example(config=Config((T("t0", "ebc", 7, "row_wise", "adam"), T("t1", "ebc", 9, "column_wise", "lamb"),
                        T("t2", "ebc", 5, "data_parallel", "sgd_momentum")), pipeline="TrainPipelineSparseDistLite",
                       dense_part="fsdp", schedule=True, checkpoint="other_plan", vbe=True, weighted=True, cover=False))
# Managed-collision tables (issue 53): ids remapped, a slot evicted every step with its state reset; lazy, dense and
# fused beside a plain table, clipped, in a window, rolled back, through a pipeline. A weighted one is refused
# (TorchRec's sharded collection drops the weights).
@example(config=Config((T("m0", "mc", 9, "row_wise", "adam", shared=True), T("m1", "mc", 6, "row_wise", "adagrad", dense=True),
                        T("t0", "ebc", 7, "table_wise", "sgd")), micro=2, clip=("norm", "everything"),
                       checkpoint="rollback", pipeline="TrainPipelineSparseDist"))
@example(config=Config((T("m0", "mc", 4, "row_wise", "sgd"),), weighted=True))
# dense_tables named "mc.m2" did not reach the managed collection's inner sharding, which TorchRec hands over with no
# path: m2 ran lazy (0.0016 off; make test-matrix, seed 2468).
@example(config=Config((T("m0", "mc", 4, "row_wise", "sgd", shared=True), T("m1", "mc", 4, "row_wise", "sgd", shared=True),
                        T("m2", "mc", 4, "row_wise", "sgd_momentum", dense=True)), qualified=True, cover=False,
                       dense_part="user"))
# A step refused at the first lookup had evicted slots (re-initialised) before it: the refusal changed the model
# (make test-matrix, seed 2468). The lookup's checks now run before the remapping.
@example(config=Config((T("m0", "mc", 4, "row_wise", "sgd"),), cover=False, dense_part="user_ddp",
                       clip=("value", "everything")))
# BF16 Adam state on the MLP, two micro-batches a step: an element flipped one unit (another summation order), then
# cancelled toward zero, measured four units at its own magnitude (make test-matrix, seed 3579): one at BF16's.
@example(config=Config((T("s0", "ec", 9, "data_parallel", "adagrad", shared=True), T("s1", "ec", 11, "table_wise", "adagrad"),
                        T("s2", "ec", 9, "data_parallel", "adagrad", shared=True)), cover=False, dense_state_bf16=True,
                       micro=2, schedule=True, seed=339))
# A managed collection with a row-split MEAN table: TorchRec's MC input dist made the mean divisor (bag length + 1e-6)
# itself, past our EBC sharder's rounding; LAMB on its other table amplified it to 1.8e-5 (make test-matrix, seed 3579).
@example(config=Config((T("t0", "ebc", 9, "data_parallel", "sgd"), T("t1", "ebc", 7, "data_parallel", "sgd", shared=True),
                        T("m0", "mc", 6, "row_wise", "lamb"), T("m1", "mc", 6, "row_wise", "sgd", mean=True)),
                       cover=False, dense_part="user", seed=1))
# Lazy Adam (eps 1e-12) on an element whose terms cancel to 1.6e-8: ours steps torch.optim.Adam's update, the lazy
# reference (SparseAdam, eps outside the bias correction) was 9.5e-5 from it until its eps was rescaled
# (make test-matrix, seed 4680).
@example(config=Config((T("t0", "ebc", 7, "data_parallel", "sgd", shared=True),
                        T("t0", "ebc_b", 7, "data_parallel", "sgd", mean=True, shared=True),
                        T("t1", "ebc_b", 13, "table_wise", "adam", mean=True)), cover=False, dense_part="user", seed=541))
# A frozen managed-collision table and an unannotated MLP in a clipping set under plain DDP: refused at the end of
# backward, after the forward's eviction had re-initialised slots (make test-matrix, seed 6802): the managed-collision
# collection now checks the model's clipping sets before it remaps.
@example(config=Config((T("m0", "mc", 4, "row_wise", "frozen"),), cover=False, dense_part="user_ddp",
                       clip=("norm", "everything"), non_finite=True))
def test_exact_or_refused(config: Config, directory: str) -> None:
    name = hashlib.sha1(repr(config).encode()).hexdigest()[:10]
    if os.environ.get("MATRIX_LOG"):  # each example as it starts: a run that stalls shows where
        with open(os.environ["MATRIX_LOG"], "a") as log:
            log.write(f"{name} {config!r}\n")
    results = run_cases({name: functools.partial(run, config=config, directory=directory)}, world_size=config.world_size,
                        timeout=60, straggler_timeout=20)
    per_rank = results[name]  # a crash, or a rank left waiting, fails here, naming the case
    if per_rank[0].get("stage") == "later step":  # a refusal the values trained bring (docs/refusals.md)
        for rank, out in enumerate(per_rank):
            assert any(r.data_dependent and r.matches(out["error"]) for r in REFUSALS), f"{config}, rank {rank}: {out}"
        assert len({out["error"] for out in per_rank}) == 1, f"{config}: ranks disagree: {per_rank}"
        return
    if per_rank[0].get("resume"):  # checkpoint="one_rank": the second half on one rank
        resumed = run_cases({name: functools.partial(run, config=config, directory=directory, resume=True)},
                            world_size=1, timeout=60, straggler_timeout=20)
        per_rank = per_rank + resumed[name]
    expected = [r for r in REFUSALS if r.sampled and PREDICATES[r.name](config)]
    outcomes = {out["outcome"] for out in per_rank}
    assert len(outcomes) == 1, f"{config}: ranks disagree: {per_rank}"
    if expected:
        for rank, out in enumerate(per_rank):
            assert out["outcome"] == "refused", f"{config}: docs list it as refused ({[r.name for r in expected]}), " \
                                                f"rank {rank} trained it"
            assert any(r.matches(out["error"]) for r in expected), f"{config}, rank {rank}: {out['error']}"
            assert out["unchanged"], f"{config}, rank {rank}: the refused call changed the model"
        return
    for rank, out in enumerate(per_rank):
        assert out["outcome"] == "exact", f"{config}, rank {rank}: refused, and docs/refusals.md lists no such " \
                                          f"refusal: {out['stage']}: {out['error']}"
        if config.pipeline is not None:  # the pipeline ran the input dist ahead, not only the loop
            assert out["pipelined"] == len(config.collections()), f"{config}, rank {rank}: {out['pipelined']}"
        if config.dense_state_bf16:  # the MLP's state is kept in BF16, the reference's state rounded (one unit
            # apart where a float32 value near a tie rounds the other way here: rare)
            state = out["dense_state"]
            assert state["dtypes"] == ["torch.bfloat16"] and state["ulps"] <= 2, f"{config}, rank {rank}: {state}"
            assert state["flipped"] <= 0.02 * state["elements"], f"{config}, rank {rank}: {state}"
        for table, diffs in out["diffs"].items():
            # Today's tolerance; where float32 rounding alone takes the reference further from its
            # float64 twin, or from itself stepped on its gradients moved by what another summation
            # order may do (an ill-conditioned update: LAMB's trust ratio on a small or partly touched
            # table, LAMB in its eps regime), four times that distance: two float32 computations that
            # round differently.
            # A low-precision table: one unit in the last place of its dtype (its one rounding may differ);
            # BF16 state: what one state element rounded the other way does to the updates (run's "ulp"): on
            # the table itself, and on everything once an element of the MLP's BF16 state did, or a BF16-state
            # table moved further than the tolerance.
            tolerance = max(TOL, 4 * out["noise"].get(table, 0.0), out.get("ulp", {}).get(table, 0.0))
            worst = max(diffs)
            assert worst <= tolerance, f"{config}, rank {rank}, {table}: {worst:.3g} from the reference (step diffs " \
                                       f"{diffs}; the float32 reference is {out['noise'].get(table)} from float64, " \
                                       f"ours {out['from_exact'].get(table)})"
    moved = per_rank[-1]["moved"]  # the whole run's: one_rank's first half stops mid-run
    for t in config.tables:
        amount = moved[f"tables.{t.key}.weight"]
        if t.optimizer == "frozen":
            assert amount == 0.0 or t.managed  # an evicted slot of a managed table gets a new weight
        elif t.precision != "fp32" and amount <= per_rank[-1]["ulp"][t.key]:
            continue  # its updates round away in its dtype (the reference stands still): nothing here to prove
        else:
            # Further than the tolerance, with room: had ours stood still, or moved a third as far, it would fail.
            assert amount > 3 * TOL, f"{config}: the reference moved {t.name} by {amount:.3g}: the check proves nothing"
