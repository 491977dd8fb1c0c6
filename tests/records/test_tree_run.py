"""A real run over trajectory trees (the scripted harness of tests/agentflow/tree_harness.py: a
compaction and a sub-agent, three segments per trajectory): every segment is a training row, and
the rollout records carry the tree."""

from __future__ import annotations

from loongsage_core import read_rollouts


def test_every_segment_of_a_tree_is_trained_and_recorded(tree_run):
    [metrics] = tree_run["history"]
    batch = tree_run["batch"]
    records = read_rollouts(tree_run["dir"], 0)
    assert len(records) == metrics["rollout/num_trajectories"] == 2
    assert metrics["rollout/failed_ratio"] == 0.0
    # rows = segments: three per trajectory, one sample index per trajectory
    assert metrics["rollout/num_rows"] == len(batch) == 6
    assert batch["sample_index"].tolist() == [0, 0, 0, 1, 1, 1]
    rows = []
    for r in records:
        segs = r["segments"]
        tree = r["metadata"]["agentflow"]["tree"]
        assert [(s["parent"], s["fork_at"] is None) for s in segs] == [(None, True), (0, False), (0, False)]
        assert [(t["parent"], t["fork_at"], t["turns"]) for t in tree] == [
            (s["parent"], s["fork_at"], turns) for s, turns in zip(segs, ([0, 1, 2], [3, 6], [4, 5]))]
        assert r["metadata"]["agentflow"]["agent"] == {"sub_agent_turns": 2, "compactions": 1}
        for s in segs:
            n = len(s["tokens"])
            assert s["row"] is not None and s["tokens"] == batch["input_ids"][s["row"], :n].tolist()
            assert s["loss_mask"] == [int(x) for x in batch["loss_mask"][s["row"], :n].tolist()]
            if s["parent"] is not None:  # the shared prefix: the parent's tokens, trained there only
                assert s["tokens"][:s["fork_at"]] == segs[s["parent"]]["tokens"][:s["fork_at"]]
                assert not any(s["loss_mask"][:s["fork_at"]])
            rows.append(s["row"])
        # the trajectory's advantage is on the trained tokens of each of its segments
        advantages = {a for s in segs for a, m in zip(s["advantages"], s["loss_mask"]) if m}
        assert len(advantages) == 1 and advantages != {0.0}
        assert r["response_length"] == sum(sum(s["loss_mask"]) for s in segs)
        # the turns in the order they were made: main, main, main, compacted main, sub, sub, main
        assert [t["segment"] for t in r["turns"]] == [0, 0, 0, 1, 2, 2, 1]
        for t in r["turns"]:
            assert segs[t["segment"]]["turns"].count([t["start"], t["end"]]) == 1
    assert sorted(rows) == list(range(6))
    assert {r["reward"]["score"] for r in records} == {0.0, 1.0}
