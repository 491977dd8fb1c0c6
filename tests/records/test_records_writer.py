"""The records writer and the viewer's API on records built here (no Ray, no model)."""

from __future__ import annotations

import gzip
import json
import logging
import threading
from pathlib import Path

import httpx
import pytest

from loongsage_core.controller.batching import build_batch
from loongsage_core.records import RolloutRecordsError, read_rollouts, records_path, rollout_steps
from loongsage_core.records.writer import RolloutRecorder
from loongsage_core.viewer import ViewerServer
from loongsage_hookspecs import Reward, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def make_groups(tokenizer, step: int, n_groups: int = 2, n: int = 3) -> list[TrajectoryGroup]:
    prompt = tokenizer("What is 1+2?", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" 3", add_special_tokens=False)["input_ids"]
    groups = []
    for g in range(n_groups):
        group = TrajectoryGroup(group_id=f"{step}:{g}", prompt_id=f"p{g}", source="math")
        for j in range(n):
            seg = Segment()
            seg.append(prompt, generated=False)
            seg.append(answer, generated=True, logprobs=[-0.5] * len(answer), weight_version=step)
            t = Trajectory(id=f"{step}:{g}:{j}", prompt_id=f"p{g}", group_id=group.group_id, source="math",
                           prompt="What is 1+2?", label="3", segments=[seg], response_text=" 3",
                           status=TrajectoryStatus.COMPLETED, finish_reason="stop",
                           reward=Reward(score=float(j), reason=f"j={j}"))
            if j == 2:
                t.status, t.error = TrajectoryStatus.FAILED, "boom"
            group.trajectories.append(t)
        groups.append(group)
    return groups


def trained_batch(groups):
    import torch

    batch = build_batch(groups)
    batch.tensors["old_logprobs"] = batch["rollout_logprobs"] * 1.0
    batch.tensors["old_logprobs"][0, -1] = float("-inf")  # non-finite values become null
    batch.tensors["advantages"] = torch.arange(batch["loss_mask"].numel(), dtype=torch.float32).reshape(
        batch["loss_mask"].shape) * batch["loss_mask"]
    return batch


def test_written_off_the_loop_and_read_back(tmp_path, tokenizer):
    got: list[tuple[int, int, str]] = []
    rec = RolloutRecorder(tmp_path, tokenizer, agents={"math": "single_turn"}, seed=3,
                          listeners=[lambda step, records: got.append((step, len(records),
                                                                       threading.current_thread().name))])
    for step in range(2):
        groups = make_groups(tokenizer, step, n_groups=3)
        # the last group was dropped by a filter: recorded after the trained ones, never trained
        rec.add(step, groups[:2], trained_batch(groups[:2]), policy_version=step + 1, filtered=groups)
    rec.flush()
    assert rollout_steps(tmp_path) == [0, 1]
    assert got == [(0, 9, "rollout-records"), (1, 9, "rollout-records")]
    records = read_rollouts(tmp_path, 1)
    assert [r["status"] for r in records] == ["ok", "ok", "failed"] * 3
    assert [r["trained"] for r in records] == [True, True, False] * 2 + [False] * 3
    assert [r["filtered"] for r in records] == [False] * 6 + [True] * 3
    assert [r["group_id"] for r in records[6:]] == ["1:2"] * 3 and {r["step_total"] for r in records} == {9}
    first = records[0]
    assert first["agent"] == "single_turn" and first["staleness"] == 1 and first["weight_versions"] == [1, 1]
    seg = first["segments"][0]
    assert seg["row"] == 0 and seg["old_logprobs"][-1] is None  # -inf written as null
    assert "".join(seg["token_text"]) == tokenizer.decode(seg["tokens"])
    assert [a for a, m in zip(seg["advantages"], seg["loss_mask"]) if m] != []
    assert first["turns"][0]["response_text"] == " 3" and first["turns"][0]["prompt_text"] == "What is 1+2?"
    assert first["reward"]["reason"] == "j=0"
    rec.close()
    # a later run resumed at step 1 drops step 1 (and half-written files), keeps step 0
    (tmp_path / "rollouts" / "step_000001.jsonl.gz.tmp").write_bytes(b"x")
    again = RolloutRecorder(tmp_path, tokenizer)
    assert again.truncate_after(1) == [1]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_000000.jsonl.gz"]


def test_keep_n_is_a_seeded_sample_and_zero_writes_nothing(tmp_path, tokenizer):
    groups = make_groups(tokenizer, 0, n_groups=4)
    batch = trained_batch(groups)
    picks = []
    for run in ("a", "b"):
        rec = RolloutRecorder(tmp_path / run, tokenizer, keep=5, seed=11)
        rec.add(0, groups, batch, policy_version=0)
        rec.close()
        picks.append([r["index"] for r in read_rollouts(tmp_path / run, 0)])
    assert picks[0] == picks[1] and len(picks[0]) == 5 and picks[0] == sorted(set(picks[0]))
    seen = []
    off = RolloutRecorder(tmp_path / "off", tokenizer, keep=0, listeners=[lambda s, r: seen.append(len(r))])
    off.add(0, groups, batch, policy_version=0)
    off.close()
    assert seen == [1] and rollout_steps(tmp_path / "off") == []  # a sample for the console, no files
    silent = RolloutRecorder(tmp_path / "silent", tokenizer, keep=0)
    assert not silent.active
    with pytest.raises(ValueError, match="run.rollout_records must be -1"):
        RolloutRecorder(tmp_path, tokenizer, keep=-2)


def test_a_failing_listener_is_logged_and_the_records_still_written(tmp_path, tokenizer, caplog):
    def broken(step, records):
        raise RuntimeError("listener down")

    rec = RolloutRecorder(tmp_path, tokenizer, listeners=[broken])
    groups = make_groups(tokenizer, 0)
    with caplog.at_level(logging.ERROR, logger="loongsage"):
        rec.add(0, groups, trained_batch(groups), policy_version=0)
        rec.close()
    assert "a rollout records listener failed at step 0" in caplog.text
    assert len(read_rollouts(tmp_path, 0)) == 6


def test_viewer_api_answers_and_refuses(tmp_path, tokenizer):
    rec = RolloutRecorder(tmp_path, tokenizer)
    groups = make_groups(tokenizer, 0)
    rec.add(0, groups, trained_batch(groups), policy_version=0)
    rec.close()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": float("nan")}) + "\n"
                                            + '{"step": 1, "rollout/rew')
    server = ViewerServer([str(tmp_path)])
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        runs = httpx.get(url + "api/runs").json()["runs"]
        assert runs[0]["metrics_steps"] == 1 and runs[0]["record_steps"] == [0] and not runs[0]["finished"]
        assert httpx.get(url + "api/runs/0/metrics").json()["rows"] == [{"step": 0, "rollout/reward_mean": None}]
        rows = httpx.get(url + "api/runs/0/steps/0").json()["rows"]
        assert [r["status"] for r in rows] == ["ok", "ok", "failed"] * 2
        one = httpx.get(url + "api/runs/0/steps/0/4").json()
        assert one["id"] == "0:1:1" and one["segments"][0]["tokens"]
        assert httpx.get(url + "api/runs/0/steps/5").status_code == 404
        assert "no rollout records for step 5" in httpx.get(url + "api/runs/0/steps/5").text
        assert httpx.get(url + "api/runs/3/metrics").status_code == 404
        assert httpx.get(url + "api/runs/0/steps/x").status_code == 400
        assert httpx.get(url + "api/runs/0/steps/0/99").status_code == 404
        assert httpx.get(url + "static/vendor/uPlot.iife.min.js").status_code == 200
        # a records file replaced by a truncated one: the rows before the cut, and the problem
        data = records_path(tmp_path, 0).read_bytes()
        records_path(tmp_path, 0).write_bytes(data[: len(data) // 2])
        answer = httpx.get(url + "api/runs/0/steps/0").json()
        assert "truncated after" in answer["problem"] and len(answer["rows"]) < 6
    finally:
        server.stop()
    with gzip.open(records_path(tmp_path, 0), "wt") as fh:
        fh.write("not json\n")
    with pytest.raises(RolloutRecordsError, match=r"step_000000\.jsonl\.gz: line 1 is not JSON"):
        read_rollouts(tmp_path, 0)
