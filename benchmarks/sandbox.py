"""Sandbox cost on the shipped code-repair tasks (configs/recipes/swe): latency and throughput.

Two measurements, side by side in one run:

* ``latency``: for each isolation mode that works here (``bwrap``, ``netns``, ``none``), the
  ``local`` provider's ``create`` (a fresh directory, the task's repository tarball unpacked and
  handed to the sandbox's user) and ``destroy`` (every process killed, the directory removed)
  over the tasks, plus one command in the sandbox (``true``, the cost of starting a program under
  that isolation); mean, median and p90 in seconds, and the same for an empty sandbox (no
  snapshot) for reference;
* ``rollouts``: whole trajectories of the real lifecycle, ``create -> agent -> swe_tests in the
  sandbox -> destroy``, through the real AgentFlow router in front of a real embedded engine (a
  tiny random Qwen3: the model's words do not matter here). The agent is the scripted repair
  program of the tests (tests/data/scripted_repair_agent.py: an OpenAI-SDK program run by the
  ``command`` agent inside the sandbox, four model calls and three tool calls applying the
  reference fix), so every rollout does real work and should resolve its task. Reported:
  rollouts per minute at ``--concurrency`` trajectories at once, the resolved rate, and the mean
  per-phase times (sandbox create, agent, reward, teardown).

Prints one JSON object. Absolute times move with machine load; compare modes within one run.

    python benchmarks/sandbox.py [--tasks 37 --rollouts 16 --concurrency 4 --modes bwrap,netns,none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SWE = REPO / "configs" / "recipes" / "swe"
AGENT = REPO / "tests" / "data" / "scripted_repair_agent.py"
TOKENIZER = REPO / "tests" / "data" / "tokenizer"


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(ordered), 4), "p50": round(statistics.median(ordered), 4),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4), "n": len(ordered)}


def rows(limit: int) -> list[dict[str, Any]]:
    out = [json.loads(line) for line in (SWE / "tasks.jsonl").read_text().splitlines() if line.strip()]
    return out[:limit]


async def latency(provider: Any, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    create, destroy, command, empty_create, empty_destroy = [], [], [], [], []
    for i, row in enumerate(tasks):
        t0 = time.perf_counter()
        box = await provider.create(f"bench-{i}", {"prompt": "", "metadata": row})
        t1 = time.perf_counter()
        res = await box.exec("true")
        t2 = time.perf_counter()
        await provider.destroy(box)
        t3 = time.perf_counter()
        if res.exit_code != 0:
            raise RuntimeError(f"'true' failed in the sandbox: {res.stderr}")
        create.append(t1 - t0)
        command.append(t2 - t1)
        destroy.append(t3 - t2)
        t0 = time.perf_counter()
        box = await provider.create(f"bench-empty-{i}", None)
        t1 = time.perf_counter()
        await provider.destroy(box)
        empty_create.append(t1 - t0)
        empty_destroy.append(time.perf_counter() - t1)
    return {"create_s": summary(create), "teardown_s": summary(destroy), "command_s": summary(command),
            "empty_create_s": summary(empty_create), "empty_teardown_s": summary(empty_destroy)}


def start_engine() -> tuple[Any, str]:
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": str(TOKENIZER)},
                         "rollout": {"max_context_length": 2048}, "run": {"seed": 0}})
    engine = EmbeddedEngine(EngineContext(job=job, components=None))
    return engine, engine.start()


async def rollouts(host: Any, provider: Any, router: Any, tasks: list[dict[str, Any]], n: int,
                   concurrency: int) -> dict[str, Any]:
    from loongsage_core.agentflow import run_agent_trajectory
    from loongsage_core.config import DataConfig, JobConfig
    from loongsage_core.controller.rewards import SourceRewards, score_trajectory_async
    from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory, TrajectoryStatus

    source = DataConfig(name="swe", reward=["swe_tests"], sandbox="local")
    rewards = SourceRewards.bind(JobConfig(data=[source]), source, "data[0]", host)
    args = {"command": [provider.python, str(AGENT), "--mode", "fix"], "timeout_s": 300,
            "env": {"PYTHONPATH": sysconfig.get_paths()["purelib"]}}
    agent_ref = ComponentRef("agent", "command", args)
    slots = asyncio.Semaphore(concurrency)
    phases: dict[str, list[float]] = {"sandbox_create_s": [], "agent_s": [], "reward_s": [], "sandbox_teardown_s": []}

    async def one(i: int) -> Any:
        row = tasks[i % len(tasks)]
        meta = {k: v for k, v in row.items() if k != "problem_statement"}
        traj = Trajectory(id=f"bench-r{i}", prompt_id=row["instance_id"], group_id="g", prompt=row["problem_statement"],
                          metadata=meta)
        marks: dict[str, float] = {}

        async def score(t: Any, sandbox: Any) -> None:
            marks["agent_done"] = time.perf_counter()
            await score_trajectory_async(t, rewards, sandbox)
            marks["reward_done"] = time.perf_counter()

        async with slots:
            start = time.perf_counter()
            agent = host.bind(agent_ref, BuildContext(components=host))
            traj = await run_agent_trajectory(router, agent, provider, trajectory=traj, score=score,
                                              sampling={"max_new_tokens": 4, "seed": i}, timeout_s=600,
                                              max_context_length=2048)
        timing = traj.metadata.get("sandbox", {})
        if "agent_done" in marks:
            phases["agent_s"].append(marks["agent_done"] - start - timing.get("sandbox_create_s", 0.0))
            phases["reward_s"].append(marks["reward_done"] - marks["agent_done"])
        for key in ("sandbox_create_s", "sandbox_teardown_s"):
            if key in timing:
                phases[key].append(timing[key])
        return traj

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    completed = [t for t in done if t.status == TrajectoryStatus.COMPLETED]
    errors = sorted({str(t.error)[:200] for t in done if t.status != TrajectoryStatus.COMPLETED})
    return {"rollouts": n, "concurrency": concurrency, "wall_s": round(wall, 2),
            "rollouts_per_min": round(60 * n / wall, 2), "completed": len(completed),
            "resolved_rate": round(sum(t.score for t in completed) / n, 3),
            "phase_mean_s": {k: round(statistics.fmean(v), 4) for k, v in phases.items() if v},
            "errors": errors[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=37, help="tasks for the latency measurement")
    ap.add_argument("--modes", default="bwrap,netns,none", help="isolation modes to measure (those that work here)")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rollout-mode", default="auto", help="isolation of the rollout measurement")
    args = ap.parse_args()

    from loongsage_plugin_agents.local_sandbox import SandboxError
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import AgentFlowRouter
    from loongsage_core.errors import RunError
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import BuildContext, ComponentRef

    host = PluginHost.create(["agents", "rewards"])

    def factory(**sandbox_args: Any) -> Any:
        """The ``local`` sandbox provider with ``sandbox_args``, built as a run builds it."""
        return host.bind(ComponentRef("sandbox", "local", sandbox_args), BuildContext(components=host))
    tasks = rows(args.tasks)
    out: dict[str, Any] = {"tasks": len(tasks), "latency": {}}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            provider = factory(isolation=mode, base_dir=str(SWE), default_timeout_s=60)
        except (SandboxError, RunError) as exc:  # an isolation this machine lacks
            out["latency"][mode] = {"skipped": str(exc)}
            continue
        try:
            out["latency"][mode] = asyncio.run(latency(provider, tasks))
        finally:
            asyncio.run(provider.close())
    if args.rollouts > 0:
        engine, url = start_engine()
        router = AgentFlowRouter(AutoTokenizer.from_pretrained(str(TOKENIZER)), [url])
        router.start()
        provider = factory(isolation=args.rollout_mode, base_dir=str(SWE), default_timeout_s=120,
                           max_concurrent_sandboxes=args.concurrency)
        try:
            out["rollout_isolation"] = provider.isolation
            out["rollouts"] = asyncio.run(rollouts(host, provider, router, rows(37), args.rollouts, args.concurrency))
        finally:
            asyncio.run(provider.close())
            router.shutdown()
            engine.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
