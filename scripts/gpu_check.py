"""The GPU check's driver (``scripts/gpu_check.sh`` installs what it needs, then runs this).

For each train backend (``BACKENDS``, default ``torch megatron``) and each weight transport one GPU
allows (``TRANSPORTS``, default ``sglang_disk sglang_tensor auto``, plus ``sglang_nccl`` with two
GPUs; and ``auto``, with the first backend only, in the colocated layout, where it must choose
``sglang_tensor`` for the real SGLang server), it validates then runs a few GRPO steps of
``plugins/loongsage-plugin-sglang/gpu_check.toml`` on a tiny random Qwen3 with SGLang serving the
rollouts, and prints one JSON object: per case the train-inference gap (``train/is_approx_k3_kl``),
the weight-sync seconds and GB/s, the step time, the trainer's and the rollout's MFU, and the peak
memory of the trainer and engine processes (host RSS, and device memory from ``nvidia-smi`` on a
GPU). A case whose mean gap is above ``MAX_K3`` (default 0.05), or whose run fails, fails the check
(exit status 1).

``--cpu-dry-run`` runs the same cases on the CPU, so the check cannot rot unseen: the embedded
engine stands in for SGLang, float32 for bfloat16, and each SGLang transport for the embedded
engine's own (``sglang_disk`` -> ``shm``, ``sglang_tensor`` -> ``inprocess`` colocated,
``sglang_nccl`` -> ``broadcast``; ``auto`` must then choose ``inprocess``). The ``auto`` case reports the
transports its updates took (``transports``, from its ``perf/weight_targets_*`` metrics). CI runs it
(``tests/test_gpu_check.py``).

Environment: ``OUT`` (default ``runs/gpu_check``), ``BACKENDS``, ``TRANSPORTS``, ``MAX_K3``,
``STEPS`` (default 4).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "plugins" / "loongsage-plugin-sglang" / "gpu_check.toml"
TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
DRY_RUN_TRANSPORT = {"sglang_disk": "shm", "sglang_tensor": "inprocess", "sglang_nccl": "broadcast", "auto": "auto"}
"""The embedded engine's transport standing in for each SGLang one in ``--cpu-dry-run``."""
BUCKET = {"bucket_bytes": 64 << 20}
TRANSPORT_ARGS: dict[str, dict[str, Any]] = {
    "sglang_disk": {},  # safetensors shards in a temporary directory on this node
    "sglang_tensor": BUCKET,
    "sglang_nccl": BUCKET,
    "auto": {"sglang_tensor": BUCKET, "sglang_nccl": BUCKET},  # one table per transport it may choose
}
"""Each GPU case's ``[rollout] weight_transport_args``: what that transport's sender takes."""
AUTO_CHOICE = {False: "sglang_tensor", True: "inprocess"}
"""What ``auto`` must choose in its case (colocated, trainer on the GPU), on a GPU and in the dry run."""
TARGETS = "perf/weight_sync_perf/weight_targets_"
"""Prefix of the per-step count of engines each transport updated."""


def build_model(out: Path, dtype: str) -> Path:
    """A tiny random Qwen3 (head_dim 64, as SGLang's kernels want) with the test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "config.json").exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2,
                                      pad_token_id=0)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        model.save_pretrained(out)
        for f in TOKENIZER.iterdir():
            shutil.copy(f, out / f.name)
    return out


def gpu_overrides(backend: str, transport: str, *, gpus: int, model: Path, steps: int, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides of one GPU case (the same for ``validate`` and ``run``)."""
    out = [f"model.path={model}", f"train.backend={backend}", f"train.total_steps={steps}",
           f"rollout.weight_transport={transport}",
           f"rollout.weight_transport_args={toml_table(TRANSPORT_ARGS[transport])}",
           f"rollout.engine_args.log_dir={run_dir / 'logs'}"]
    if transport in ("sglang_tensor", "auto"):  # CUDA IPC handles: trainer and engine share one GPU
        out += ["placement.colocate=true", "placement.offload=true", "placement.trainer_gpus=1"]
    elif gpus < 2:  # trainer and engine share the only GPU
        out += ["placement.trainer_gpus=0.5", "placement.engine_gpus=0.5"]
    return out


def toml_table(table: dict[str, Any]) -> str:
    """``table`` as an inline TOML table (an override's value)."""
    parts = [f"{k} = {toml_table(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in table.items()]
    return "{" + ", ".join(parts) + "}"


def cpu_job(backend: str, transport: str, *, model: Path, steps: int, out: Path) -> Path:
    """The job file of one ``--cpu-dry-run`` case: the GPU case's job with the embedded engine
    (no SGLang engine arguments), float32 and the transport standing in for ``transport``."""
    from loongsage_core.config import dump_job_toml, load_job

    colocated = transport in ("sglang_tensor", "auto")
    job = load_job(JOB, [f"model.path={model}", f"train.backend={backend}", f"train.total_steps={steps}",
                         "model.dtype=float32", "rollout.engine=torch",
                         f"rollout.weight_transport={DRY_RUN_TRANSPORT[transport]}", "placement.trainer_gpus=0",
                         "placement.engine_gpus=0", "placement.trainer_cpus=1", "placement.engine_cpus=1",
                         f"placement.colocate={str(colocated).lower()}"])
    job.rollout.engine_args = {}
    job.rollout.weight_transport_args = {}
    path = out / f"{backend}-{transport}-cpu.toml"
    path.write_text(dump_job_toml(job))
    return path


class PeakMemory:
    """Peak memory of the processes a run starts, sampled while it runs: host RSS (``VmHWM``, the
    kernel's own high-water mark) per process, and device memory per process from ``nvidia-smi``.
    An SGLang server process counts as the engine; everything else the run started as trainer
    (Ray actors holding the trainer, and in a colocated run the embedded engine too)."""

    def __init__(self, root_pid: int, gpu: bool) -> None:
        self.root_pid, self.gpu = root_pid, gpu
        self.host: dict[int, tuple[str, float]] = {}
        self.device: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _role(pid: int) -> str | None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
        return "engine" if "sglang" in cmdline and "launch_server" in cmdline else "trainer"

    def _pids(self) -> list[int]:
        """The run's process and its descendants (Ray's workers included: the run starts its own cluster)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int(next(line for line in (entry / "status").read_text().splitlines()
                                if line.startswith("PPid:")).split()[1])
            except (OSError, StopIteration, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [self.root_pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def _sample(self) -> None:
        for pid in self._pids():
            role = self._role(pid)
            try:
                hwm = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("VmHWM:"))
            except (OSError, StopIteration):
                continue
            if role is not None:
                self.host[pid] = (role, max(self.host.get(pid, (role, 0.0))[1], int(hwm.split()[1]) / 2**20))
        if self.gpu and shutil.which("nvidia-smi"):
            query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True)
            for line in query.stdout.splitlines():
                pid_s, _, mib = line.partition(",")
                if pid_s.strip().isdigit() and mib.strip().isdigit():
                    pid = int(pid_s)
                    role = self._role(pid) or "trainer"
                    self.device[pid] = (role, max(self.device.get(pid, (role, 0.0))[1], int(mib) / 1024))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, table in (("host_rss_gb", self.host), ("device_gb", self.device)):
            for role in ("trainer", "engine"):
                values = [gb for r, gb in table.values() if r == role]
                if values:
                    out[f"peak_{role}_{kind}"] = round(max(values), 3)
        return out


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(metrics: list[dict[str, Any]], max_k3: float) -> dict[str, Any]:
    """One case's JSON: the gap, weight sync, step time and MFU over its steps."""
    def series(key: str) -> list[float]:
        return [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))]

    k3 = series("train/is_approx_k3_kl")
    out: dict[str, Any] = {
        "steps": len(metrics),
        "k3_mean": mean(k3), "k3_max": max(k3) if k3 else None,
        "weight_sync_s_mean": mean(series("perf/weight_sync_seconds")),
        "weight_sync_gb_per_s_mean": mean(series("perf/weight_sync_perf/weight_update_gb_per_s")),
        "step_s_mean": mean(series("timing/step")),
        "mfu_train_mean": mean(series("perf/mfu_train")),
        "mfu_rollout_mean": mean(series("perf/mfu_rollout")),
    }
    out["ok"] = bool(k3) and out["k3_mean"] is not None and out["k3_mean"] <= max_k3
    out["transports"] = sorted({key[len(TARGETS):] for m in metrics for key in m if key.startswith(TARGETS)})
    return out


def validate(job: Path, overrides: list[str]) -> str | None:
    """What ``loongsage validate`` checks of ``job`` with ``overrides`` (the job file parsed and
    resolved: plugins, components, their arguments, the backends' checks), in this process so
    that the dry run's 15 validations do not pay 15 interpreter starts: ``None`` when it passes,
    else its error."""
    from loongsage_core.config import load_job
    from loongsage_core.resolve import resolve_job

    try:
        resolve_job(load_job(job, overrides))
    except Exception as err:  # noqa: BLE001 - any refusal is this case's error, reported in its JSON
        return f"{type(err).__name__}: {err}"[-2000:]
    return None


def run_case(backend: str, transport: str, *, dry_run: bool, gpus: int, model: Path, out: Path, steps: int,
             max_k3: float) -> dict[str, Any]:
    """Validate then run one case; its summary (``ok`` false with the error when it failed)."""
    name = f"{backend}-{transport}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    # the GPU case's job and overrides are validated in a dry run too, so they cannot rot unseen
    for layout in ((1, 2) if dry_run else (gpus,)):
        error = validate(JOB, gpu_overrides(backend, transport, gpus=layout, model=model, steps=steps, run_dir=run_dir))
        if error is not None:
            return {"ok": False, "error": f"validate ({layout} GPU layout): {error}"}
    if dry_run:
        job, overrides = cpu_job(backend, transport, model=model, steps=steps, out=out), []
        error = validate(job, overrides)
        if error is not None:
            return {"ok": False, "error": f"validate (cpu dry run): {error}"}
    else:
        job, overrides = JOB, gpu_overrides(backend, transport, gpus=gpus, model=model, steps=steps, run_dir=run_dir)
    started = time.monotonic()
    log_path = out / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "loongsage_core.cli", "run", str(job), "--output-dir",
                                 str(run_dir), *overrides], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        with PeakMemory(proc.pid, gpu=not dry_run) as memory:
            rc = proc.wait()
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        return {"ok": False, "error": f"run exited with {rc} (log: {log_path}): {tail}", **memory.summary()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = summarize(metrics, max_k3)
    result.update(memory.summary(), wall_s=round(time.monotonic() - started, 1))
    if dry_run:
        result["transport"] = DRY_RUN_TRANSPORT[transport]
    if transport == "auto" and result["transports"] != [AUTO_CHOICE[dry_run]]:
        result.update(ok=False, error=f"auto chose {result['transports']}, expected {AUTO_CHOICE[dry_run]}")
    return result


def main(argv: list[str]) -> int:
    dry_run = "--cpu-dry-run" in argv
    out = Path(os.environ.get("OUT", "runs/gpu_check")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    max_k3 = float(os.environ.get("MAX_K3", "0.05"))
    steps = int(os.environ.get("STEPS", "4"))
    backends = os.environ.get("BACKENDS", "torch megatron").split()
    gpus = 0
    if not dry_run:
        import torch

        gpus = torch.cuda.device_count()
    transports = os.environ.get("TRANSPORTS", "sglang_disk sglang_tensor auto" + (" sglang_nccl" if gpus >= 2 else ""))
    model = build_model(out / ("model-fp32" if dry_run else "model"), "float32" if dry_run else "bfloat16")
    report: dict[str, Any] = {"check": "gpu_check", "dry_run": dry_run, "gpus": gpus, "cases": {}}
    for backend in backends:
        for transport in transports.split():
            if transport == "auto" and backend != backends[0]:
                continue  # the choice does not depend on the train backend
            if transport == "sglang_nccl" and not dry_run and gpus < 2:
                report["cases"][f"{backend}/{transport}"] = {"ok": None, "skipped": "needs two GPUs"}
                continue
            print(f"gpu_check: {backend} / {transport}{' (cpu dry run)' if dry_run else ''}", file=sys.stderr,
                  flush=True)
            report["cases"][f"{backend}/{transport}"] = run_case(
                backend, transport, dry_run=dry_run, gpus=gpus, model=model, out=out, steps=steps, max_k3=max_k3)
    report["ok"] = all(c["ok"] is not False for c in report["cases"].values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
