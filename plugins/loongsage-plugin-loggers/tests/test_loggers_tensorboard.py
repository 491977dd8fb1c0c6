import struct
from pathlib import Path

from loongsage_plugin_loggers.tensorboard import TensorBoardLogger
from tensorboardX.proto.event_pb2 import Event

from loongsage_hookspecs import LoggerContext


def ctx(path, total_steps: int = 0) -> LoggerContext:
    """A logger's context for a test: the run directory ``path``."""
    return LoggerContext(output_dir=str(path), total_steps=total_steps)


def read_scalars(log_dir: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the TFRecord event files under log_dir, in order."""
    out = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.append((event.step, v.tag, round(v.simple_value, 6)))
    return out


def test_writes_numeric_scalars(tmp_path):
    lg = TensorBoardLogger(ctx(tmp_path))
    lg.log(0, {"rollout/reward_mean": 0.25, "note": "text", "step": 0, "nan": float("nan")})
    lg.log(1, {"rollout/reward_mean": 0.5, "count": 3})
    lg.close()
    assert read_scalars(tmp_path / "tensorboard") == [(0, "rollout/reward_mean", 0.25), (1, "rollout/reward_mean", 0.5),
                                                      (1, "count", 3.0)]


def test_resume_writes_a_purge_marker(tmp_path):
    lg = TensorBoardLogger(ctx(tmp_path), log_dir="tb")
    lg.log(0, {"x": 1.0})
    lg.close()
    lg = TensorBoardLogger(ctx(tmp_path), log_dir="tb")
    lg.truncate_after(1)
    lg.log(1, {"x": 2.0})
    lg.close()
    files = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 2
    data = files[-1].read_bytes()
    events = []
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
        pos += 12 + length + 4
    # TensorBoard drops earlier events at steps >= 1 when it sees this session restart
    assert any(e.session_log.status == e.session_log.START and e.step == 1 for e in events)
