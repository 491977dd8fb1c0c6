import json
import math

import pytest
from loongsage_plugin_loggers.jsonl import JsonlLogger, read_metrics

from loongsage_hookspecs import LoggerContext


def ctx(path, total_steps: int = 0) -> LoggerContext:
    """A logger's context for a test: the run directory ``path``."""
    return LoggerContext(output_dir=str(path), total_steps=total_steps)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_writes_one_flushed_line_per_step(tmp_path):
    lg = JsonlLogger(ctx(tmp_path / "run"))
    lg.log(0, {"rollout/reward_mean": 0.25, "train/loss": 1.5, "step": 99})
    # flushed: readable before close
    assert _lines(tmp_path / "run" / "metrics.jsonl") == [{"step": 0, "rollout/reward_mean": 0.25, "train/loss": 1.5}]
    lg.log(1, {"rollout/reward_mean": float("nan"), "flag": True, "note": "x"})
    lg.close()
    assert _lines(tmp_path / "run" / "metrics.jsonl")[1] == {"step": 1, "rollout/reward_mean": None,
                                                              "flag": True, "note": "x"}
    with pytest.raises(RuntimeError, match="after close"):
        lg.log(2, {})


def test_tensor_like_values_become_numbers(tmp_path):
    import torch  # the trainer's tensor type (installed with the trainers; the 'test' extra names it)

    lg = JsonlLogger(ctx(tmp_path))
    lg.log(0, {"a": torch.tensor(0.5), "b": torch.tensor(3)})
    lg.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "a": 0.5, "b": 3}]


def test_resume_appends_and_truncates(tmp_path):
    lg = JsonlLogger(ctx(tmp_path))
    for step in range(5):
        lg.log(step, {"x": step * 1.0})
    lg.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "x":')  # a line cut short by a crash
    lg = JsonlLogger(ctx(tmp_path))
    assert lg.truncate_after(3) == 3  # steps 3, 4 and the broken line
    lg.log(3, {"x": 30.0})
    lg.close()
    assert [(r["step"], r["x"]) for r in _lines(tmp_path / "metrics.jsonl")] == [(0, 0.0), (1, 1.0), (2, 2.0),
                                                                                  (3, 30.0)]


def test_truncation_can_be_disabled(tmp_path):
    lg = JsonlLogger(ctx(tmp_path), truncate_on_resume=False)
    lg.log(0, {"x": 1})
    assert lg.truncate_after(0) == 0
    lg.log(0, {"x": 2})
    lg.close()
    assert [r["x"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_rejects_paths_as_filename(tmp_path):
    with pytest.raises(ValueError, match="filename"):
        JsonlLogger(ctx(tmp_path), filename="../escape.jsonl")


def test_infinities_are_null(tmp_path):
    lg = JsonlLogger(ctx(tmp_path), filename="m.jsonl")
    lg.log(7, {"a": math.inf})
    lg.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 7, "a": null}\n'
