"""A frozen table (``requires_grad=False`` when sharded) is looked up and never updated, on every
sharding type, while the other tables and the MLP train exactly as torch.optim (2 ranks, gloo).

The table is annotated with SGD before it is frozen: frozen wins, as torch.optim never steps a
parameter that does not require grad. The reference freezes its copy the same way.
"""

from __future__ import annotations

from functools import partial

import pytest

from _frozen_bodies import NAMES, frozen_table
from _sharded_parity import SHARDING_TYPES
from overlap_optim.testing import run_cases, selected_cases

CASES = {t: partial(frozen_table, sharding_type=t) for t in SHARDING_TYPES}


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=400)


@pytest.mark.parametrize("case", CASES)
def test_frozen_table_stays_bitwise_while_the_others_train_exactly(ranks, case):
    for result in ranks[case]:  # the body compared every weight with torch.optim after each step
        assert result["frozen_moved"] == 0.0
        still = [n for n in NAMES if n != "frozen" and result["moved"][n] < 1e-3]
        assert not still, f"the reference did not move {still}"
        assert result["kinds"]["frozen"] == "frozen"


@pytest.mark.parametrize("case", CASES)
def test_frozen_table_has_no_state_no_optimizer_and_describe_says_frozen(ranks, case):
    for result in ranks[case]:
        assert not [k for k in result["state_keys"] if "frozen" in k]
        assert "ebc.embedding_bags.frozen.weight" not in result["unoptimized"]
        assert result["describe"] and all("| frozen |" in row for row in result["describe"]), result["describe"]


@pytest.mark.parametrize("case", CASES)
def test_making_a_frozen_table_trainable_again_is_refused_on_every_rank(ranks, case):
    for result in ranks[case]:
        assert result["refusal"].startswith("table 'frozen' was frozen when it was sharded"), result["refusal"]
