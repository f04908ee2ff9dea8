"""EmbeddingCollectionSharder: every table of an EC gets exactly its torch.optim update (2 ranks, gloo).

Reference: the same model unsharded in one process (an ``EmbeddingCollection`` of
``nn.Embedding`` tables), plain torch.optim per table, fed the concatenated global batch. The
model weights each id by its position in its sequence (``_models.ManySequenceModel``), so every
id's row gets its own gradient. Each cell trains 3 steps, compared after every step; then
``get_optimizers().state_dict()`` is loaded into a second sharded model (weights copied over),
which takes a fourth step beside the reference. On batches that touch a third of the rows: lazy
tables against torch's sparse optimizers, ``dense_tables`` and the optimizers that are not
row-separable (dense semantics) against dense torch.optim. Also: an LR schedule, and
``use_index_dedup`` refused on CPU.

The matrix is every setting of the EBC parity matrix (layer-wise ones included) on each of EC's
four sharding types, 128 cells in one spawned group (about 20 s here).
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

import sharders

from overlap_optim.testing import run_cases, selected_cases
from _lazy_bodies import lazy_run
from _sharded_parity import (
    assert_table_exact, parity_on_partial_batches, parity_with_round_trip, scheduled, train_and_compare,
)
from test_sharder_parity import ATOL, CASES, NOT_SEPARABLE, REFUSED_WHEN_SPLIT

EC_TYPES = ("data_parallel", "table_wise", "column_wise", "row_wise")
NAMES = [c[0] for c in CASES]

RANK_CASES = {st: partial(parity_with_round_trip, cases=CASES, sharding_type=st) for st in EC_TYPES}
RANK_CASES.update({f"partial/{st}": partial(parity_on_partial_batches, cases=CASES, sharding_type=st, family="ec")
                   for st in ("table_wise", "data_parallel")})
RANK_CASES.update({f"lazy/{st}": partial(lazy_run, sharding_type=st, family="ec") for st in ("table_wise", "row_wise")})


def _dense_tables(rank, world_size, sharding_type):
    """Adam and SGD tables named in ``dense_tables``, on batches that touch some rows only,
    against dense torch.optim (untouched rows step on a zero gradient)."""
    import torch

    diffs = {}
    names, settings = ["adam", "sgd_momentum"], [(torch.optim.Adam, {"lr": 0.05}),
                                                 (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]
    moved = train_and_compare(rank, world_size, names, settings, sharding_type, cover=False, steps=4, diffs=diffs,
                              family="ec", dense_tables=names)
    return {"moved": moved, "diffs": diffs}


RANK_CASES.update({f"dense_tables/{st}": partial(_dense_tables, sharding_type=st) for st in ("table_wise", "row_wise")})


RANK_CASES.update({f"scheduled/{st}": partial(scheduled, sharding_type=st, family="ec", steps=6)
                   for st in ("data_parallel", "row_wise")})


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), timeout=600)


def _expected_on(sharding_type, names):
    expected = set(names)
    if sharding_type in ("column_wise", "row_wise"):
        expected -= REFUSED_WHEN_SPLIT
    if sharding_type == "column_wise":
        expected -= {"rowwise_adagrad_wd"}  # without weight decay: across column shards in the round
    return expected


def _check_cell(per_rank, sharding_type, name, label):
    moved = per_rank[0]["moved"]
    if name not in _expected_on(sharding_type, [name]):
        axis = "rows" if sharding_type == "row_wise" else "columns"
        refusal = per_rank[0]["refused"].get(name, "")
        assert name not in moved, f"{label}: {name} was not refused"
        assert re.match(rf"table '{name}': .* not separable by {axis}", refusal), refusal
        return
    assert name in moved, f"{label}: {name} was refused: {per_rank[0]['refused'].get(name)}"
    assert_table_exact(per_rank, name, ATOL, label)
    assert all(len(out["diffs"].get(name, [])) in (0, 4) for out in per_rank), f"{label}: {name} missed a comparison"
    assert moved[name] >= 1e-3, f"{label}: the reference did not move {name}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", EC_TYPES)
def test_every_optimizer_on_every_ec_sharding_type_matches_torch_optim_through_a_state_dict_round_trip(
    ranks, case, name
):
    _check_cell(ranks[case], case, name, case)


@pytest.mark.parametrize("name", sorted(NOT_SEPARABLE))
@pytest.mark.parametrize("case", ["partial/table_wise", "partial/data_parallel"])
def test_not_separable_optimizers_on_ec_tables_are_exact_with_dense_semantics_on_partial_batches(ranks, case, name):
    assert_table_exact(ranks[case], name, ATOL, case)
    assert ranks[case][0]["moved"][name] >= 1e-3, f"{case}: the reference did not move {name}"


@pytest.mark.parametrize("case", ["lazy/table_wise", "lazy/row_wise"])
def test_ec_lazy_tables_match_torch_sparse_optimizers_on_partial_batches(ranks, case):
    per_rank = ranks[case]
    for rank, out in enumerate(per_rank):
        for step, record in enumerate(out["steps"]):
            bad = {n: d for n, d in record["diff"].items() if not d <= 2e-5}
            assert not bad, f"{case}, rank {rank}, step {step}: {bad} from torch's sparse optimizers"
            assert not record["ours_untouched_moved"], f"{case}, step {step}: untouched rows moved"
    assert min(per_rank[0]["moved"].values()) >= 1e-3, per_rank[0]["moved"]


@pytest.mark.parametrize("case", ["dense_tables/table_wise", "dense_tables/row_wise"])
def test_ec_dense_tables_match_dense_torch_optim_on_partial_batches(ranks, case):
    per_rank = ranks[case]
    for name in ("adam", "sgd_momentum"):
        assert_table_exact(per_rank, name, ATOL, case)
        assert per_rank[0]["moved"][name] >= 1e-3



def test_index_dedup_is_refused_on_cpu_before_anything_is_sharded():
    sharder = sharders.EmbeddingCollectionSharder(use_index_dedup=True)
    with pytest.raises(NotImplementedError, match=r"use_index_dedup=True\) on CPU: .*jagged_unique_indices"):
        sharder.shard(torch.nn.Module(), {}, env=None, device=torch.device("cpu"))

@pytest.mark.parametrize("case", ["scheduled/data_parallel", "scheduled/row_wise"])
def test_an_lr_schedule_reaches_every_ec_kernel_at_the_next_step(ranks, case):
    moved = ranks[case][0]  # how far the reference moved; compared with torch.optim after every step inside the ranks
    assert moved["dense_diff"] <= 1e-5
    assert min(moved[n] for n in ("sgd", "adagrad", "adam", "adam_fast", "dense")) >= 1e-3, moved
