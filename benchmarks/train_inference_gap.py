"""Train-inference consistency: ``train/is_approx_k3_kl`` between the embedded engine's rollout
log-probs and the trainer's recomputed log-probs on the same tokens.

Runs the quickstart model for a few steps per precision setting on a local Ray cluster and prints
JSON with the gap of every step (masked mean of ``exp(r) - r - 1``, ``r = logp_old - logp_rollout``)
and the largest per-token log-prob difference. Target in fp32: below 1e-6.

The ``moe`` case runs the Router Replay recipe (``configs/recipes/moe_r3``: a tiny Qwen3-MoE, the
engine in bfloat16, the trainer in float32, ``router_replay`` on). Every step's old-log-prob pass
scores the same rows with and without replay, so the JSON compares them on the same batch:
``moe_k3_replay`` / ``moe_k3_no_replay`` (the gap, mean over steps) and
``moe_router_agreement_replay`` / ``moe_router_agreement_no_replay`` (the share of token-layer
choices where the trainer's experts are the engine's). Target: agreement 1.0 with replay, and the
replayed gap below the unreplayed one.

    python benchmarks/train_inference_gap.py [--steps 3] [--settings fp32,bf16,bf16_fp32_lm_head,moe]
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
MOE_RECIPE = REPO / "configs" / "recipes" / "moe_r3" / "moe_r3.toml"


def moe_case(history: list[dict[str, float]]) -> dict[str, object]:
    """The Router Replay comparison of the ``moe`` case's steps (means, and every step's values)."""
    def series(key: str) -> list[float]:
        return [float(m[key]) for m in history]

    out: dict[str, object] = {}
    for name, key in (("moe_k3_replay", "train/is_approx_k3_kl"),
                      ("moe_k3_no_replay", "train/is_approx_k3_kl_no_replay"),
                      ("moe_router_agreement_replay", "train/router_agreement"),
                      ("moe_router_agreement_no_replay", "train/router_agreement_no_replay")):
        values = series(key)
        out[name] = sum(values) / len(values)
        out[f"{name}_per_step"] = values
    out["agreement_1_with_replay"] = min(series("train/router_agreement")) == 1.0
    out["replay_below_no_replay"] = out["moe_k3_replay"] < out["moe_k3_no_replay"]  # type: ignore[operator]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join([*SETTINGS, "moe"]))
    args = parser.parse_args()
    import ray

    from loongsage_core.config import load_job
    from loongsage_core.controller.placement import start_local_cluster
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    start_local_cluster(num_cpus=2, object_store_mb=128)
    out: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings.split(","):
            if name == "moe":
                job = load_job(MOE_RECIPE, [f"train.total_steps={args.steps}", "run.checkpoint_every=0",
                                            "run.save_hf_at_end=false", 'loggers=[{name = "jsonl"}]'])
                out[name] = moe_case(run_job(resolve_job(job), output_dir=str(Path(tmp) / name)))
                continue
            # no held-out evaluation ("eval.data=[]"): it logs records of its own, without a training gap
            job = load_job(REPO / "configs" / "quickstart" / "grpo.toml",
                           [f"train.total_steps={args.steps}", "run.checkpoint_every=0", "run.save_hf_at_end=false",
                            'loggers=[{name = "jsonl"}]', "eval.data=[]", *SETTINGS[name]])
            history = run_job(resolve_job(job), output_dir=str(Path(tmp) / name))
            gaps = [m["train/is_approx_k3_kl"] for m in history]
            out[name] = {"is_approx_k3_kl": gaps, "max": max(gaps),
                         "logprob_abs_diff_max": max(m["train/logprob_abs_diff_max"] for m in history),
                         "below_1e-6": max(gaps) < 1e-6}
    print(json.dumps({"benchmark": "train_inference_gap", "steps": args.steps, "settings": out}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
