"""Train-inference consistency: ``train/is_approx_k3_kl`` between the embedded engine's rollout
log-probs and the trainer's recomputed log-probs on the same tokens.

Runs the quickstart model for a few steps per precision setting on a local Ray cluster and prints
JSON with the gap of every step (masked mean of ``exp(r) - r - 1``, ``r = logp_old - logp_rollout``)
and the largest per-token log-prob difference. Target in fp32: below 1e-6.

    python benchmarks/train_inference_gap.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "fp32": ["model.dtype=float32"],
    "bf16": ["model.dtype=bfloat16"],
    "bf16_fp32_lm_head": ["model.dtype=bfloat16", "model.fp32_lm_head=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    import ray

    from loongsage_core.config import load_job
    from loongsage_core.controller.entry import run_job
    from loongsage_core.resolve import resolve_job

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    out: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings.split(","):
            job = load_job(REPO / "configs" / "quickstart" / "grpo.toml",
                           [f"train.total_steps={args.steps}", "run.checkpoint_every=0", "run.save_hf_at_end=false",
                            'loggers=[{name = "jsonl"}]', *SETTINGS[name]])
            history = run_job(resolve_job(job), output_dir=str(Path(tmp) / name))
            gaps = [m["train/is_approx_k3_kl"] for m in history]
            out[name] = {"is_approx_k3_kl": gaps, "max": max(gaps),
                         "logprob_abs_diff_max": max(m["train/logprob_abs_diff_max"] for m in history),
                         "below_1e-6": max(gaps) < 1e-6}
    print(json.dumps({"benchmark": "train_inference_gap", "steps": args.steps, "settings": out}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
