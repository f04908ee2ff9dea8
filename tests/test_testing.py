"""overlap_optim.testing.run_ranks: results, exceptions and crashes come back to the parent."""

import time

import pytest

from _harness_bodies import aborts_on_one, raises_on_one, summed
from overlap_optim.testing import run_ranks


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
