"""Hook implementations of loongsage-plugin-rewards (the module its entry point names).

Only light modules (standard library and the contract) are imported here; math-verify and
reasoning-gym are imported when their component first runs.
"""

from __future__ import annotations

from typing import Iterator

from loongsage_hookspecs import DataSourceSpec, RewardSpec, hookimpl

from .code_reward import code_tests
from .countdown_reward import countdown_reward
from .math_reward import math_verify_reward
from .rewards import exact_match, format_reward, numeric_match, token_f1
from .rgym import reasoning_gym_reward, reasoning_gym_rows
from .sources.arithmetic import arithmetic_rows
from .sources.countdown import countdown_rows
from .swe_reward import swe_tests


@hookimpl
def loongsage_rewards() -> Iterator[RewardSpec]:
    yield RewardSpec(name="exact_match", fn=exact_match,
                     description="1 when the extracted final answer equals the label (normalised text)")
    yield RewardSpec(name="numeric_match", fn=numeric_match,
                     description="1 when the last number of the answer is within tolerance of the label")
    yield RewardSpec(name="token_f1", fn=token_f1,
                     description="token-overlap F1 (SQuAD) of the extracted final answer with the label")
    yield RewardSpec(name="format", fn=format_reward, description="1 when the response matches a regex 'pattern'")
    yield RewardSpec(name="math_verify", fn=math_verify_reward,
                     description="1 when the answer is mathematically equal to the label (math-verify)")
    yield RewardSpec(name="countdown", fn=countdown_reward,
                     description="1 when the answer is an expression over the given numbers equal to the target")
    yield RewardSpec(name="reasoning_gym", fn=reasoning_gym_reward,
                     description="the reasoning-gym dataset's own score_answer for the response")
    yield RewardSpec(name="swe_tests", fn=swe_tests, needs_sandbox=True,
                     description="1 when the task's FAIL_TO_PASS and PASS_TO_PASS tests pass in the sandbox "
                                 "(SWE-bench rows; runs test_cmd on the agent's edits)")
    yield RewardSpec(name="code_tests", fn=code_tests, needs_sandbox=True,
                     description="1 when the response's code passes the row's tests (assert list or test "
                                 "program) run in the sandbox")


@hookimpl
def loongsage_data_sources() -> Iterator[DataSourceSpec]:
    yield DataSourceSpec(name="arithmetic", factory=arithmetic_rows,
                         description="integer + - * questions ('What is 3 + 5?'), label = the result")
    yield DataSourceSpec(name="countdown", factory=countdown_rows,
                         description="reach a target with + - * / over given numbers (reward: countdown)")
    yield DataSourceSpec(name="reasoning_gym", factory=reasoning_gym_rows,
                         description="a reasoning-gym procedural dataset (reward: reasoning_gym)")
