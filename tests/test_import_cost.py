"""Importing the contract, the host, the CLI and every plugin's entry module stays light."""

from __future__ import annotations

import json
import subprocess
import sys
import time

HEAVY = ("torch", "ray", "transformers", "megatron", "sglang", "numpy")


def imported_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


def test_contract_and_host_import_without_heavy_modules():
    mods = imported_after("import loongsage_hookspecs, loongsage_core, loongsage_core.config, "
                          "loongsage_core.plugins, loongsage_core.resolve, loongsage_core.cli")
    assert heavy(mods) == []


def test_loading_every_installed_plugin_stays_light():
    mods = imported_after("from loongsage_core.plugins import PluginHost\n"
                          "host = PluginHost.create()\n"
                          "assert len(host.plugins) >= 9, host.plugins\n"
                          "host.describe()\n")
    assert heavy(mods) == []


def test_cli_help_is_fast():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "--help"], check=True, capture_output=True,
                         text=True)
    elapsed = time.perf_counter() - start
    assert "run" in out.stdout and "validate" in out.stdout and "plugins" in out.stdout
    # generous bound: the interpreter start dominates; importing torch alone would take several seconds
    assert elapsed < 3.0, elapsed


def test_a_broken_job_file_fails_before_torch_or_ray_is_imported(tmp_path):
    """``run``, ``sft`` and ``serve`` check the job first: a typo costs a fraction of a second."""
    from loongsage_core.cli import main

    job = tmp_path / "bad.toml"
    job.write_text("[train]\nlearning_rate = 1.0\n")
    for command in ("run", "sft", "serve"):
        probe = (f"import sys\nfrom loongsage_core.cli import main\n"
                 f"assert main([{command!r}, {str(job)!r}]) == 2\n")
        assert heavy(imported_after(probe)) == [], command
    assert main(["run", str(job)]) == 2
