"""The wandb logger offline: run id kept across restarts, numeric metrics only, config recorded."""

import pytest
from loongsage_plugin_loggers.wandb_logger import WandbLogger, read_offline_history


def test_logs_numeric_metrics_over_the_step_axis(tmp_path):
    (tmp_path / "config.resolved.toml").write_text("[train]\nlr = 0.5\n")
    lg = WandbLogger(tmp_path, project="p")
    lg.log(0, {"rollout/reward_mean": 0.25, "note": "text", "flag": True, "nan": float("nan")})
    lg.log(1, {"rollout/reward_mean": 0.5})
    lg.close()
    ids, config, rows = read_offline_history(tmp_path)
    assert ids == {lg.run_id}
    assert config["train"] == {"lr": 0.5}  # the run's config.resolved.toml
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows] == [(0, 0.25), (1, 0.5)]
    assert not any({"note", "flag", "nan"} & set(r) for r in rows)


def test_a_restarted_logger_continues_the_same_run(tmp_path):
    first = WandbLogger(tmp_path)
    first.log(0, {"x": 1.0})
    first.close()
    second = WandbLogger(tmp_path)
    second.log(1, {"x": 2.0})
    second.close()
    ids, _config, rows = read_offline_history(tmp_path)
    assert ids == {first.run_id} and first.run_id == second.run_id
    assert [r["x"] for r in rows] == [1.0, 2.0]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be"):
        WandbLogger("unused", mode="cloud")


def test_log_after_close_is_an_error(tmp_path):
    lg = WandbLogger(tmp_path)
    lg.close()
    with pytest.raises(RuntimeError, match="after close"):
        lg.log(0, {"x": 1.0})
