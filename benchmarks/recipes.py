"""Recipes side by side on the quickstart task (one-digit arithmetic, warm-started tiny Qwen3, CPU).

Each recipe of ``configs/recipes/`` named by ``--recipes`` (default ``grpo,dr_grpo,dapo``) runs with
the same budget: ``--steps`` steps of ``--prompts`` prompts x ``--samples`` samples (DAPO's dynamic
sampling may draw more to refill the groups it drops; ``sampled_trajectories`` counts every sample
drawn), for every seed of ``--seeds``, in one local Ray cluster. Everything else is the recipe's own.

Per recipe (means over seeds, and the per-seed values):

* ``final_accuracy``: exact-match accuracy of the rollouts, mean of the last 5 steps. The recipes
  are compared on it because ``rollout/reward_mean`` includes shaping terms (DAPO's overlong
  penalty); ``final_reward`` is that mean of ``rollout/reward_mean`` for reference;
* ``steps_to_threshold``: the first step index whose accuracy, averaged with the two steps before
  it, reaches ``--threshold`` (0.5), i.e. roughly how many updates the policy needed; ``null`` if
  never reached;
* ``step_s``: wall time per step (mean over steps after the first, whose time includes warm-up).

Prints one JSON object. Absolute times move with machine load.

    python benchmarks/recipes.py [--recipes grpo,dr_grpo,dapo --steps 60 --seeds 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "configs" / "recipes"
ACCURACY = "rollout_per_source/arithmetic/reward/exact_match/score"
WINDOW = 3
LAST = 5


def steps_to_threshold(series: list[float], threshold: float, window: int = WINDOW) -> int | None:
    """First index whose trailing mean over ``window`` values (fewer at the start) reaches ``threshold``."""
    for i in range(len(series)):
        part = series[max(0, i - window + 1):i + 1]
        if sum(part) / len(part) >= threshold:
            return i
    return None


def run_recipe(name: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from loongsage_core.config import LoggerConfig, load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    overrides = [f"train.total_steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
                 f"rollout.samples_per_prompt={args.samples}", f"run.seed={seed}", "run.checkpoint_every=0",
                 "run.save_hf_at_end=false"]
    job = load_job(RECIPES / f"{name}.toml", overrides)
    job.loggers = [LoggerConfig(name="jsonl")]  # no console progress on stdout: it carries the JSON
    start = time.perf_counter()
    history = run_job(resolve_job(job), output_dir=str(workdir / f"{name}_{seed}"))
    wall = time.perf_counter() - start
    accuracy = [m.get(ACCURACY, 0.0) for m in history]
    reward = [m["rollout/reward_mean"] for m in history]
    steady = history[1:] or history
    return {
        "final_accuracy": sum(accuracy[-LAST:]) / len(accuracy[-LAST:]),
        "final_reward": sum(reward[-LAST:]) / len(reward[-LAST:]),
        "initial_accuracy": accuracy[0],
        "steps_to_threshold": steps_to_threshold(accuracy, args.threshold),
        "step_s": sum(m["timing/step"] for m in steady) / len(steady),
        "wall_s": wall,
        "sampled_trajectories": sum(m.get("rollout/num_trajectories", 0.0) for m in history),
        "trained_rows": sum(m.get("rollout/num_rows", 0.0) for m in history),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds (``steps_to_threshold``: mean over the seeds that reached it, and how many did)."""
    out: dict[str, Any] = {}
    for key in ("final_accuracy", "final_reward", "initial_accuracy", "step_s", "wall_s", "sampled_trajectories",
                "trained_rows"):
        out[key] = round(statistics.fmean(r[key] for r in runs), 4)
    reached = [r["steps_to_threshold"] for r in runs if r["steps_to_threshold"] is not None]
    out["steps_to_threshold"] = round(statistics.fmean(reached), 2) if reached else None
    out["seeds_reaching_threshold"] = len(reached)
    out["per_seed"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="grpo,dr_grpo,dapo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threshold", type=float, default=0.5)
    args = parser.parse_args()
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    for n in names:
        if not (RECIPES / f"{n}.toml").is_file():
            parser.error(f"--recipes: no recipe {n!r} in {RECIPES}")
    seeds = [int(s) for s in args.seeds.split(",")]
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    # room for the largest recipe (ppo_critic: trainer + critic); logical CPUs, the runs take turns
    start_local_cluster(num_cpus=4, object_store_mb=256)
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                results[name] = summarise([run_recipe(name, seed, args, Path(tmp)) for seed in seeds])
    finally:
        ray.shutdown()
    print(json.dumps({"benchmark": "recipes", "task": "quickstart arithmetic (1 digit, +-)", "steps": args.steps,
                      "prompts_per_step": args.prompts, "samples_per_prompt": args.samples, "seeds": seeds,
                      "threshold": args.threshold, "recipes": results}, indent=2))


if __name__ == "__main__":
    main()
