"""The sharder gives every table exactly torch.optim's update, on every sharding type (2 ranks, gloo).

Reference: the same model unsharded in one process, plain torch.optim per table, fed the
concatenated global batch with a mean loss. Sharded: each rank its own local batch, mean loss.
Batches touch every row, so lazy and dense semantics coincide; the tables whose optimizer is
not row-separable (dense semantics) are trained again on batches that touch only some rows.
Weights are compared after every step. Every torch.optim optimizer of torch 2.13 is here but
LBFGS (closure) and SparseAdam (sparse gradients only), plus came-pytorch's CAME.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from came_pytorch import CAME
from pytorch_optimizer import LARS, AdamP, Lamb
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.testing import run_cases, selected_cases
from _sharded_parity import SHARDING_TYPES, assert_table_exact, parity, parity_on_partial_batches

CASES = [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("sgd_momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("sgd_nesterov", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("sgd_wd", torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.05}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.2}),
    ("adagrad_eps_wd", torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.05}),
    ("adagrad_lr_decay", torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),
    ("adagrad_init_acc", torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.3}),
    ("adam", torch.optim.Adam, {"lr": 0.05}),
    ("adam_betas_wd", torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "weight_decay": 0.05}),
    ("adam_amsgrad", torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
    ("adamw", torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    ("rmsprop", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    ("adamax", torch.optim.Adamax, {"lr": 0.05}),
    ("nadam", torch.optim.NAdam, {"lr": 0.05}),
    ("radam", torch.optim.RAdam, {"lr": 0.05}),
    ("rowwise_adagrad", RowWiseAdagrad, {"lr": 0.2}),
    ("rowwise_adagrad_wd", RowWiseAdagrad, {"lr": 0.2, "weight_decay": 0.05}),  # FBGEMM CPU drops wd
    ("sgd_dampening", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    ("adam_maximize", torch.optim.Adam, {"lr": 0.05, "maximize": True}),
    ("adagrad_maximize", torch.optim.Adagrad, {"lr": 0.2, "maximize": True}),
    ("asgd", torch.optim.ASGD, {"lr": 0.2, "t0": 1}),
    ("rprop", torch.optim.Rprop, {"lr": 0.01}),
    ("adadelta", torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.05}),
    ("nadam_decoupled", torch.optim.NAdam, {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True,
                                            "momentum_decay": 0.01}),
    ("radam_decoupled", torch.optim.RAdam, {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    # Not separable by rows or columns: dense semantics; on split tables, a cross-shard form or refused.
    ("adafactor", torch.optim.Adafactor, {"lr": 0.05}),
    ("muon", torch.optim.Muon, {"lr": 0.05}),
    ("came", CAME, {"lr": 0.05}),
    # pytorch-optimizer's, with their step counter in the param group (kept per table here).
    ("lamb", Lamb, {"lr": 0.05, "weight_decay": 0.01}),
    ("lars", LARS, {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.02}),
    # Its projection reads cosines of rows and of the whole weight: not separable, no cross-shard form.
    ("adamp", AdamP, {"lr": 0.05}),
]
NOT_SEPARABLE = {"adafactor", "muon", "came", "lamb", "lars", "adamp"}
REFUSED_WHEN_SPLIT = {"adamp"}  # the rest have a cross-shard form (overlap_optim/cross_shard.py)
SPLITTING = ("column_wise", "table_column_wise", "row_wise", "table_row_wise")
NAMES = [c[0] for c in CASES]
PARTIAL = ("table_wise", "data_parallel")
ATOL = 1e-5  # every table, after every step

# One spawned group runs these, each reported apart: per sharding type, every accepted case as a
# table of one EBC (and the refusals of the others); then the cases not row-separable on partial batches.
RANK_CASES = {st: partial(parity, cases=CASES, sharding_type=st) for st in SHARDING_TYPES}
RANK_CASES.update({f"partial/{st}": partial(parity_on_partial_batches, cases=CASES, sharding_type=st)
                   for st in PARTIAL})


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), timeout=600)


def _expected_on(sharding_type):
    """The cases accepted on ``sharding_type`` (the others are refused)."""
    expected = set(NAMES)
    if sharding_type in SPLITTING:
        expected -= REFUSED_WHEN_SPLIT
    if sharding_type in ("column_wise", "table_column_wise"):
        expected -= {"rowwise_adagrad_wd"}  # without weight decay: across column shards in the round
    return expected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", SHARDING_TYPES)
def test_every_optimizer_on_every_sharding_type_matches_torch_optim(ranks, case, name):
    per_rank = ranks[case]
    moved = per_rank[0]["moved"]
    if name not in _expected_on(case):
        assert name not in moved and name in per_rank[0]["refused"], f"{case}: {name} was not refused"
        return
    assert name in moved, f"{case}: {name} was refused: {per_rank[0]['refused'].get(name)}"
    assert_table_exact(per_rank, name, ATOL, case)
    assert moved[name] >= 1e-3, f"{case}: the reference did not move {name}"


@pytest.mark.parametrize("name", sorted(NOT_SEPARABLE))
@pytest.mark.parametrize("case", [f"partial/{st}" for st in PARTIAL])
def test_not_separable_optimizers_are_exact_with_dense_semantics_on_partial_batches(ranks, case, name):
    per_rank = ranks[case]
    assert_table_exact(per_rank, name, ATOL, case)
    assert per_rank[0]["moved"][name] >= 1e-3, f"{case}: the reference did not move {name}"


@pytest.mark.parametrize("name", sorted(REFUSED_WHEN_SPLIT))
@pytest.mark.parametrize("case", SPLITTING)
def test_not_separable_optimizers_are_refused_on_split_tables(ranks, case, name):
    axis = "rows" if "row" in case else "columns"
    cls = {"adafactor": "Adafactor", "muon": "Muon", "came": "CAME", "lamb": "Lamb", "lars": "LARS", "adamp": "AdamP"}[name]
    refusal = ranks[case][0]["refused"][name]
    assert re.match(
        rf"table '{name}': {cls}'s update is not separable by {axis} .* {case} sharding splits "
        rf"this table into \w+ shards, and it has no cross-shard form; use table_wise, data_parallel for this table",
        refusal,
    ), refusal
