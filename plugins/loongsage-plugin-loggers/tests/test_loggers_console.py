import io
import re

import pytest
from loongsage_plugin_loggers.console import ConsoleLogger
from rich.console import Console

from loongsage_hookspecs import LoggerContext


def ctx(path, total_steps: int = 0) -> LoggerContext:
    """A logger's context for a test: the run directory ``path``."""
    return LoggerContext(output_dir=str(path), total_steps=total_steps)


def test_plain_lines_when_not_a_terminal(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 3), keys=["rollout/reward_mean", "train/loss"],
                       console=Console(file=buf, force_terminal=False, width=200))
    assert lg.live is False
    for step in range(3):
        lg.log(step, {"rollout/reward_mean": 0.125 * step, "train/loss": 2.0, "other": 1})
    lg.close()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "step 1/3  reward_mean=0  loss=2"
    assert lines[2].startswith("step 3/3  reward_mean=0.25  loss=2") and re.search(r"\d+\.\ds$", lines[2])
    assert "other" not in buf.getvalue()


def test_every_and_default_keys(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 5), every=2, console=Console(file=buf, force_terminal=False))
    for step in range(5):
        lg.log(step, {"train/loss": 1.0, "zzz": 2.0, "rollout/reward_mean": 0.5})
    lg.close()
    lines = buf.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["2/5", "4/5", "5/5"]  # every 2nd step, and the last
    assert "reward_mean=0.5  loss=1" in lines[0] and "zzz" not in lines[0]


def test_patterns_and_ambiguous_short_names(tmp_path):
    lg = ConsoleLogger(ctx(tmp_path), keys=["rollout/*", "train/reward_mean"], live=False)
    text = lg.format_metrics({"rollout/reward_mean": 1.0, "rollout/len": 3, "train/reward_mean": 2.0})
    assert text == "len=3  rollout/reward_mean=1  train/reward_mean=2"


def test_live_bar_on_a_terminal(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 10), keys=["train/loss"],
                       console=Console(file=buf, force_terminal=True, width=160))
    assert lg.live is True
    for step in range(4):
        lg.log(step, {"train/loss": 0.5 + step})
    lg.close()
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "4/10" in out and "loss=3.5" in out
    with pytest.raises(RuntimeError):
        lg.log(5, {})


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"stream": "file"}])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        ConsoleLogger(ctx(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="'total_steps' must be a non-negative integer"):
        ConsoleLogger(ctx(tmp_path, -1))


def test_total_steps_comes_from_the_context(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 7), keys=["train/loss"], console=Console(file=buf, force_terminal=False))
    lg.log(0, {"train/loss": 1.0})
    lg.close()
    assert lg.total_steps == 7 and buf.getvalue().startswith("step 1/7  loss=1")
    assert ConsoleLogger(ctx(tmp_path), live=False).total_steps is None  # 0: unknown, no end


def _record(step: int, index: int) -> dict:
    """A rollout record (docs/reference/records.md) with the fields the console shows."""
    return {"format": 1, "step": step, "index": index, "source": "tools", "agent": "tool_agent", "status": "ok",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}],
            "reward": {"score": 1.0, "reason": "numeric_match: answer 3 matches the label", "error": None},
            "turns": [{"response_text": "<tool_call>{\"name\": \"add\"}</tool_call>",
                       "tool_calls": [{"name": "add", "arguments": "{\"a\": 1, \"b\": 2}", "output": "3"}]},
                      {"response_text": "The answer is\n3", "tool_calls": []}],
            "response_text": "The answer is 3", "error": None}


def test_show_samples_prints_one_trajectory_every_n_steps(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 4), show_samples=2, console=Console(file=buf, force_terminal=False,
                                                                         width=300))
    assert lg.wants_trajectories
    for step in range(4):
        lg.log(step, {"train/loss": 1.0})
        lg.log_trajectories(step, [_record(step, i) for i in range(3)])
    lg.close()
    samples = [ln for ln in buf.getvalue().splitlines() if ln.startswith("── sample")]
    assert [s.split()[4].rstrip(":") for s in samples] == ["1", "3"]  # steps 1 and 3: every 2nd
    assert "tools / tool_agent" in samples[0] and "reward=1 (numeric_match: answer 3 matches the label)" in samples[0]
    text = buf.getvalue()
    assert "  prompt: What is 1+2?" in text
    assert '    tool add({"a": 1, "b": 2}) -> 3' in text
    assert "  turn 1: The answer is 3" in text  # one line per field


def test_show_samples_off_and_bad_values(tmp_path):
    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path), console=Console(file=buf, force_terminal=False))
    assert not lg.wants_trajectories
    lg.log_trajectories(0, [_record(0, 0)])
    assert buf.getvalue() == ""
    with pytest.raises(ValueError, match="'show_samples' must be a non-negative integer, got -1"):
        ConsoleLogger(ctx(tmp_path), show_samples=-1)
    short = ConsoleLogger(ctx(tmp_path), sample_chars=20, live=False)
    assert "turn 0: <tool_call>{\"name\": ...\n" in short.format_sample(_record(0, 0))  # 20 characters


def test_samples_beside_the_live_bar_from_another_thread(tmp_path):
    import threading

    buf = io.StringIO()
    lg = ConsoleLogger(ctx(tmp_path, 4), show_samples=1, keys=["train/loss"],
                       console=Console(file=buf, force_terminal=True, width=200))
    for step in range(4):
        lg.log(step, {"train/loss": float(step)})
        # the host's records writer calls from its own thread while the bar is live
        t = threading.Thread(target=lg.log_trajectories, args=(step, [_record(step, 0)]))
        t.start()
        t.join()
    lg.close()
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert [int(m) for m in re.findall(r"── sample of step (\d+):", out)] == [0, 1, 2, 3]
    assert "4/4" in out and "loss=3" in out
