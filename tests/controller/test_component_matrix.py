"""Every function-style component that ``loongsage plugins --json`` lists, in two real training
steps of the controller (tiny model, real trainer, real rewards; fake engines, no Ray), with an
assertion that it changed what it should.

Runs are deterministic: the same prompts, the same answers (a responder per data source that
answers even samples correctly and odd ones wrongly, wrong answers longer), the same initial
weights. So a component's effect shows as a difference from the baseline run (``grpo``,
``ppo_clip``, ``token_mean``, ``exact_match``, nothing else) on the same steps.

A component added to a plugin later without an entry in :data:`MATRIX` fails
:func:`test_every_listed_component_has_a_matrix_entry`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext

FUNCTION_KINDS = ("advantage", "policy_loss", "kl", "loss_aggregation", "correction", "filter", "reward")

GEN = {"arithmetic": {"num_samples": 32},
       "countdown": {"num_samples": 32},
       "reasoning_gym": {"dataset": "basic_arithmetic", "num_samples": 32}}


@cache
def rows_by_prompt(generator: str) -> dict[str, dict[str, Any]]:
    host = PluginHost.create()
    args = {"seed": 3, **GEN[generator]}  # the controller adds [run] seed (3 in these tests)
    return {r["prompt"]: r for r in host.get("data_source", generator).factory(BuildContext(), **args)}


def right_answer(generator: str, row: dict[str, Any], style: str) -> str:
    if generator == "countdown":
        return f"\\boxed{{{row['metadata']['solution']}}}"
    if generator == "reasoning_gym":
        return f"<answer>{row['label']}</answer>"
    return f"\\boxed{{{row['label']}}}" if style == "boxed" else f"The answer is {row['label']}"


def responder_for(generator: str = "arithmetic", style: str = "plain", finish: Callable[[int], str] | None = None,
                  all_wrong: Callable[[dict[str, Any]], bool] | None = None) -> Callable[[str, int], tuple[str, str]]:
    """Even samples right, odd ones wrong (and longer: `` ok`` per sample index)."""
    table = rows_by_prompt(generator)

    def respond(prompt_text: str, sample: int) -> tuple[str, str]:
        row = next(r for p, r in table.items() if p in prompt_text)
        wrong = sample % 2 == 1 or (all_wrong is not None and all_wrong(row))
        if wrong:
            text = ("\\boxed{1 + 1}" if generator == "countdown" else
                    "<answer>-1</answer>" if generator == "reasoning_gym" else
                    "\\boxed{-1}" if style == "boxed" else "The answer is -1") + " ok" * sample
        else:
            text = right_answer(generator, row, style)
        return text, finish(sample) if finish else "stop"

    return respond


@attrs.define
class Entry:
    """One matrix run: job overrides, the responder, and the check of its step metrics against
    the baseline's (``check(metrics, baseline, controller)``)."""

    overrides: dict[str, Any]
    check: Callable[[list[dict[str, float]], list[dict[str, float]], Any], None]
    responder: Callable[[str, int], tuple[str, str]] | None = None


def differs(key: str, rel: float = 1e-4) -> Callable[..., None]:
    """Some step's ``key`` differs from the baseline's (the component changed the update)."""
    def check(ms: list[dict[str, float]], base: list[dict[str, float]], _: Any) -> None:
        assert any(abs(m[key] - b[key]) > rel * max(abs(b[key]), 1e-8) for m, b in zip(ms, base)), \
            f"{key}: {[m[key] for m in ms]} == baseline {[b[key] for b in base]}"
    return check


def both(*checks: Callable[..., None]) -> Callable[..., None]:
    def check(ms: list[dict[str, float]], base: list[dict[str, float]], c: Any) -> None:
        for fn in checks:
            fn(ms, base, c)
    return check


def metric(key: str, test: Callable[[float], bool], step: int | None = None) -> Callable[..., None]:
    def check(ms: list[dict[str, float]], _base: list[dict[str, float]], _c: Any) -> None:
        for i, m in enumerate(ms):
            if step is None or i == step:
                assert key in m and test(m[key]), f"step {i}: {key} = {m.get(key)}"
    return check


def alg(**table: Any) -> dict[str, Any]:
    return {"algorithm": table}


def source(generator: str = "arithmetic", reward: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"data": [{"name": "src", "generator": generator, "generator_args": GEN[generator],
                      "reward": reward or ["exact_match"], **extra}]}


TEACHER = {"teachers": [{"name": "t", "backend": "torch",
                         "args": {"seed": 99, "config": {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32,
                                                         "intermediate_size": 64, "num_hidden_layers": 1,
                                                         "num_attention_heads": 2, "num_key_value_heads": 1,
                                                         "head_dim": 16, "max_position_embeddings": 512,
                                                         "tie_word_embeddings": True}}}],
           **source(teacher="t")}


def distill(name: str, **args: Any) -> Entry:
    """A distillation term in the loss, fed by a teacher with other weights than the student."""
    return Entry({**TEACHER, **alg(distill_kl=name, distill_kl_args=args, distill_coef=0.5, distill_topk=4)},
                 both(metric("train/distill_loss", lambda v: v != 0.0), differs("train/grad_norm")))


def grouped_abs(value: float) -> Callable[..., None]:
    """Two right and two wrong answers per group: every advantage has the magnitude ``value``."""
    return metric("train/adv_abs_mean", lambda v: v == pytest.approx(value, rel=1e-4))


def status_check(ms: list[dict[str, float]], base: list[dict[str, float]], c: Any) -> None:
    groups, _, _ = c.collect(2)
    assert groups and all(len(g.trajectories) == 3 and all(t.status.value == "completed" for t in g.trajectories)
                          for g in groups)
    assert all(m["rollout/aborted_ratio"] == 0.25 for m in ms)


def token_mean_check(ms: list[dict[str, float]], base: list[dict[str, float]], c: Any) -> None:
    """The baseline's own aggregation: the same update, over the trained-token count of each mini-batch."""
    for m, b in zip(ms, base):
        assert m["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    assert all(n.num_tokens > 2 * n.num_sequences for n in c.trainer.norms)


ABORT_LAST = responder_for(finish=lambda s: "abort" if s == 3 else "stop")

REPO = Path(__file__).resolve().parents[2]
SWE = REPO / "configs" / "recipes" / "swe"
CODE_TASKS = REPO / "tests" / "data" / "code_tasks.jsonl"


@cache
def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def swe_responder(prompt_text: str, sample: int) -> tuple[str, str]:
    """The tool agent's model: even samples apply the task's reference patch with one ``bash`` tool
    call (then say they are done), odd samples change nothing."""
    if "<tool_response>" in prompt_text or sample % 2 == 1:
        return "Done.", "stop"
    row = next(r for r in jsonl_rows(SWE / "tasks.jsonl") if r["problem_statement"] in prompt_text)
    call = {"name": "bash", "arguments": {"command": f"git apply <<'EOF'\n{row['patch']}EOF"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>", "stop"


def verifiers_responder(prompt_text: str, sample: int) -> tuple[str, str]:
    """vf_arithmetic's questions (``What is 3 - 5?``): even samples answer right, odd ones wrong."""
    import re

    a, op, b = re.findall(r"What is (\d) ([+-]) (\d)\?", prompt_text)[-1]
    value = int(a) + int(b) if op == "+" else int(a) - int(b)
    return (str(value) if sample % 2 == 0 else f"{value + 1}" + " ok" * sample), "stop"


def code_responder(prompt_text: str, sample: int) -> tuple[str, str]:
    """Even samples answer with the row's solution in a code block, odd ones with a wrong function."""
    row = next(r for r in jsonl_rows(CODE_TASKS) if r["prompt"] in prompt_text)
    code = row["solution"] if sample % 2 == 0 else f"def {row['entry_point']}(*args):\n    return None\n"
    return f"```python\n{code}```", "stop"


SANDBOXED = {"rollout": {"max_context_length": 8192, "max_new_tokens": 512}}
SWE_SOURCE = {**SANDBOXED, "agentflow": {"middleware": ["tool_call_parser"]},
              "data": [{"name": "src", "path": str(SWE / "tasks.jsonl"), "prompt_key": "problem_statement",
                        "agent": "tool_agent", "agent_args": {"max_turns": 2}, "sandbox": "local",
                        "sandbox_args": {"base_dir": str(SWE)}, "reward": ["swe_tests"]}]}
# a verifiers environment's episodes (its harness program, interception and rubric) through the router
VERIFIERS_SOURCE = {"plugins": {"enable": ["torch", "rl", "rewards", "agents", "verifiers"]},
                    "data": [{"name": "src", "generator": "verifiers",
                              "generator_args": {"env": "vf_arithmetic", "num_samples": 32},
                              "agent": "verifiers", "reward": ["verifiers"]}]}
# the Tinker-compatible service's losses, as any job can name them
TINKER = {"plugins": {"enable": ["torch", "rl", "rewards", "agents", "tinker"]}}
CODE_SOURCE = {**SANDBOXED, "data": [{"name": "src", "path": str(CODE_TASKS), "sandbox": "local",
                                      "reward": ["code_tests"]}]}

MATRIX: dict[tuple[str, str], Entry] = {
    # advantage estimators: the exact group-relative values, or a difference from grpo's
    ("advantage", "grpo"): Entry(alg(advantage="grpo"), grouped_abs(0.5 / (1 / 3) ** 0.5)),
    ("advantage", "dr_grpo"): Entry(alg(advantage="dr_grpo"), grouped_abs(0.5)),
    ("advantage", "rloo"): Entry(alg(advantage="rloo"), grouped_abs(0.5 * 4 / 3)),
    ("advantage", "reinforce_pp"): Entry(alg(advantage="reinforce_pp"), both(
        metric("train/adv_mean", lambda v: abs(v) < 1e-4), differs("train/adv_abs_mean"))),
    ("advantage", "reinforce_pp_baseline"): Entry(alg(advantage="reinforce_pp_baseline"), both(
        metric("train/adv_mean", lambda v: abs(v) < 1e-4), differs("train/adv_abs_mean"))),
    ("advantage", "gae"): Entry(alg(advantage="gae"), both(
        metric("train/critic_num_mini_batches", lambda v: v == 2.0), metric("train/critic_loss", lambda v: v > 0),
        differs("train/adv_abs_mean"))),
    # policy losses (tight clipping so the second mini-batch of a step clips)
    ("policy_loss", "ppo_clip"): Entry(alg(policy_loss="ppo_clip", policy_loss_args={"clip_low": 1e-4,
                                                                                      "clip_high": 1e-4}),
                                       both(metric("train/clip_ratio", lambda v: v > 0, step=1),
                                            differs("train/grad_norm"))),
    ("policy_loss", "gspo"): Entry(alg(policy_loss="gspo", policy_loss_args={"clip_low": 1e-5, "clip_high": 1e-5}),
                                   differs("train/grad_norm")),
    ("policy_loss", "cispo"): Entry(alg(policy_loss="cispo"), differs("train/pg_loss")),
    ("policy_loss", "reinforce"): Entry(alg(policy_loss="reinforce"), differs("train/pg_loss")),
    ("policy_loss", "tinker_cross_entropy"): Entry({**TINKER, **alg(policy_loss="tinker_cross_entropy")},
                                                   differs("train/pg_loss")),
    ("policy_loss", "tinker_importance_sampling"): Entry({**TINKER, **alg(policy_loss="tinker_importance_sampling")},
                                                         differs("train/pg_loss")),
    ("policy_loss", "tinker_ppo"): Entry({**TINKER, **alg(policy_loss="tinker_ppo", policy_loss_args={
        "clip_low_threshold": 1 - 1e-4, "clip_high_threshold": 1 + 1e-4})}, differs("train/grad_norm")),
    # KL to the reference model, in the loss (the policy leaves the reference after step 0)
    **{("kl", name): Entry(alg(kl=name, kl_coef=0.5), both(
        metric("train/kl", lambda v: v != 0.0, step=1), differs("train/grad_norm")))
       for name in ("k1", "k2", "k3", "low_var_kl")},
    # distillation terms, fed by a teacher
    # opd_pg is detached (a PG-style signal): it goes into the token rewards and moves the advantages
    ("kl", "opd_pg"): Entry({**TEACHER, **alg(distill_kl="opd_pg", distill_in_reward=True, distill_coef=0.5)},
                            both(metric("train/reward_distill", lambda v: v != 0.0), differs("train/adv_abs_mean"))),
    ("kl", "opd_k2"): distill("opd_k2"),
    ("kl", "opd_k3"): distill("opd_k3"),
    ("kl", "opd_topk_kl"): distill("opd_topk_kl", k=4),
    ("kl", "opd_full_kl"): distill("opd_full_kl"),
    ("kl", "opd_jsd"): distill("opd_jsd", beta=0.5),
    ("kl", "opd_mix"): distill("opd_mix"),
    ("kl", "opd_mix_topk"): distill("opd_mix_topk"),
    ("kl", "opd_mix_logits"): distill("opd_mix_logits"),
    # loss aggregation: the same per-token losses, other denominators
    ("loss_aggregation", "token_mean"): Entry(alg(loss_agg="token_mean"), token_mean_check),
    ("loss_aggregation", "seq_mean_token_sum"): Entry(alg(loss_agg="seq_mean_token_sum"), differs("train/grad_norm")),
    ("loss_aggregation", "tinker_sum"): Entry({**TINKER, **alg(loss_agg="tinker_sum")}, differs("train/grad_norm")),
    ("loss_aggregation", "seq_mean_token_mean"): Entry(alg(loss_agg="seq_mean_token_mean"),
                                                       differs("train/grad_norm")),
    ("loss_aggregation", "seq_mean_token_sum_norm"): Entry(alg(loss_agg="seq_mean_token_sum_norm"),
                                                           differs("train/grad_norm")),
    # corrections (the fake engine's log-probs are off by up to +-0.2 from the trainer's)
    ("correction", "tis"): Entry(alg(corrections=["tis"], correction_args={"tis": {"upper": 1.05}}), both(
        metric("train/is_weight_mean", lambda v: 0.5 < v < 1.05), differs("train/grad_norm"))),
    ("correction", "m2po"): Entry(alg(corrections=["m2po"], correction_args={"m2po": {"tau": 0.002}}), both(
        metric("train/correction_kept_ratio", lambda v: 0.0 < v < 1.0), differs("train/grad_norm"))),
    ("correction", "opsm"): Entry(alg(corrections=["opsm"], correction_args={"opsm": {"delta": 1e-4}}),
                                  differs("train/grad_norm")),
    # filters
    ("filter", "dynamic_sampling"): Entry(
        alg(filters=["dynamic_sampling"], max_filter_retries=8),
        both(metric("rollout/filter_drop", lambda v: v >= 1), metric("rollout/groups_trained", lambda v: v == 2)),
        responder_for(all_wrong=lambda row: int(row["label"]) % 2 == 0)),
    ("filter", "overlong"): Entry(alg(filters=["overlong"]), both(
        metric("rollout/num_rows", lambda v: v == 6.0), metric("rollout/truncated_ratio", lambda v: v == 0.25)),
        responder_for(finish=lambda s: "length" if s == 3 else "stop")),
    ("filter", "status"): Entry(alg(filters=["status"]), status_check, ABORT_LAST),
    # rewards: two right and two wrong answers per group score a mean of 0.5
    ("reward", "exact_match"): Entry(source(reward=["exact_match"]), metric("rollout/reward_mean", lambda v: v == 0.5)),
    ("reward", "token_f1"): Entry(source(reward=["token_f1"]), both(
        metric("rollout/reward_mean", lambda v: v == 0.5),
        metric("rollout_per_source/src/reward/token_f1/exact", lambda v: v == 0.5))),
    ("reward", "numeric_match"): Entry(source(reward=["numeric_match"]),
                                       metric("rollout/reward_mean", lambda v: v == 0.5)),
    ("reward", "format"): Entry(
        source(reward=["format"], reward_args={"format": {"pattern": r"The answer is -?\d+", "mode": "fullmatch"}}),
        metric("rollout/reward_mean", lambda v: v == 0.5)),  # the long wrong answers do not match
    ("reward", "math_verify"): Entry(source(reward=["math_verify"]), metric("rollout/reward_mean", lambda v: v == 0.5),
                                     responder_for(style="boxed")),
    ("reward", "countdown"): Entry(source("countdown", reward=["countdown"]),
                                   metric("rollout/reward_mean", lambda v: v == 0.5), responder_for("countdown")),
    ("reward", "reasoning_gym"): Entry(source("reasoning_gym", reward=["reasoning_gym"]),
                                       both(metric("rollout/reward_mean", lambda v: 0.5 <= v < 1.0),
                                            metric("rollout/reward_max", lambda v: v == 1.0)),
                                       responder_for("reasoning_gym")),
    # rewards that run tests in the trajectory's sandbox, before it is destroyed
    ("reward", "swe_tests"): Entry(SWE_SOURCE, both(
        metric("rollout/reward_mean", lambda v: v == 0.5), metric("rollout/tool_calls_mean", lambda v: v == 0.5),
        metric("rollout_per_source/src/reward/swe_tests/p2p_passed", lambda v: v == 1.0)), swe_responder),
    ("reward", "code_tests"): Entry(CODE_SOURCE, metric("rollout/reward_mean", lambda v: v == 0.5), code_responder),
    ("reward", "verifiers"): Entry(VERIFIERS_SOURCE, both(
        metric("rollout/reward_mean", lambda v: v == 0.5),
        metric("rollout_per_source/src/reward/verifiers/correct", lambda v: v == 0.5),
        metric("rollout_per_source/src/reward/verifiers/answered", lambda v: v == 1.0)), verifiers_responder),
    ("reward", "overlong_penalty"): Entry(
        source(reward=["exact_match", "overlong_penalty"],
               reward_args={"overlong_penalty": {"max_len": 8, "cache_len": 4}}),
        both(metric("rollout/reward_min", lambda v: v < 0.0), differs("train/adv_abs_mean"))),
}

BASE = {"train": {"lr": 1e-2, "mini_batch_size": 4, "micro_batch_size": 4}, "rollout": {"max_context_length": 512}}


def run_entry(controller_factory: Any, entry: Entry) -> tuple[list[dict[str, float]], Any]:
    overrides = {**BASE, **source(), **entry.overrides}
    c = controller_factory(overrides, responder=entry.responder or responder_for())
    return [c.run_step(0), c.run_step(1)], c


_BASELINE: list[list[dict[str, float]]] = []


def baseline(controller_factory: Any) -> list[dict[str, float]]:
    """The two steps of the baseline run (computed once per session)."""
    if not _BASELINE:
        c = controller_factory({**BASE, **source()}, responder=responder_for())
        _BASELINE.append([c.run_step(0), c.run_step(1)])
    return _BASELINE[0]


def listed_components() -> list[tuple[str, str]]:
    """``(kind, name)`` of every function-style component the installed plugins list (what
    ``loongsage plugins --json`` prints)."""
    listing = PluginHost.create().describe()
    return sorted({(kind, name) for plugin in listing["plugins"] for kind, names in plugin["components"].items()
                   if kind in FUNCTION_KINDS for name in names})


def test_every_listed_component_has_a_matrix_entry():
    missing = [f"{kind}:{name}" for kind, name in listed_components() if (kind, name) not in MATRIX]
    assert not missing, f"components without an entry in the component matrix: {missing}"
    assert len(MATRIX) >= 40


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(MATRIX), ids=lambda k: f"{k[0]}-{k[1]}")
def test_component_in_two_training_steps(controller_factory, key):
    base = baseline(controller_factory)
    entry = MATRIX[key]
    metrics, c = run_entry(controller_factory, entry)
    assert len(metrics) == 2 and c.run.version == 2
    entry.check(metrics, base, c)
