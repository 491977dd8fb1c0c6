"""Rollout records of a real run: they hold exactly what the trainer trained on."""

from __future__ import annotations

import json

import pytest

from loongsage_core import RolloutRecordsError, read_rollouts, rollout_steps


def test_every_step_has_records_aligned_with_metrics(recorded_run):
    out = recorded_run["dir"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == rollout_steps(out) == [0, 1]
    for m in metrics:
        records = read_rollouts(out, m["step"])
        assert len(records) == m["rollout/num_trajectories"] == 9
        assert [r["index"] for r in records] == list(range(9))
        # what the status filter dropped (the failed samples) is recorded after what was trained
        dropped = [r["index"] for r in records if r["filtered"]]
        assert dropped and dropped == list(range(9 - len(dropped), 9))
        assert {r["source"] for r in records} == {"blackbox", "tools", "flaky"}
        assert {r["agent"] for r in records} == {"command", "tool_agent", "single_turn"}
        for r in records:
            assert r["format"] == 1 and r["step"] == m["step"]
            assert r["status"] in ("ok", "failed", "truncated", "aborted")
            assert r["policy_version"] == m["step"]  # one weight update per step, from version 0
            if r["weight_versions"] is not None:
                assert r["staleness"] == r["policy_version"] - r["weight_versions"][0] == 0
            assert r["timing"] and all(v >= 0 for v in r["timing"].values())


def test_records_equal_the_trained_rows(recorded_run):
    out = recorded_run["dir"]
    for step, batch in recorded_run["batches"].items():
        records = read_rollouts(out, step)
        seen_rows = []
        for r in records:
            trained = [s for s in r["segments"] if s["row"] is not None]
            assert r["trained"] == bool(trained)
            assert r["trained"] == (r["status"] in ("ok", "truncated"))
            for seg in r["segments"]:
                n = len(seg["tokens"])
                assert len(seg["token_text"]) == len(seg["loss_mask"]) == len(seg["rollout_logprobs"]) == n
                if seg["row"] is None:
                    continue
                row = seg["row"]
                seen_rows.append(row)
                assert batch.meta["trajectory_id"][row] == r["id"]
                assert seg["tokens"] == batch["input_ids"][row, :n].tolist()
                assert seg["loss_mask"] == [int(x) for x in batch["loss_mask"][row, :n].tolist()]
                assert seg["advantages"] == batch["advantages"][row, :n].tolist()
                assert seg["old_logprobs"] == batch["old_logprobs"][row, :n].tolist()
                assert seg["rollout_logprobs"] == batch["rollout_logprobs"][row, :n].tolist()
                assert sum(seg["loss_mask"]) > 0
        # every trained row is in exactly one record
        assert sorted(seen_rows) == list(range(len(batch)))
        assert any(any(a != 0 for a in s.get("advantages", [])) for r in records for s in r["segments"])


def test_failed_reward_tool_calls_and_black_box_turns_are_recorded(recorded_run):
    records = [r for step in rollout_steps(recorded_run["dir"]) for r in read_rollouts(recorded_run["dir"], step)]
    failed = [r for r in records if r["status"] == "failed"]
    assert failed and {r["source"] for r in failed} == {"flaky"}
    for r in failed:
        assert r["filtered"]  # dropped by the status filter
        assert r["error"] == "reward 'flaky' raised RuntimeError: the grader is down"
        assert r["reward"]["components"]["flaky"]["error"] == r["error"]
        assert not r["trained"] and r["response_length"] > 0
    assert not any(r["filtered"] for r in records if r["status"] != "failed")
    graded = [r for r in records if r["source"] == "flaky" and r["status"] != "failed"]
    assert graded and all(set(r["reward"]["components"]) == {"varied", "flaky"} for r in graded)
    assert all(r["reward"]["components"]["varied"]["reason"].startswith("crc bucket") for r in graded)

    tools = [r for r in records if r["source"] == "tools"]
    for r in tools:
        assert len(r["turns"]) == 2  # max_turns = 2, a tool call in each
        calls = r["tool_calls"]
        assert [c["name"] for c in calls] == ["add", "add"] and [c["output"] for c in calls] == ["3", "3"]
        assert [c["turn"] for c in calls] == [0, 1]
        assert r["turns"][0]["tool_calls"] == [calls[0]]
        assert "<tool_call>" in r["turns"][0]["response_text"]
        # the tool's output was read by the model in the second turn
        assert "<tool_response>\n3\n</tool_response>" in r["turns"][1]["prompt_text"]

    blackbox = [r for r in records if r["source"] == "blackbox"]
    for r in blackbox:
        assert len(r["turns"]) == 2 and r["agent"] == "command"
        assert "numeric_match" in r["reward"]["components"]
        assert r["reward"]["components"]["numeric_match"]["reason"]
        assert r["messages"][0]["role"] == "system"


def test_reader_names_the_file_at_fault(recorded_run, tmp_path):
    import gzip
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(recorded_run["dir"] / "rollouts", run / "rollouts")
    with pytest.raises(RolloutRecordsError, match=r"step_000007\.jsonl\.gz: no rollout records for step 7 "
                                                  r"\(steps with records: 0\.\.1\)"):
        read_rollouts(run, 7)
    path = run / "rollouts" / "step_000001.jsonl.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(RolloutRecordsError, match=r"step_000001\.jsonl\.gz: truncated after \d+ records"):
        read_rollouts(run, 1)
    with gzip.open(path, "wt") as fh:
        fh.write('{"format": 99, "step": 1}\n')
    with pytest.raises(RolloutRecordsError, match="record format 99"):
        read_rollouts(run, 1)
