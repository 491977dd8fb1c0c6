import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from loongsage_plugin_loggers import plugin
from loongsage_plugin_loggers.jsonl import JsonlLogger
from loongsage_plugin_loggers.plot import main, plot_metrics

from loongsage_hookspecs import LoggerContext, LoggerSpec, MetricsLogger


def ctx(path, total_steps: int = 0) -> LoggerContext:
    """A logger's context for a test: the run directory ``path``."""
    return LoggerContext(output_dir=str(path), total_steps=total_steps)


@pytest.fixture
def metrics_file(tmp_path):
    lg = JsonlLogger(ctx(tmp_path))
    for step in range(6):
        lg.log(step, {"rollout/reward_mean": step / 5, "train/loss": 1 / (step + 1), "train/grad_norm": 0.5})
    lg.close()
    return tmp_path / "metrics.jsonl"


def test_plot_writes_a_png(metrics_file, tmp_path):
    out = plot_metrics(metrics_file, ["rollout/reward_mean", "train/*"], tmp_path / "figs" / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    height = int.from_bytes(data[20:24], "big")
    assert height > 500  # three panels stacked


def test_plot_names_missing_keys(metrics_file, tmp_path):
    with pytest.raises(ValueError, match="available: rollout/reward_mean, train/grad_norm, train/loss"):
        plot_metrics(metrics_file, ["reward"], tmp_path / "x.png")
    assert main([str(metrics_file), "nope", "-o", str(tmp_path / "y.png")]) == 2


def test_plot_without_matplotlib_says_how_to_install(metrics_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"loongsage-plugin-loggers\[plot\]"):
        plot_metrics(metrics_file, ["train/loss"], tmp_path / "z.png")


def test_hook_provides_loggers_that_follow_the_protocol(tmp_path):
    specs = {s.name: s for s in plugin.loongsage_loggers()}
    assert set(specs) == {"console", "jsonl", "tensorboard", "wandb"}
    for name, spec in specs.items():
        assert isinstance(spec, LoggerSpec) and spec.description
        logger = spec.factory(ctx(tmp_path / name, 3), **({"live": False} if name == "console" else {}))
        assert isinstance(logger, MetricsLogger)
        logger.log(0, {"train/loss": 1.0})
        logger.close()
    assert (tmp_path / "jsonl" / "metrics.jsonl").is_file()
    assert list((tmp_path / "tensorboard" / "tensorboard").glob("events.out.tfevents.*"))


def test_entry_point_and_light_import():
    eps = {ep.name: ep.value for ep in entry_points(group="loongsage")}
    assert eps.get("loggers") == "loongsage_plugin_loggers.plugin"
    code = ("import sys, loongsage_plugin_loggers.plugin; "
            "print(sorted(m for m in ('rich', 'torch', 'tensorboardX', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
