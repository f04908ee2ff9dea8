"""overlap_optim.testing: results, exceptions and crashes come back to the parent; run_cases keeps
each case's outcome apart and names it."""

import time
from types import SimpleNamespace

import pytest

from _harness_bodies import (
    aborts_on_one, pid, raises_on_both, raises_on_one, summed, unpicklable, waits_for_one_that_fails,
)
from overlap_optim.testing import CaseResults, run_cases, run_ranks, selected_cases


def test_every_rank_returns_its_result():
    assert run_ranks(summed) == [3.0, 3.0]


def test_a_rank_exception_comes_back_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1:.*ValueError: boom on purpose"):
        run_ranks(raises_on_one)


def test_a_crashed_rank_is_reported_without_waiting_for_the_timeout():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] gave no result \(exit codes \[-?\d+, -6\]"):
        run_ranks(aborts_on_one, timeout=120)
    assert time.monotonic() - started < 60


# -- run_cases: one spawned group, each case reported apart --

CASES = {
    "sums": summed,
    "fails_on_one": raises_on_one,
    "fails_on_both": raises_on_both,
    "unpicklable": unpicklable,
    "sums_after_failures": summed,
    "waits_for_a_failed_peer": waits_for_one_that_fails,
    "after_the_stall": summed,
}


@pytest.fixture(scope="module")
def cases():
    started = time.monotonic()
    results = run_cases(CASES, timeout=120, straggler_timeout=5)
    return results, time.monotonic() - started


def test_a_case_that_passes_gives_its_value_by_rank(cases):
    results, _ = cases
    assert results["sums"] == [3.0, 3.0]


def test_a_failing_case_is_reported_by_name_and_the_next_cases_still_run(cases):
    results, _ = cases
    with pytest.raises(AssertionError, match=r"(?s)case 'fails_on_one' did not pass on every rank\n"
                                             r"rank 0: passed\nrank 1: failed:\n.*ValueError: boom on purpose"):
        results["fails_on_one"]
    with pytest.raises(AssertionError, match=r"(?s)rank 0: failed:.*rank 0 fails.*rank 1: failed:.*rank 1 fails"):
        results["fails_on_both"]
    with pytest.raises(AssertionError, match=r"(?s)case 'unpicklable' .*Can't (pickle|get local object)"):
        results["unpicklable"]
    assert results["sums_after_failures"] == [3.0, 3.0]  # every rank finished the failed ones: in step


def test_a_peer_left_waiting_in_a_collective_stops_the_group_and_names_the_case(cases):
    results, elapsed = cases
    with pytest.raises(AssertionError, match=r"(?s)case 'waits_for_a_failed_peer' did not pass on every rank\n"
                                             r"rank 0: .*rank 1: failed:.*rank 1 fails before the all-reduce") as info:
        results["waits_for_a_failed_peer"]
    assert "(it ran after case 'fails_on_one' failed)" in str(info.value)
    with pytest.raises(AssertionError, match=r"case 'after_the_stall' was not run: rank 0 stopped after case "
                                             r"'waits_for_a_failed_peer', as another rank did; rank 1 stopped after "
                                             r"case 'waits_for_a_failed_peer': not every rank had finished it 5s after"):
        results["after_the_stall"]
    assert elapsed < 90, "the group waited for its timeout instead of stopping at the stalled case"


def test_the_next_run_cases_runs_in_the_same_group_until_a_case_stalls():
    first = run_cases({"pid": pid})["pid"]
    again = run_cases({"fails": raises_on_one, "pid": pid, "sums": summed})  # a failed case keeps the group
    assert again["pid"] == first and again["sums"] == [3.0, 3.0]
    assert run_cases({"pid": pid}, world_size=1)["pid"][0] not in first  # another world size, another group
    stalled = run_cases({"stalls": waits_for_one_that_fails, "pid": pid}, straggler_timeout=2)
    with pytest.raises(AssertionError, match="case 'pid' was not run"):
        stalled["pid"]
    fresh = run_cases({"pid": pid, "sums": summed})
    assert set(fresh["pid"]).isdisjoint(first) and fresh["sums"] == [3.0, 3.0]


def test_unknown_cases_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown case\(s\) \['nope'\]; the cases are \['sums'"):
        run_cases(CASES, ["sums", "nope"])


def test_a_case_not_run_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="case 'other' was not run in this group; it ran \\['sums'\\]"):
        CaseResults({"sums": [3.0, 3.0]}, {})["other"]


def _item(module, fixtures, case=None):
    callspec = SimpleNamespace(params={"case": case}) if case is not None else None
    return SimpleNamespace(module=module, fixturenames=fixtures, callspec=callspec)


def test_selected_cases_are_the_case_parameters_of_the_selected_tests_using_the_fixture():
    here, other = SimpleNamespace(), SimpleNamespace()
    request = SimpleNamespace(module=here, fixturename="ranks", session=SimpleNamespace(items=[
        _item(here, ["ranks", "case"], "fails_on_one"), _item(here, ["ranks", "case"], "sums"),
        _item(here, ["other_fixture"]), _item(other, ["ranks"]),  # neither uses this module's fixture
    ]))
    assert selected_cases(request, CASES) == ["sums", "fails_on_one"]  # in the cases' order
    request.session.items.append(_item(here, ["ranks"]))  # a test that takes every case
    assert selected_cases(request, CASES) == list(CASES)
