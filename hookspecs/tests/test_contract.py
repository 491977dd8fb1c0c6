"""The contract package on its own: records, specs and the kinds table (pluggy + attrs + torch for Batch)."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pluggy
import pytest

from loongsage_hookspecs import (
    KINDS,
    PROJECT_NAME,
    AdvantageSpec,
    Batch,
    KLSpec,
    SamplingParams,
    Segment,
    Trajectory,
    TrajectoryGroup,
    hookspecs,
    normalize_name,
)


def test_every_kind_has_a_hook_and_a_spec_class():
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for kind in KINDS.values():
        assert hasattr(pm.hook, kind.hook), kind.hook
        assert kind.spec.__name__.endswith("Spec")
    assert len({k.hook for k in KINDS.values()}) == len(KINDS)


def test_names_are_normalised_and_validated():
    assert normalize_name(" Dr-GRPO ") == "dr_grpo"
    spec = AdvantageSpec(name="My-Adv", fn=len)
    assert spec.name == "my_adv"
    with pytest.raises(ValueError, match="non-empty"):
        AdvantageSpec(name="  ", fn=len)
    with pytest.raises(ValueError):
        KLSpec(name="x", fn=len, requires="everything")


def test_segment_keeps_fields_aligned():
    seg = Segment()
    seg.append([1, 2, 3], generated=False)
    seg.append([7, 8], generated=True, logprobs=[-0.5, -0.25], weight_version=3)
    assert seg.tokens == [1, 2, 3, 7, 8]
    assert seg.loss_mask == [0, 0, 0, 1, 1]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert seg.weight_versions == [-1, -1, -1, 3, 3]
    assert seg.turns == [(3, 5)] and seg.num_generated == 2 and seg.trainable
    with pytest.raises(ValueError, match="one logprob each"):
        seg.append([9], generated=True, logprobs=[])
    with pytest.raises(ValueError, match="equal lengths"):
        Segment(tokens=[1], loss_mask=[], logprobs=[], weight_versions=[])


def test_trajectory_group_scores_and_lengths():
    from loongsage_hookspecs import Reward

    seg = Segment()
    seg.append([5, 6], generated=True, logprobs=[0.0, 0.0], weight_version=0)
    t1 = Trajectory(id="a", prompt_id="p", group_id="g", segments=[seg], reward=Reward(score=1.0))
    t2 = Trajectory(id="b", prompt_id="p", group_id="g")
    group = TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[t1, t2])
    assert group.scores == [1.0, 0.0] and len(group) == 2
    assert t1.response_length == 2 and t2.response_length == 0


def test_sampling_params_use_sglang_names():
    params = SamplingParams(temperature=0.7, max_new_tokens=5, stop_token_ids=[2], seed=11).to_sglang()
    assert params["max_new_tokens"] == 5 and params["sampling_seed"] == 11 and params["stop_token_ids"] == [2]
    assert "seed" in params
    assert "sampling_seed" not in SamplingParams().to_sglang()


def test_batch_select_chunks_and_concat():
    import torch

    batch = Batch(tensors={"input_ids": torch.arange(12).view(4, 3), "rewards": torch.tensor([0., 1., 2., 3.])},
                  meta={"source": ["a", "b", "c", "d"]})
    assert len(batch) == 4 and "rewards" in batch
    sub = batch.select([3, 1])
    assert sub["rewards"].tolist() == [3.0, 1.0] and sub.meta["source"] == ["d", "b"]
    assert [len(c) for c in batch.chunks(3)] == [3, 1]
    wide = Batch(tensors={"input_ids": torch.ones(1, 5, dtype=torch.long), "rewards": torch.tensor([9.])},
                 meta={"source": ["e"]})
    both = Batch.concat([batch, wide])
    assert both["input_ids"].shape == (5, 5)
    assert both["input_ids"][0].tolist() == [0, 1, 2, 0, 0]  # right-padded
    assert both.meta["source"] == ["a", "b", "c", "d", "e"]


def test_contract_imports_without_heavy_modules():
    code = ("import sys, loongsage_hookspecs\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_spec_classes_are_frozen():
    spec = AdvantageSpec(name="a", fn=len)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.name = "b"  # type: ignore[misc]


def test_prompt_messages_is_the_one_rule_for_prompts():
    from loongsage_hookspecs import prompt_messages

    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    assert prompt_messages("hi", "sys") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    given = [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]
    out = prompt_messages(given, "sys")
    assert out == given and out[0] is not given[0]  # the row's system message wins; copies, not aliases
    for bad, what in ((3, "int"), ([], "an empty list"), (["q"], "list")):
        with pytest.raises(ValueError, match=f"a prompt must be a string or a non-empty list of chat messages, "
                                             f"got {what}"):
            prompt_messages(bad)


@pytest.mark.parametrize("value, expected", [
    (3, 3), ("3", 3), (" 12 ", 12), ("-1", -1), ("+4", 4), (0, 0),
    (None, None), (True, None), (False, None), ("", None), ("v3", None), ("3.0", None), (3.0, None), ("-", None),
    ("٣", None),  # a non-ASCII digit is not a version on the wire
])
def test_weight_versions_on_the_wire_read_one_way(value, expected):
    from loongsage_hookspecs import parse_weight_version

    assert parse_weight_version(value) == expected


def test_reward_spec_needs_no_sandbox_unless_it_says_so():
    from loongsage_hookspecs import RewardSpec

    assert RewardSpec(name="r", fn=len).needs_sandbox is False
    assert RewardSpec(name="r", fn=len, needs_sandbox=True).needs_sandbox is True


def test_sandbox_protocols_name_run_and_the_row():
    import inspect

    from loongsage_hookspecs import Sandbox, SandboxProvider

    assert "row" in inspect.signature(SandboxProvider.create).parameters
    assert not inspect.iscoroutinefunction(Sandbox.run) and inspect.iscoroutinefunction(Sandbox.exec)


def test_sandbox_request_reads_the_row_field_or_its_metadata():
    from loongsage_hookspecs import SandboxRequest, sandbox_request

    assert sandbox_request(None) == SandboxRequest() and sandbox_request(None).empty
    assert sandbox_request({"prompt": "p", "metadata": {"sandbox": "repos/a"}}).snapshot == "repos/a"
    req = sandbox_request({"sandbox": {"snapshot": "r.bundle", "commit": "abc", "setup": "make",
                                       "env": {"N": 3}, "setup_timeout_s": 5}})
    assert req == SandboxRequest(snapshot="r.bundle", commit="abc", setup=("make",), env={"N": "3"},
                                 setup_timeout_s=5.0)
    # the top-level field wins over the metadata's
    assert sandbox_request({"sandbox": "x", "metadata": {"sandbox": "y"}}).snapshot == "x"


@pytest.mark.parametrize("value, message", [
    (3, "must be a path or an object"),
    ({"snapshot": "a", "repo": "b"}, "unknown key"),
    ({"commit": "abc"}, "sandbox.snapshot"),
    ({"snapshot": ""}, "sandbox.snapshot must be"),
    ({"setup": [1]}, "sandbox.setup"),
    ({"env": {"A": [1]}}, "sandbox.env"),
    ({"setup_timeout_s": 0}, "setup_timeout_s"),
])
def test_sandbox_request_refuses_malformed_fields(value, message):
    from loongsage_hookspecs import sandbox_request

    with pytest.raises(ValueError, match=message) as info:
        sandbox_request({"sandbox": value}, where="rows.jsonl:7")
    assert "rows.jsonl:7" in str(info.value)
