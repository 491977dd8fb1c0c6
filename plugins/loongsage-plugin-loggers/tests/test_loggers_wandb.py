"""The wandb logger offline: run id kept across restarts, numeric metrics only, config recorded."""

import pytest
from loongsage_plugin_loggers.wandb_logger import WandbLogger, read_offline_history

from loongsage_hookspecs import LoggerContext


def ctx(path, total_steps: int = 0) -> LoggerContext:
    """A logger's context for a test: the run directory ``path``."""
    return LoggerContext(output_dir=str(path), total_steps=total_steps)


def test_logs_numeric_metrics_over_the_step_axis(tmp_path):
    (tmp_path / "config.resolved.toml").write_text("[train]\nlr = 0.5\n")
    lg = WandbLogger(ctx(tmp_path), project="p")
    lg.log(0, {"rollout/reward_mean": 0.25, "note": "text", "flag": True, "nan": float("nan")})
    lg.log(1, {"rollout/reward_mean": 0.5})
    lg.close()
    ids, config, rows = read_offline_history(tmp_path)
    assert ids == {lg.run_id}
    assert config["train"] == {"lr": 0.5}  # the run's config.resolved.toml
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows] == [(0, 0.25), (1, 0.5)]
    assert not any({"note", "flag", "nan"} & set(r) for r in rows)


def test_a_restarted_logger_continues_the_same_run(tmp_path):
    first = WandbLogger(ctx(tmp_path))
    first.log(0, {"x": 1.0})
    first.close()
    second = WandbLogger(ctx(tmp_path))
    second.log(1, {"x": 2.0})
    second.close()
    ids, _config, rows = read_offline_history(tmp_path)
    assert ids == {first.run_id} and first.run_id == second.run_id
    assert [r["x"] for r in rows] == [1.0, 2.0]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be"):
        WandbLogger(ctx("unused"), mode="cloud")


def test_log_after_close_is_an_error(tmp_path):
    lg = WandbLogger(ctx(tmp_path))
    lg.close()
    with pytest.raises(RuntimeError, match="after close"):
        lg.log(0, {"x": 1.0})


def _record(step: int, index: int) -> dict:
    """A rollout record (docs/reference/records.md) with the fields the completions table shows."""
    return {"format": 1, "step": step, "index": index, "source": "math", "agent": "single_turn",
            "status": "failed" if index == 1 else "ok", "prompt": [{"role": "user", "content": f"q{index}"}],
            "reward": {"score": float(index), "reason": f"reason {index}", "error": None},
            "response_text": f"answer {index}", "response_length": 3 + index, "staleness": 0, "turns": []}


def test_completions_table_of_each_step(tmp_path):
    import json

    lg = WandbLogger(ctx(tmp_path), completions=2)
    assert lg.wants_trajectories and not WandbLogger(ctx(tmp_path), completions=0).wants_trajectories
    for step in range(2):
        lg.log(step, {"x": float(step)})
        lg.log_trajectories(step, [_record(step, i) for i in range(3)])
    lg.close()
    _ids, _config, rows = read_offline_history(tmp_path)
    tables = [r for r in rows if "rollout/completions/_type" in r]  # the reader flattens nested keys
    assert [t["step"] for t in tables] == [0, 1]
    assert all(t["rollout/completions/_type"] == "table-file" and t["rollout/completions/nrows"] == 2
               and t["rollout/completions/ncols"] == 10 for t in tables)
    files = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/rollout/completions_*.table.json"))
    assert len(files) == 2
    table = json.loads(files[0].read_text())
    assert table["columns"] == ["step", "source", "agent", "status", "reward", "reason", "prompt", "response",
                                "response_length", "staleness"]
    for row in table["data"]:
        i = int(row[6][1:])  # the prompt "q<i>" names the record
        assert row == [row[0], "math", "single_turn", "failed" if i == 1 else "ok", float(i), f"reason {i}",
                       f"q{i}", f"answer {i}", 3 + i, 0]


def test_bad_completions_is_refused():
    with pytest.raises(ValueError, match="completions must be a non-negative integer"):
        WandbLogger(ctx("unused"), completions=-2)
