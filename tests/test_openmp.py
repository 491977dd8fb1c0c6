"""Giving back a thread's idle OpenMP workers (``loongsage_core.openmp``), seen in the process's
own thread list: a parallel operator starts a worker, the release ends it, the next operator
starts one again, and another thread's team is left alone."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from loongsage_core.openmp import release_idle_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(expected: int, timeout: float = 10.0) -> int:
    """The thread count once it reaches ``expected`` (workers end asynchronously), or the last seen."""
    deadline = time.monotonic() + timeout
    while thread_count() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread_count()


def run_in_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_threads_workers_end_on_release_and_come_back_with_the_next_operator():
    box: dict[str, int] = {}

    def work() -> None:  # a thread of its own, so the test's (pytest's) thread keeps its own team
        torch.set_num_threads(2)
        before = thread_count()
        torch.randn(2048, 2048).exp()  # large enough to run in parallel
        box["team"] = thread_count() - before
        assert release_idle_threads()
        box["released"] = settle(before) - before
        torch.randn(2048, 2048).exp()
        box["again"] = thread_count() - before
        release_idle_threads()

    run_in_thread(work)
    assert box == {"team": 1, "released": 0, "again": 1}


def test_releasing_one_thread_leaves_another_threads_team_running():
    started, stop = threading.Event(), threading.Event()
    counts: dict[str, int] = {}

    def other() -> None:
        torch.set_num_threads(2)
        torch.randn(2048, 2048).exp()
        started.set()
        stop.wait()
        torch.randn(2048, 2048).exp()  # its team still works
        release_idle_threads()

    def mine() -> None:
        torch.set_num_threads(2)
        torch.randn(2048, 2048).exp()
        counts["with_both"] = thread_count()
        release_idle_threads()
        counts["after_mine"] = settle(counts["with_both"] - 1)

    keeper = threading.Thread(target=other)
    keeper.start()
    started.wait(30)
    run_in_thread(mine)
    stop.set()
    keeper.join()
    assert counts["after_mine"] == counts["with_both"] - 1  # only this thread's worker ended
