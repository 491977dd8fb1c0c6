#!/usr/bin/env python3
"""Memory and step time of distillation teachers: bounded residency vs every teacher resident.

N same-size teachers (random Qwen3 models saved to local directories, each the teacher of its
own data source) score one batch per step through :class:`TeacherGroup`; every step has rows of
every source, so every teacher runs every step. Two policies:

* ``resident``: ``max_resident_teachers = N`` (every teacher built once and kept);
* ``bounded``: ``max_resident_teachers = 1``; on the CPU with ``teacher_offload = "release"``
  (only one teacher in memory at a time, the others rebuilt from disk when their turn comes), on
  CUDA with ``teacher_offload = "cpu"`` (one teacher on the device, the rest in host memory).

Each (N, policy) runs in a fresh process. Reported per run: ``peak_rss_mb`` (the process's
high-water mark, ``VmHWM``), ``teacher_rss_mb`` (that minus the resident size after importing
torch and transformers, i.e. what the teachers and their activations added), on CUDA
``peak_cuda_mb``, ``first_step_s`` and the median ``step_s`` of the later steps. Prints JSON.

    python benchmarks/teacher_memory.py --teachers 1 2 4 --hidden 768 --layers 4 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_config(hidden: int, layers: int) -> dict[str, Any]:
    heads = max(1, hidden // 64)
    return {"model_type": "qwen3", "vocab_size": 512, "hidden_size": hidden, "intermediate_size": hidden * 3,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": hidden // heads, "max_position_embeddings": 1024, "tie_word_embeddings": True,
            "rope_theta": 10000.0}


def save_teachers(root: Path, count: int, hidden: int, layers: int) -> list[Path]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = model_config(hidden, layers)
    model_type = conf.pop("model_type")
    dirs = []
    for i in range(count):
        path = root / f"teacher{i}"
        torch.manual_seed(i)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf)).save_pretrained(path)
        dirs.append(path)
    return dirs


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (teachers, policy) measurement in this process."""
    import torch
    import transformers  # noqa: F401  (counted in the baseline)

    from loongsage_core.config import DataConfig, JobConfig, PlacementConfig, TeacherConfig
    from loongsage_core.controller.teachers import TeacherGroup
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import Batch

    torch.set_num_threads(args.threads)
    device = args.device
    dirs = [Path(p) for p in args.dirs][:args.teachers[0]]
    n = len(dirs)
    resident = args.policy == "resident"
    offload = "cpu" if (resident or device == "cuda") else "release"
    job = JobConfig(
        teachers=[TeacherConfig(name=f"t{i}", path=str(d), args={"device": device, "micro_batch_size": args.rows})
                  for i, d in enumerate(dirs)],
        data=[DataConfig(name=f"s{i}", path="unused.jsonl", teacher=f"t{i}") for i in range(n)],
        placement=PlacementConfig(max_resident_teachers=n if resident else 1, teacher_offload=offload))
    job.algorithm.kl, job.algorithm.kl_coef = "opd_k3", 1.0
    host = PluginHost.create(enable=["distill"])
    g = torch.Generator().manual_seed(0)
    rows = args.rows * n
    batch = Batch(tensors={"input_ids": torch.randint(0, 512, (rows, args.width), generator=g),
                           "attention_mask": torch.ones(rows, args.width, dtype=torch.long)},
                  meta={"source": [f"s{i % n}" for i in range(rows)]})
    baseline = _status_mb("VmRSS")
    group = TeacherGroup.from_job(job, host)
    assert group is not None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = group.forward(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        assert float(out["teacher_mask"].min()) == 1.0
    peak = _status_mb("VmHWM")
    result: dict[str, Any] = {
        "teachers": n, "policy": args.policy, "teacher_offload": offload, "device": device,
        "peak_rss_mb": round(peak, 1), "teacher_rss_mb": round(peak - baseline, 1),
        "first_step_s": round(times[0], 4),
        "step_s": round(statistics.median(times[1:] or times), 4),
        "teacher_loads": group.loads,
        "teacher_builds": sum(t.builds for t in group.teachers.values()),
    }
    if device == "cuda":
        result["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teachers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4, help="rows per source (and per teacher forward pass)")
    parser.add_argument("--width", type=int, default=128, help="tokens per row")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="resident", help=argparse.SUPPRESS)
    parser.add_argument("--dirs", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print(json.dumps(worker(args)))
        return

    runs = []
    with tempfile.TemporaryDirectory(prefix="teacher-bench-") as tmp:
        dirs = save_teachers(Path(tmp), max(args.teachers), args.hidden, args.layers)
        size_mb = sum(f.stat().st_size for f in dirs[0].iterdir()) / 2**20
        for n in args.teachers:
            for policy in ("resident", "bounded"):
                cmd = [sys.executable, __file__, "--worker", "--policy", policy, "--teachers", str(n),
                       "--rows", str(args.rows), "--width", str(args.width), "--steps", str(args.steps),
                       "--threads", str(args.threads), "--device", args.device, "--dirs", *map(str, dirs)]
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    raise SystemExit(f"worker {policy} x {n} failed:\n{out.stderr[-4000:]}")
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"teacher_file_mb": round(size_mb, 1), "hidden": args.hidden, "layers": args.layers,
                      "rows_per_teacher": args.rows, "width": args.width, "steps": args.steps, "runs": runs},
                     indent=1))


if __name__ == "__main__":
    main()
