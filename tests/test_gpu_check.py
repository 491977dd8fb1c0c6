"""scripts/gpu_check.sh as CI can run it: its CPU dry run validates every GPU case's job and
overrides (one- and two-GPU layouts) and runs the same cases on the CPU, the embedded engine
standing in for SGLang, and prints the JSON report the GPU run prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cpu_dry_run_runs_every_case_and_reports_json(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "STEPS": "1"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-dry-run"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads(done.stdout)
    assert report["dry_run"] is True and report["ok"] is True
    assert sorted(report["cases"]) == ["megatron/sglang_disk", "megatron/sglang_tensor", "torch/auto",
                                       "torch/sglang_disk", "torch/sglang_tensor"]
    for name, case in report["cases"].items():
        assert case["ok"] is True and case["steps"] == 1, name
        assert 0 <= case["k3_mean"] < 1e-6, name  # float32 engine and trainer: the same numbers
        assert case["weight_sync_s_mean"] > 0 and case["weight_sync_gb_per_s_mean"] > 0, name
        assert case["step_s_mean"] > 0 and 0 < case["mfu_train_mean"] <= 1, name
        assert case["peak_trainer_host_rss_gb"] > 0.1, name
    assert report["cases"]["torch/sglang_tensor"]["transport"] == "inprocess"  # colocated, as CUDA IPC is
    # auto's updates (its perf/weight_targets_* metrics) took the in-process path of the colocated layout
    assert report["cases"]["torch/auto"]["transports"] == ["inprocess"]


def test_unknown_arguments_are_refused():
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--gpu"], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 2 and "unknown argument '--gpu'" in done.stderr


def _gpu_check_module():
    """``scripts/gpu_check.py`` as a module (the script the shell wrapper runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_script", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_gpu_cases_weight_transport_args_build_its_sender(tmp_path):
    """The GPU cases' ``weight_transport_args`` (which the dry run replaces with the embedded
    engine's transports) are what each real sender takes: every case's sender, and for ``auto``
    the sender of every table, is built from the job the GPU run loads."""
    from loongsage_core.config import load_job
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import ComponentRef, WeightTransportContext

    gpu_check = _gpu_check_module()
    host = PluginHost.create(["torch", "sglang"])
    assert set(gpu_check.TRANSPORT_ARGS) == {"sglang_disk", "sglang_tensor", "sglang_nccl", "auto"}
    for transport in gpu_check.TRANSPORT_ARGS:
        job = load_job(gpu_check.JOB, gpu_check.gpu_overrides("torch", transport, gpus=2, model=tmp_path, steps=2,
                                                              run_dir=tmp_path))
        args = dict(job.rollout.weight_transport_args)
        assert args == gpu_check.TRANSPORT_ARGS[transport], transport  # nothing merged in from the job file
        ctx = WeightTransportContext(role="sender", job=job, components=host)
        sender = host.bind(ComponentRef("weight_transport", transport, args), ctx, using="sender")
        try:
            for name in args if transport == "auto" else ():
                sender._sender(name)
        finally:
            sender.close()
