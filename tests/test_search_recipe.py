"""The ``search`` recipe (configs/recipes/search): deep research over a local corpus.

* every question, one-hop and two-hop, of both splits is answered exactly by a scripted oracle
  that reads only the question and what the real ``search`` tool returns, and never from the
  question alone (no tool): the task needs the tools and they suffice;
* the recipe's job files validate by name and agree with each other (the held-out job is the
  training job on the held-out split; the ablation only lacks ``search``);
* the shipped warm-started policy, run through the real engine, router, ``tool_call_parser`` and
  ``tool_agent``, calls ``search`` on two-hop questions and its trajectories are token for token what ``loongsage sft``
  renders for the same conversation (the warm-start data and RL turns agree);
* two GRPO steps of ``search.toml`` run end to end on a local Ray cluster.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loongsage_plugin_agents.fictional_qa import fictional_qa_rows
from loongsage_plugin_agents.fictional_world import QUESTION_KINDS
from loongsage_plugin_agents.search_tools import search
from loongsage_plugin_rewards.rewards import exact_match, token_f1

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job
from loongsage_hookspecs import AgentContext, Trajectory

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "recipes" / "search"
SMALL_WORLD = {"people": 24, "cities": 10, "countries": 3, "heldout_people": 12, "heldout_cities": 6,
               "heldout_countries": 2}
SMALL = ("train.total_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
         "train.mini_batch_size=4", "train.micro_batch_size=2", "run.checkpoint_every=0", "run.save_hf_at_end=false",
         "eval.max_prompts=2", "eval.samples=2")


def ctx_for(metadata: dict) -> AgentContext:
    return AgentContext(trajectory_id="t", base_url="http://x", api_key="k", prompt="p", metadata=metadata)


def first_result(query: str, ctx: AgentContext) -> dict[str, str]:
    """The facts of the top search result, by the words before each value (``born in X`` -> born: X)."""
    text = search(query, ctx=ctx).splitlines()[0].split(": ", 1)[1].rstrip(".")
    facts = {}
    for part in text.replace(" of ", " in ").split(","):
        key, _, value = part.strip().rpartition(" in ")
        facts[key] = value
    return facts


def oracle(question: dict, ctx: AgentContext) -> tuple[str, int]:
    """Answer the way a perfect policy would, reading only the question and what ``search``
    returns: search the question's entity; for a two-hop question search the entity its document
    names; read the fact the question asks for. Returns ``(answer, search calls)``."""
    kind = question["metadata"]["kind"]
    pattern = re.escape(QUESTION_KINDS[kind][1]).replace(re.escape("{name}"), "(.+)")
    entity = re.fullmatch(pattern, question["prompt"]).group(1)
    facts, calls = first_result(entity, ctx), 1
    second_hop = {"founded_year": "founder", "founded_city": "founder", "born_country": "born",
                  "home_country": "lives"}
    if kind in second_hop:
        facts, calls = first_result(facts[second_hop[kind]], ctx), 2
    wanted = {"born_city": "born", "home_city": "lives", "founded_company": "founder", "company_year": "founded",
              "company_city": "A company based", "city_country": "A city", "founded_year": "founded",
              "founded_city": "A company based", "born_country": "A city", "home_country": "A city"}[kind]
    return facts[wanted], calls


def scored(row: dict, response: str) -> Trajectory:
    return Trajectory(id="t", prompt_id="p", group_id="g", prompt=row["prompt"], label=row["label"],
                      response_text=response)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_question_is_solvable_with_search_and_not_without(split):
    rows = fictional_qa_rows(world=SMALL_WORLD, split=split)
    assert {r["metadata"]["hops"] for r in rows} == {1, 2}
    for row in rows:
        answer, calls = oracle(row, ctx_for(row["metadata"]))
        assert exact_match(scored(row, answer)).score == 1.0 and token_f1(scored(row, answer)).score == 1.0, row
        assert calls == row["metadata"]["hops"]
        # without tools: no word of the question, nor its entity, is the answer
        entity = row["metadata"]["path"][0]
        for guess in [*row["prompt"].rstrip("?").split(), entity, row["prompt"]]:
            assert exact_match(scored(row, guess)).score == 0.0


def test_the_recipe_files_validate_and_agree():
    for name in ("recipes/search", "recipes/search/heldout", "recipes/search/ablation_no_search",
                 "recipes/search/warm_start"):
        out = subprocess.run([sys.executable, "-m", "loongsage_core", "validate", name], capture_output=True,
                             text=True, cwd=REPO)
        assert out.returncode == 0 and f"{name}: OK" in out.stdout, f"{name}: {out.stderr or out.stdout}"
    train, heldout = load_job(RECIPE / "search.toml"), load_job(RECIPE / "heldout.toml")
    ablation = load_job(RECIPE / "ablation_no_search.toml")
    search_tools = ["loongsage_plugin_agents.search_tools:search", "loongsage_plugin_agents.search_tools:open"]
    assert [d.generator_args for d in train.data] == [{"split": "train", "hops": [1], "top_k": 2},
                                                      {"split": "train", "hops": [2], "top_k": 2}]
    [held] = heldout.data
    assert held.generator == "fictional_qa" and held.generator_args == {"split": "heldout", "top_k": 2}
    for src in (*train.data, held):
        assert src.agent == "tool_agent" and src.agent_args["tools"] == search_tools and src.reward == ["exact_match"]
    for src in ablation.data:
        assert src.agent_args["tools"] == search_tools[1:]
    for other in (heldout, ablation):  # the same model, sampling, router and algorithm
        assert other.model == train.model and other.rollout == train.rollout and other.agentflow == train.agentflow
        assert other.algorithm == train.algorithm
    assert ablation.train == train.train and [d.generator_args for d in ablation.data] == [
        d.generator_args for d in train.data]
    sft = load_job(RECIPE / "warm_start.toml")
    assert sft.sft is not None and sft.sft.tools_key == "tools"
    assert sft.data[0].generator == "fictional_qa_sft" and sft.data[0].generator_args["split"] == "train"
    assert sft.data[0].generator_args["top_k"] == 2  # the transcripts see the search results RL sees
    # other worlds (names to copy, not to memorise), none of whose transcripts names a held-out entity
    assert sft.data[0].generator_args["worlds"] > 1 and sft.data[0].generator_args["world"]["seed"] != 0
    assert sft.data[0].generator_args["heldout_of"] == {"seed": 0}  # search.toml's world: the default one


@pytest.fixture(scope="module")
def served_policy(slow_fixture):
    """The shipped policy behind the real embedded engine and AgentFlow router with the recipe's middleware."""
    from loongsage_plugin_agents.tool_parser import ToolCallParser
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import AgentFlowRouter
    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    engine = EmbeddedEngine(EngineContext(job=structure_job({"model": {"path": str(RECIPE / "model")},
                                                             "rollout": {"max_context_length": 1024}}),
                                          components=None))
    url = engine.start()
    tokenizer = AutoTokenizer.from_pretrained(str(RECIPE / "model"))
    router = AgentFlowRouter(tokenizer, [url], [ToolCallParser(format="hermes")], max_context_length=1024)
    router.start()
    yield router
    router.shutdown()
    engine.shutdown()


def test_the_policy_searches_and_sft_renders_its_trajectories_token_for_token(served_policy):
    import asyncio

    from loongsage_core.agentflow import run_agent_trajectory
    from loongsage_core.plugins import PluginHost
    from loongsage_core.sft.render import render_conversation
    from loongsage_hookspecs import BuildContext, ComponentRef

    router = served_policy
    job = load_job(RECIPE / "heldout.toml")
    src = job.data[0]
    host = PluginHost.create(["agents"])
    # two-hop questions: the warm start searches at least once on them (on one-hop ones it mostly
    # answers without searching, the error RL is there to fix)
    rows = fictional_qa_rows(split="heldout", hops=[2], top_k=2, num_samples=4)
    trajectories = []
    for i, row in enumerate(rows):
        traj = Trajectory(id=f"search-{i}", prompt_id=str(i), group_id=str(i), prompt=row["prompt"],
                          label=row["label"], metadata=row["metadata"])
        agent = host.bind(ComponentRef("agent", "tool_agent", src.agent_args), BuildContext(components=host))
        trajectories.append(asyncio.run(run_agent_trajectory(
            router, agent, None, trajectory=traj, timeout_s=240,
            sampling={"temperature": 0.0, "max_new_tokens": 48})))
    tools = None
    canonical = 0
    for traj in trajectories:
        assert traj.status.value == "completed", traj.error
        agent = traj.metadata["agentflow"]["agent"]
        assert agent["tool_calls"] >= 1  # the warm start searches before it answers
        calls = [c for m in traj.messages for c in m.get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "search"
        assert any(m["role"] == "tool" for m in traj.messages)  # the tool ran and its output went back
        # the router's record is one segment, and it is exactly what SFT makes of the conversation
        [segment] = traj.segments
        if tools is None:
            from loongsage_plugin_agents.python_tools import function_schema, load_function
            tools = [function_schema(load_function(p)) for p in src.agent_args["tools"]]
        [example] = render_conversation(router.renderer, traj.messages, tools)
        decode = router.renderer.decode
        assert decode(example.tokens) == decode(segment.tokens)
        assert [decode([t for t, m in zip(x.tokens, x.loss_mask) if m]) for x in (example, segment)] == [
            decode([t for t, m in zip(segment.tokens, segment.loss_mask) if m])] * 2
        # SFT tokenizes the model's text afresh; where the model wrote the canonical tokens of its
        # text (as a model trained on that data does), the whole record is the same tokens
        turns = [segment.tokens[start:end] for start, end in segment.turns]
        if all(router.renderer.encode(decode(t)) == t for t in turns):
            canonical += 1
            assert example.tokens == segment.tokens and example.loss_mask == segment.loss_mask
    assert canonical >= 2, "the policy wrote non-canonical tokens in most turns"


def test_search_recipe_runs_two_steps(ray_cluster, tmp_path):
    out = tmp_path / "search"
    history = run_job(resolve_job(load_job(RECIPE / "search.toml", SMALL)), output_dir=str(out))
    steps, final_eval = history[:-1], history[-1]
    assert len(steps) == 2
    for m in steps:  # a step trains, or no group had a signal in any of its 1 + max_filter_retries rounds
        assert "train/loss" in m or (m["rollout/num_trajectories"] == 20.0
                                     and m["rollout/reward_max"] == m["rollout/reward_min"])
    # [eval] runs at step 0 (in the first row) and after the last step (a row of its own)
    assert "eval/heldout_one_hop/pass@1" in steps[0] and "eval/heldout_two_hop/pass@1" in final_eval
    assert "rollout/num_trajectories" not in final_eval
    for m in steps:
        # dynamic sampling draws 2 prompts, then as many as it dropped, 1 + max_filter_retries rounds at most
        rounds, kept = m["rollout/filter_attempts"], m["rollout/groups_trained"]
        assert 1 <= rounds <= 5 and 0 <= kept <= 2
        assert 4 <= m["rollout/num_trajectories"] <= 4 + 2 * 2 * (rounds - 1) and m["rollout/num_trajectories"] % 2 == 0
        assert m["rollout/agent_failed_ratio"] == 0.0
        assert m["rollout/tool_calls_mean"] > 0.0 and m["rollout/turns_mean"] > 1.0  # it calls tools, over turns
        assert "rollout_per_source/one_hop/reward_mean" in m or "rollout_per_source/two_hop/reward_mean" in m
    records = [json.loads(line) for line in gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt")]
    assert {r["metadata"]["corpus"]["split"] for r in records if r["eval"]} == {"heldout"}  # step 0's [eval]
    records = [r for r in records if not r["eval"]]
    assert records and len(records) % 2 == 0
    for r in records:
        assert r["metadata"]["corpus"]["split"] == "train"
    calls = [c for r in records for c in r["tool_calls"]]
    assert calls and {c["name"] for c in calls} <= {"search", "open"}
    assert all(c["output"] is not None for c in calls)  # every call ran and its output went back
