"""The schedule ``benchmarks/async_vs_sync.py`` reports as ``windowed_bound_vs_sync``: what a bound of
one version on the oldest token allows, from a sync run's own phase times."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "async_vs_sync.py"


@pytest.fixture(scope="module")
def windowed_schedule():
    spec = importlib.util.spec_from_file_location("async_vs_sync_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.windowed_schedule


def test_a_long_rollout_waits_for_the_update_two_steps_back(windowed_schedule):
    # step 0: groups start at 0, trains 3-4; step 1: its groups also start at 0 (version 0),
    # done at 3, trains 4-5; step 2: its groups start at version 1 (4), done at 7, trains 7-8
    assert windowed_schedule([3.0, 3.0, 3.0], [1.0, 1.0, 1.0]) == 8.0
    # short rollouts hide behind the training of the step before: only training is left
    assert windowed_schedule([1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == 1.0 + 4 * 2.0


def test_a_rollout_overlaps_the_training_of_the_step_before_not_earlier_ones(windowed_schedule):
    # the step-2 rollout (5) starts when version 1 is out (at 2), not with step 0: it ends at 7
    assert windowed_schedule([1.0, 1.0, 5.0], [1.0, 1.0, 1.0]) == 8.0


def test_never_longer_than_the_steps_one_after_the_other(windowed_schedule):
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        rollouts = [rng.expovariate(3.0) for _ in range(n)]
        rests = [rng.uniform(0.1, 0.5) for _ in range(n)]
        length = windowed_schedule(rollouts, rests)
        assert sum(rests) <= length <= sum(rollouts) + sum(rests) + 1e-12
