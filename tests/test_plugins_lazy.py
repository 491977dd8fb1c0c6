"""Lazy plugin loading: resolving a job imports only the plugins it enables (the driver's and every
actor's host are built the same way, ``PluginHost.from_job``); ``loongsage plugins`` lists all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loongsage_core.plugins import installed_entry_points

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "recipes" / "grpo.toml"  # enable = ["torch", "rl", "rewards", "loggers", "agents"]

PROBE = """
import json, sys
from loongsage_core.config import load_job
from loongsage_core.plugins import PluginHost
from loongsage_core.resolve import resolve_job

job = load_job(sys.argv[1])
resolved = resolve_job(job)
actor_host = PluginHost.from_job(job)  # what a trainer or engine actor builds
print(json.dumps({"enable": job.plugins.enable,
                  "imported": sorted({m.split(".")[0] for m in sys.modules if m.startswith("loongsage_plugin_")}),
                  "active": sorted(p.name for p in actor_host.active_plugins()),
                  "installed": actor_host.installed_names()}))
"""


def run_probe(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_resolving_a_job_imports_only_the_plugins_it_enables():
    seen = run_probe(PROBE, str(RECIPE))
    enabled = {f"loongsage_plugin_{name}" for name in seen["enable"]}
    assert set(seen["imported"]) == enabled
    assert sorted(seen["active"]) == sorted(seen["enable"])
    # the ones left out are installed (this environment has every plugin of the repository) ...
    installed = {ep.name for ep in installed_entry_points()}
    assert {"distill", "megatron", "sglang", "schedulers"} <= installed
    # ... and still known by name, from metadata, without being imported
    assert installed <= set(seen["installed"])
    assert not {"loongsage_plugin_distill", "loongsage_plugin_megatron", "loongsage_plugin_sglang",
                "loongsage_plugin_schedulers"} & set(seen["imported"])


def test_loongsage_plugins_still_lists_every_installed_plugin():
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "plugins", "--json"], capture_output=True,
                         text=True, cwd=REPO, check=True, timeout=300)
    listed = {p["name"] for p in json.loads(out.stdout)["plugins"]}
    expected = {ep.dist.name if ep.dist else ep.name for ep in installed_entry_points()}
    assert expected <= listed
