"""The per-step source quotas of asynchronous training (:class:`StepQuotas`): floor or ceil of each
source's share in every step, running totals within floor or ceil of the exact share (up to four
sources), a pure function of the step."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from loongsage_core.controller.mixing import StepQuotas


def check(weights: list[int], batch: int, steps: int, strict_totals: bool) -> None:
    quotas = StepQuotas(weights, batch)
    total = sum(weights)
    running = [0] * len(weights)
    for k in range(steps):
        counts = quotas(k)
        assert sum(counts) == batch
        for s, w in enumerate(weights):
            share = Fraction(batch * w, total)
            assert math.floor(share) <= counts[s] <= math.ceil(share), (weights, batch, k, counts)
            running[s] += counts[s]
            exact = Fraction((k + 1) * batch * w, total)
            if strict_totals:
                assert math.floor(exact) <= running[s] <= math.ceil(exact), (weights, batch, k, running)
            else:
                assert abs(running[s] - exact) < 2, (weights, batch, k, running)


def test_the_documented_example():
    quotas = StepQuotas([0.5, 0.3, 0.2], 5)
    assert [quotas(k) for k in range(4)] == [[3, 1, 1], [2, 2, 1], [3, 1, 1], [2, 2, 1]]
    assert StepQuotas([0.5, 0.3, 0.2], 10)(7) == [5, 3, 2]  # whole shares: exact every step


def test_shares_per_step_and_running_totals_up_to_four_sources():
    rng = random.Random(0)
    for _ in range(300):
        weights = [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]
        check(weights, rng.randint(1, 24), 60, strict_totals=True)


def test_shares_per_step_with_many_sources():
    rng = random.Random(1)
    for _ in range(100):
        weights = [rng.randint(1, 12) for _ in range(rng.randint(5, 8))]
        check(weights, rng.randint(1, 24), 60, strict_totals=False)


def test_a_step_is_the_same_whatever_was_asked_before():
    ahead = StepQuotas([3, 2, 2], 4)
    late = StepQuotas([3, 2, 2], 4)
    assert ahead(50) == late(50) and [ahead(k) for k in range(50)] == [late(k) for k in range(50)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        StepQuotas([1.0], bad)
