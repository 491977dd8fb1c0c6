"""Subcommands that installed plugins add to ``loongsage`` (the ``loongsage.commands`` entry-point group)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from loongsage_core import cli

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "configs" / "examples" / "custom_components.toml"

COMMAND_MODULE = """
class Hello:
    help = "say which job and plugins a command receives"

    def add_arguments(self, p):
        p.add_argument("job")
        p.add_argument("--shout", action="store_true")

    def run(self, args, load):
        job, host = load(args.job, ["train.lr=0.5"])
        line = f"lr={job.train.lr} plugins={len(host.describe()['plugins'])}"
        print(line.upper() if args.shout else line)
        return 3


COMMAND = Hello()
VIEW = Hello()
"""


@pytest.fixture
def commands_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution whose entry points add ``hello`` and try to replace the built-in ``view``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "hello_command.py").write_text(textwrap.dedent(COMMAND_MODULE))
    info = site / "hello_command-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-command\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[loongsage.commands]\nhello = hello_command:COMMAND\n"
                                           "view = hello_command:VIEW\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("hello_command", None)
    importlib.invalidate_caches()


def test_a_plugin_command_runs_with_its_job_loaded(commands_installed: None, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["hello", str(JOB), "--shout"]) == 3
    out = capsys.readouterr().out.strip()
    assert out.startswith("LR=0.5 PLUGINS=") and int(out.split("=")[-1]) > 0


def test_a_plugin_cannot_replace_a_builtin_command(commands_installed: None) -> None:
    commands = cli.plugin_commands()
    assert "hello" in commands and "view" not in commands
    assert cli.build_parser().parse_args(["view", "some_dir"]).command == "view"


def test_a_broken_job_file_is_one_line_for_a_plugin_command(commands_installed: None, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 1\n")
    assert cli.main(["hello", str(bad)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("loongsage: error:") and "bad.toml" in err and len(err.strip().splitlines()) == 1


def test_the_tinker_plugin_adds_tinker_serve() -> None:
    assert "tinker-serve" in cli.plugin_commands()
    args = cli.build_parser().parse_args(["tinker-serve", "--model", "tiny=/models/tiny", "--port", "0"])
    assert args.model == ["tiny=/models/tiny"] and args.job is None
