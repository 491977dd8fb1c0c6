"""The generated repositories of the ``swe`` recipe's learning job (configs/recipes/swe/repair.toml).

* The generator is deterministic, and the shipped ``mini/`` rows and tarballs are what
  ``scripts/make_swe_mini.py`` writes from it (``FAIL_TO_PASS`` / ``PASS_TO_PASS`` measured again).
* The held-out split is held out: no training repository and no warm-start transcript names one
  of its modules or functions.
* The warm-start transcripts hold the file tools' exact replies (replayed in a real sandbox), and
  are right or wrong as told.
* Oracle, through the real ``local`` sandbox, the real ``edit`` tool and the real ``swe_tests``
  reward path: the right fix resolves every held-out task; no edit, or the bug's wrong fix, does not.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest
from loongsage_plugin_agents.file_tools import edit, view
from loongsage_plugin_agents.swe_mini import BUGS, MiniRepoError, mini_repair_transcripts, mini_repos

from loongsage_core.config import DataConfig, JobConfig
from loongsage_core.controller.rewards import SourceRewards, score_trajectory_async
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory

REPO = Path(__file__).resolve().parent.parent
MINI = REPO / "configs" / "recipes" / "swe" / "mini"
sys.path.insert(0, str(REPO / "scripts"))


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (MINI / f"{split}.jsonl").read_text().splitlines()]


def test_the_generator_is_deterministic_and_draws_every_kind():
    a, b = mini_repos("train", 40, seed=3), mini_repos("train", 40, seed=3)
    assert a == b and a != mini_repos("train", 40, seed=4)
    assert {r.bug for r in a} == set(BUGS)
    assert len({r.name for r in a}) == 40
    for r in a:
        assert r.files[r.path].count(r.buggy) == 1 and r.fix != r.buggy != r.wrong_fix
    with pytest.raises(MiniRepoError, match="'split'"):
        mini_repos("test", 3)
    with pytest.raises(MiniRepoError, match="'kinds'"):
        mini_repos("train", 3, kinds=["typo"])
    with pytest.raises(MiniRepoError, match="held-out split has 64"):
        mini_repos("heldout", 65)


def test_the_shipped_rows_are_what_the_generator_writes(tmp_path):
    from make_swe_mini import write_tasks

    assert write_tasks(tmp_path, train=3, heldout=3) == {"train": 3, "heldout": 3}
    for split in ("train", "heldout"):
        shipped = _rows(split)
        made = [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert made == shipped[:3]  # the F2P / P2P measured again match the shipped rows
        for row in made:
            name = row["repo"].split("/")[1]
            tar = f"repos/{name}.tar.gz"
            assert (tmp_path / tar).read_bytes() == (MINI / tar).read_bytes()
            assert row["FAIL_TO_PASS"] == ["tests.test_issue.TestIssue.test_issue"] and len(row["PASS_TO_PASS"]) == 1
    assert len(_rows("train")) == 64 and len(_rows("heldout")) == 32


def test_no_training_repository_or_transcript_names_a_heldout_one():
    held = {row["repo"].split("/")[1] for row in _rows("heldout")}
    train = {row["repo"].split("/")[1] for row in _rows("train")}
    assert len(held) == 32 and not held & train
    rows = mini_repair_transcripts(seed=100, num_samples=3000, p_correct=0.5)
    words = set()
    for row in rows:
        words |= set(re.findall(r"[a-z]+", json.dumps(row["messages"])))
    assert not held & words


@pytest.fixture(scope="module")
def host():
    return PluginHost.create(["agents", "rewards"])


def test_transcripts_hold_the_tools_replies_and_their_behaviour(slow_fixture, host, tmp_path):
    """Replayed in a real ``local`` sandbox holding the repository, each transcript's ``view`` and
    ``edit`` calls get exactly the replies the transcript holds, and the edit is the right or the
    wrong fix as its ``behaviour`` says."""
    rows = mini_repair_transcripts(seed=5, num_samples=200, p_correct=0.25)
    right = [r for r in rows if r["metadata"]["behaviour"] == "correct"]
    assert 30 <= len(right) <= 70  # about a quarter
    assert [s["function"]["name"] for s in rows[0]["tools"]] == ["view", "edit"]
    repos = {r.name: r for r in mini_repos("train", 200, seed=5)}
    provider = host.bind(ComponentRef("sandbox", "local", {"default_timeout_s": 60}), BuildContext(components=host))

    async def replay(row: dict) -> None:
        repo = repos[row["metadata"]["repo"]]
        user, view_call, view_out, edit_call, edit_out, done = row["messages"]
        assert repo.path in user["content"] and done["content"] == "Done."
        root = tmp_path / repo.name
        for path, text in repo.files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        row_for_box = {"prompt": "p", "metadata": {"sandbox": {"snapshot": str(root)}}}
        box = await provider.create(f"replay-{repo.name}", row_for_box)
        try:
            args = json.loads(view_call["tool_calls"][0]["function"]["arguments"])
            assert await view(sandbox=box, **args) == view_out["content"]
            args = json.loads(edit_call["tool_calls"][0]["function"]["arguments"])
            assert await edit(sandbox=box, **args) == edit_out["content"]
            wanted = repo.fix if row["metadata"]["behaviour"] == "correct" else repo.wrong_fix
            assert args["new_text"] == wanted
            res = await box.exec(f"cat {repo.path}")
            assert res.stdout == repo.fixed_files(wanted)[repo.path]
        finally:
            await provider.destroy(box)

    try:
        for row in right[:3] + [r for r in rows if r["metadata"]["behaviour"] != "correct"][:3]:
            asyncio.run(replay(row))
    finally:
        asyncio.run(provider.close())


async def _resolve(provider, rewards, row: dict, replacement: str | None, repo) -> float:
    """Edit the row's repository in a fresh sandbox with the real ``edit`` tool (``replacement`` of
    the buggy fragment; None: no edit), then score it with the host's ``swe_tests`` reward path."""
    box = await provider.create(f"oracle-{repo.name}-{replacement}", {"prompt": "p", "metadata": row})
    try:
        if replacement is not None:
            reply = await edit(repo.path, repo.buggy, replacement, sandbox=box)
            assert reply.startswith("Edited"), reply
        traj = Trajectory(id="t", prompt_id="p", group_id="g", prompt=row["problem_statement"], metadata=dict(row))
        await score_trajectory_async(traj, rewards, box)
        return traj.reward.score
    finally:
        await provider.destroy(box)


def test_the_right_fix_resolves_every_heldout_task_and_no_edit_or_a_wrong_one_does_not(slow_fixture, host):
    provider = host.bind(ComponentRef("sandbox", "local", {"base_dir": str(MINI), "default_timeout_s": 60}),
                         BuildContext(components=host))
    source = DataConfig(name="swe", reward=["swe_tests"], sandbox="local")
    rewards = SourceRewards.bind(JobConfig(data=[source]), source, "data[0]", host)
    repos = {r.name: r for r in mini_repos("heldout", 32)}
    rows = _rows("heldout")
    one_per_kind = {}
    for row in rows:
        repo = repos[row["repo"].split("/")[1]]
        assert repo.problem == row["problem_statement"]
        one_per_kind.setdefault(repo.bug, (row, repo))
    assert set(one_per_kind) == set(BUGS)
    cases = [(row, repos[row["repo"].split("/")[1]].fix, repos[row["repo"].split("/")[1]], 1.0) for row in rows]
    cases += [(row, change, repo, 0.0) for row, repo in one_per_kind.values() for change in (None, repo.wrong_fix)]

    async def all_cases() -> list[float]:
        at_once = asyncio.Semaphore(4)  # a few sandboxes at a time: 42 test runs at once overrun a loaded 2-core box

        async def one(row: dict, change: str | None, repo) -> float:
            async with at_once:
                return await _resolve(provider, rewards, row, change, repo)

        return await asyncio.gather(*(one(row, change, repo) for row, change, repo, _ in cases))

    try:
        scores = asyncio.run(all_cases())
    finally:
        asyncio.run(provider.close())
    assert [(row["instance_id"], change, s) for (row, change, _, _), s in zip(cases, scores)] == \
        [(row["instance_id"], change, want) for row, change, _, want in cases]
