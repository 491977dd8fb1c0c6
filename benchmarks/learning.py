"""Does each recipe still learn? Its own run, measured on its held-out evaluation (``[eval]``).

For every recipe named by ``--recipe`` (default: every recipe whose job file has an ``[eval]``
table), the recipe's job runs as shipped (``--quick``: ``--quick-steps`` steps, evaluated before the
first and after the last) in a temporary run directory, one after the other in this process's
local Ray cluster, and the held-out pass@1 is read back from its ``metrics.jsonl``. Prints one JSON
object, per recipe and per eval source:

* ``eval_pass1_start``: ``eval/<source>/pass@1`` before the first step (the starting weights);
* ``eval_pass1_end``: the same after the last step; ``eval_pass1_gain`` the difference;
* ``eval_reward_start`` / ``eval_reward_end``: ``eval/<source>/reward_mean`` likewise;
* ``minutes``: wall time of the run (start-up included), ``steps``: steps trained.

A regression in learning shows as a gain that shrinks; absolute minutes move with machine load
(the recipes' READMEs give the figure measured on a quiet machine and the command).

    python benchmarks/learning.py [--recipe quickstart/grpo --recipe recipes/search] [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def recipes_with_eval() -> list[str]:
    """Every recipe (``loongsage recipes``) whose job file has ``[[eval.data]]`` sources."""
    import tomllib

    from loongsage_core.recipes import list_recipes

    names = []
    for recipe in list_recipes():
        try:
            table = tomllib.loads(recipe.path.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if table.get("eval", {}).get("data"):
            names.append(recipe.name)
    return names


def learning_curve(history: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per eval source: pass@1 and reward at the first and the last evaluation of a run."""
    evaluated = [m for m in history if any(k.startswith("eval/") for k in m)]
    sources = sorted({k.split("/")[1] for m in evaluated for k in m if k.startswith("eval/")})
    out: dict[str, dict[str, float]] = {}
    for source in sources:
        rows = [m for m in evaluated if f"eval/{source}/pass@1" in m]
        if not rows:
            continue
        first, last = rows[0], rows[-1]
        out[source] = {
            "eval_pass1_start": first[f"eval/{source}/pass@1"],
            "eval_pass1_end": last[f"eval/{source}/pass@1"],
            "eval_pass1_gain": last[f"eval/{source}/pass@1"] - first[f"eval/{source}/pass@1"],
            "eval_reward_start": first[f"eval/{source}/reward_mean"],
            "eval_reward_end": last[f"eval/{source}/reward_mean"],
            "evaluated_at_steps": [int(m["step"]) for m in rows],
        }
    return out


def run_recipe(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from loongsage_core.config import LoggerConfig, load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.recipes import find_job
    from loongsage_core.resolve import resolve_job

    overrides = ["run.checkpoint_every=0", "run.save_hf_at_end=false"]
    if args.quick:
        overrides += [f"train.total_steps={args.quick_steps}", "eval.every=0", "eval.at_start=true",
                      "eval.at_end=true"]
    job = load_job(find_job(name), overrides)
    job.loggers = [LoggerConfig(name="jsonl")]  # stdout carries the JSON
    start = time.perf_counter()
    history = run_job(resolve_job(job), output_dir=str(workdir / name.replace("/", "_")))
    return {"minutes": round((time.perf_counter() - start) / 60, 2),
            "steps": sum(1 for m in history if "train/loss" in m),
            "sources": learning_curve(history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", action="append", help="a recipe name (repeatable); default: every recipe "
                                                           "with an [eval] table")
    parser.add_argument("--quick", action="store_true", help="a shortened run: --quick-steps steps")
    parser.add_argument("--quick-steps", type=int, default=4)
    args = parser.parse_args()
    names = args.recipe or recipes_with_eval()
    if not names:
        parser.error("no recipe has an [eval] table")
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    start_local_cluster(num_cpus=4, object_store_mb=256)
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                results[name] = run_recipe(name, args, Path(tmp))
    finally:
        ray.shutdown()
    print(json.dumps({"benchmark": "learning", "quick": args.quick, "recipes": results}, indent=2))


if __name__ == "__main__":
    main()
