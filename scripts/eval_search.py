"""Held-out success of a policy through the real path: embedded engine -> AgentFlow router (with the
job's middleware) -> the job's agent and tools -> the job's rewards.

A job file's ``[[data]]`` source (the search recipe's ``heldout.toml``: questions about entities
the training split never names) gives the questions; each is run ``--samples`` times with the
job's sampling settings (the RL temperature), ``--concurrency`` trajectories at a time, so the
engine batches them as in training. Printed as one JSON object:

* ``pass@1``: mean over questions of the share of samples that pass (reward >= ``--pass-at``,
  1 = the exact answer), ``pass@k``: share of questions with at least one passing sample
  (k = ``--samples``), ``reward_mean``;
* ``turns_mean``, ``tool_calls_mean`` (model turns and tool calls per trajectory), ``failed``
  (trajectories the agent or a reward failed);
* ``by_hops``: the same per value of the rows' ``metadata["hops"]`` (one- and two-hop questions).

The policy is a Hugging Face directory (``--model``, e.g. a run's ``final_hf/``) or a run's
checkpoint (``--checkpoint DIR/checkpoints/step_N``: its weights in the job's model).

    python scripts/eval_search.py configs/recipes/search/heldout.toml --model runs/search/final_hf
    python scripts/eval_search.py configs/recipes/search/heldout.toml --checkpoint runs/search/checkpoints/step_000020 \
        --append-to runs/search/heldout.jsonl --step 20

``--append-to FILE --step N`` also appends one line ``{"step": N, "eval/<source>/pass@1": ...}`` to
FILE (the metric names of the ``[eval]`` table: ``eval/<source>/{pass@1,pass@k,reward_mean,
turns_mean,tool_calls_mean}``, and per hop count ``eval/<source>/hops<h>/...``), which
``python -m loongsage_plugin_loggers.plot`` draws like a run's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _load_policy(job: Any, checkpoint: Path | None) -> Any:
    """The job's model, with a run checkpoint's weights when one is given (``None``: the engine loads it)."""
    if checkpoint is None:
        return None
    import torch
    from loongsage_plugin_torch.modeling import load_model

    state_file = checkpoint / "trainer" / "trainer_state.pt"
    if not state_file.is_file():
        raise SystemExit(f"{checkpoint}: no trainer/trainer_state.pt (not a run checkpoint)")
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    if state.get("weights") != "full":
        raise SystemExit(f"{checkpoint}: holds a LoRA adapter; evaluate the run's final_hf/ instead")
    model = load_model(job)
    model.load_state_dict(state["model"])
    return model


def summarise(rows: list[dict[str, Any]], samples: int, threshold: float) -> dict[str, Any]:
    """``pass@1``, ``pass@k``, ``reward_mean``, ``turns_mean``, ``tool_calls_mean`` over result rows
    (one per trajectory: ``prompt``, ``reward``, ``turns``, ``tool_calls``)."""
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], []).append(r)
    passed = [[x["reward"] >= threshold for x in group] for group in by_prompt.values()]
    return {
        "prompts": len(by_prompt),
        f"pass@{samples}": sum(any(p) for p in passed) / len(passed),
        "pass@1": statistics.mean(sum(p) / len(p) for p in passed),
        "reward_mean": statistics.mean(r["reward"] for r in rows),
        "turns_mean": statistics.mean(r["turns"] for r in rows),
        "tool_calls_mean": statistics.mean(r["tool_calls"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
    }


def as_metrics(result: dict[str, Any], source: str) -> dict[str, float]:
    """``result`` of :func:`evaluate` as flat ``eval/<source>/...`` metrics."""
    out = {}
    for scope, values in [("", result)] + [(f"hops{h}/", v) for h, v in result.get("by_hops", {}).items()]:
        for key, value in values.items():
            if key not in ("prompts", "failed", "seconds", "by_hops", "source"):
                out[f"eval/{source}/{scope}{key}"] = float(value)
    return out


def evaluate(job_path: Path | str, *, model: Path | str | None = None, checkpoint: Path | str | None = None,
             source: int = 0, prompts: int = 64, samples: int = 4, threshold: float = 1.0, seed: int = 0,
             concurrency: int = 32, overrides: list[str] | None = None, show: int = 0) -> dict[str, Any]:
    """Run ``prompts`` questions of the job's ``source`` ``samples`` times each; see the module docstring.
    ``show``: print the conversations of the first sample of that many questions to stderr."""
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import load_tokenizer

    from loongsage_core.agentflow import AgentFlowRouter, run_agent_trajectory
    from loongsage_core.config import load_job
    from loongsage_core.controller.data import load_rows
    from loongsage_core.controller.rewards import score_trajectory_async
    from loongsage_core.controller.rollout import sample_seed, sampling_params, source_prompt
    from loongsage_core.resolve import resolve_job
    from loongsage_hookspecs import BuildContext, EngineContext, Trajectory, TrajectoryStatus

    extra = list(overrides or []) + ([f"model.path={Path(model).resolve()}"] if model is not None else [])
    resolved = resolve_job(load_job(Path(job_path), extra))
    job, host = resolved.job, resolved.host
    src = job.data[source]
    rows = load_rows(job, source, host)[:prompts]
    engine = EmbeddedEngine(EngineContext(job=job, components=None),
                            model=_load_policy(job, Path(checkpoint) if checkpoint else None))
    url = engine.start()
    tokenizer = load_tokenizer(job)
    middlewares = [host.build("router_middleware", name, BuildContext(where=f"agentflow.middleware {name}", job=job,
                                                                         components=host),
                              **dict(job.agentflow.middleware_args.get(name, {})))
                   for name in job.agentflow.middleware]
    router = AgentFlowRouter(tokenizer, [url], middlewares, max_context_length=job.rollout.max_context_length)
    router.start()
    spec = host.get("agent", src.agent)
    agent_ctx = BuildContext(where=f"{job.data_where(source)}.agent", job=job, components=host)
    results: list[dict[str, Any]] = []

    async def one(i: int, j: int, row: dict[str, Any], slots: asyncio.Semaphore) -> None:
        traj = Trajectory(id=f"eval-{i}-{j}", prompt_id=str(i), group_id=str(i), source=src.name,
                          prompt=source_prompt(row["prompt"], src), label=row["label"], metadata=dict(row["metadata"]))
        params = dict(sampling_params(job, src), seed=sample_seed(seed, 0, i, j), locked=True)

        async def score(t: Trajectory, sandbox: Any) -> None:
            await score_trajectory_async(t, src, host, sandbox)

        async with slots:
            traj = await run_agent_trajectory(
                router, spec, src.agent_args, None, trajectory=traj, sampling=params,
                max_response_tokens=job.agentflow.max_response_tokens or None,
                max_context_length=job.rollout.max_context_length, timeout_s=job.agentflow.agent_timeout_s,
                score=score, build_ctx=agent_ctx)
        agent = traj.metadata.get("agentflow", {}).get("agent", {})
        failed = traj.status != TrajectoryStatus.COMPLETED
        if show and i < show and j == 0:
            print(json.dumps({"label": row["label"], "messages": traj.messages}, indent=1), file=sys.stderr)
        results.append({"prompt": i, "hops": row["metadata"].get("hops"),
                        "reward": 0.0 if failed or traj.reward is None else float(traj.reward.score),
                        "turns": agent.get("turns", 0), "tool_calls": agent.get("tool_calls", 0),
                        "failed": int(failed)})

    async def run_all() -> None:
        slots = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one(i, j, row, slots) for i, row in enumerate(rows) for j in range(samples)))

    t0 = time.perf_counter()
    try:
        asyncio.run(run_all())
    finally:
        router.shutdown()
        engine.shutdown()
    out = summarise(results, samples, threshold)
    hops = sorted({r["hops"] for r in results if r["hops"] is not None})
    if hops:
        out["by_hops"] = {str(h): summarise([r for r in results if r["hops"] == h], samples, threshold) for h in hops}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["source"] = src.name
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a job file whose [[data]] source holds the questions")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", type=Path, help="a Hugging Face directory (default: the job's [model])")
    group.add_argument("--checkpoint", type=Path, help="a run checkpoint directory (checkpoints/step_N)")
    parser.add_argument("--source", type=int, default=0, help="index of the [[data]] source")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--pass-at", type=float, default=1.0, dest="threshold", help="reward that counts as a pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--show", type=int, default=0, help="print this many conversations to stderr")
    parser.add_argument("--append-to", type=Path, default=None, help="append the metrics to this JSONL file")
    parser.add_argument("--step", type=int, default=0, help="the step of the --append-to line")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the job")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    result = evaluate(args.job, model=args.model, checkpoint=args.checkpoint, source=args.source,
                      prompts=args.prompts, samples=args.samples, threshold=args.threshold, seed=args.seed,
                      concurrency=args.concurrency, overrides=args.overrides, show=args.show)
    print(json.dumps(result))
    if args.append_to is not None:
        with args.append_to.open("a") as f:
            f.write(json.dumps({"step": args.step, **as_metrics(result, result["source"])}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
