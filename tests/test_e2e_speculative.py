"""A real run (controller -> embedded engine -> trainer) with speculative decoding on: the engine
drafts by prompt lookup, the controller logs the acceptance metrics, and the trainer's log-probs
still agree with the engine's (``train/is_approx_k3_kl`` at the fp32 level of a plain run).

The tiny random model decodes greedily here (greedy-equivalent settings: a random model sampled
at temperature 1 spreads its mass so thin that no draft is ever accepted); greedy, it falls into
loops that prompt lookup drafts, so most forwards emit several tokens. The trainer scores the
tokens at temperature 1 as always, so the gap still compares the engine's reported log-probs
with a plain forward's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

from .conftest import TINY_JOB, TOKENIZER_DIR

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = 'num_threads = 1, speculative = { method = "prompt_lookup", num_draft = 4, ngram = 1 }'


def speculative_job(tmp_path: Path, engine_args: str = ENGINE_ARGS) -> tuple[Path, list[str]]:
    """The tiny embedded job, greedy and colocated, with ``engine_args`` (speculation on)."""
    path = tmp_path / "job.toml"
    path.write_text(TINY_JOB.format(tokenizer=TOKENIZER_DIR))
    return path, ["train.total_steps=2", "train.mini_batch_size=16", "train.micro_batch_size=8",
                  "rollout.prompts_per_step=4", "rollout.max_new_tokens=24", "rollout.temperature=0.0",
                  "rollout.weight_transport=inprocess", "placement.colocate=true", "run.checkpoint_every=0",
                  f"rollout.engine_args={{ {engine_args} }}"]


def test_speculative_run_logs_acceptance_and_keeps_the_train_inference_gap(ray_cluster, tmp_path):
    path, overrides = speculative_job(tmp_path)
    out = tmp_path / "run"
    run_job(resolve_job(load_job(path, overrides)), output_dir=str(out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/is_approx_k3_kl" in m]
    assert len(steps) == 2
    for m in steps:
        # drafts were made and some accepted: more than one token per decode forward
        assert 0.2 < m["rollout/spec_acceptance_rate"] <= 1.0
        assert m["rollout/spec_tokens_per_forward"] > 1.5
        # the engine reports the policy's log-probs of what it emitted, as without speculation (fp32)
        assert m["train/is_approx_k3_kl"] < 1e-6


def test_agent_turns_through_the_router_record_the_engine_counters(slow_fixture):
    """An agent's turns through the real AgentFlow router on a speculative embedded engine: the
    trajectory carries the summed counters that rollout/spec_* are computed from."""
    import asyncio

    from loongsage_plugin_torch.engine import create_engine
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import AgentFlowRouter, run_agent_trajectory
    from loongsage_core.config import structure_job
    from loongsage_core.controller.metrics import rollout_metrics
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import (
        BuildContext,
        ComponentRef,
        EngineContext,
        Trajectory,
        TrajectoryGroup,
        TrajectoryStatus,
    )

    model = str(REPO / "configs" / "quickstart" / "model")
    job = structure_job({"model": {"path": model}, "rollout": {"max_context_length": 512, "engine_args": {
        "num_threads": 1, "speculative": {"num_draft": 4, "ngram": 1}}}})
    engine = create_engine(EngineContext(job=job, components=None))
    router = AgentFlowRouter(AutoTokenizer.from_pretrained(model), [engine.start()], [], max_context_length=512)
    router.start()
    try:
        agent = PluginHost.create(["agents"]).bind(ComponentRef("agent", "single_turn", {}),
                                                   BuildContext(components=None))
        traj = asyncio.run(run_agent_trajectory(
            router, agent, None, trajectory=Trajectory(id="t0", prompt_id="p0", group_id="g0",
                                                       prompt="What is 3 + 4? What is 3 + 4?"),
            sampling={"temperature": 0.0, "max_new_tokens": 12}, timeout_s=60))
    finally:
        router.shutdown()
        engine.shutdown()
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    counts = traj.metadata["speculative"]
    generated = sum(len([m for m in s.loss_mask if m]) for s in traj.segments)
    assert counts["emitted_tokens"] == generated - 1  # every token but the prefill's came from a decode forward
    assert 1 <= counts["verify_forwards"] <= counts["emitted_tokens"]
    metrics = rollout_metrics([TrajectoryGroup(group_id="g0", prompt_id="p0", trajectories=[traj])])
    assert metrics["rollout/spec_tokens_per_forward"] == counts["emitted_tokens"] / counts["verify_forwards"]


def test_a_misspelt_engine_argument_is_a_validation_error(tmp_path):
    from loongsage_core.config import ConfigError

    path, overrides = speculative_job(tmp_path, ENGINE_ARGS.replace("num_draft = 4", "num_drafts = 4"))
    with pytest.raises(ConfigError, match=r"rollout.engine = 'torch': \[rollout\] engine_args.speculative: "
                                          r"unknown key 'num_drafts'"):
        resolve_job(load_job(path, overrides))
    path, overrides = speculative_job(tmp_path, ENGINE_ARGS.replace("num_threads = 1", "num_thread = 1"))
    with pytest.raises(ConfigError, match="unknown key 'num_thread' for the torch engine"):
        resolve_job(load_job(path, overrides))


def test_speculation_metrics_from_engine_answers():
    """The counters read from ``meta_info`` (the embedded engine's four, or SGLang's
    ``spec_verify_ct`` alone) and the rollout metrics made of them."""
    from loongsage_core.controller.metrics import speculation_metrics
    from loongsage_core.engine_results import speculation_counts
    from loongsage_hookspecs import Trajectory

    ours = speculation_counts({"spec_verify_ct": 5, "spec_draft_tokens": 8, "spec_accepted_tokens": 6,
                               "spec_emitted_tokens": 11, "completion_tokens": 12})
    assert ours == {"verify_forwards": 5, "draft_tokens": 8, "accepted_tokens": 6, "emitted_tokens": 11}
    sglang = speculation_counts({"spec_verify_ct": 3, "completion_tokens": 9})
    assert sglang == {"verify_forwards": 3, "draft_tokens": 0, "accepted_tokens": 0, "emitted_tokens": 9}
    assert speculation_counts({"completion_tokens": 9}) is None

    def traj(counts):
        return Trajectory(id="t", prompt_id="p", group_id="g", metadata={"speculative": counts})

    assert speculation_metrics([traj(ours), traj(ours)]) == {"rollout/spec_tokens_per_forward": 11 / 5,
                                                             "rollout/spec_acceptance_rate": 6 / 8}
    assert speculation_metrics([traj(sglang)]) == {"rollout/spec_tokens_per_forward": 3.0}  # no drafts: no rate
    assert speculation_metrics([Trajectory(id="t", prompt_id="p", group_id="g")]) == {}
