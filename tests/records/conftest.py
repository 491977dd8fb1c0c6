"""A recorded run shared by the records and viewer tests (made once per test session).

The policy is a tiny Qwen3 whose weights make it write the tool call ``<tool_call>{"name": "add"}
</tool_call>`` after any generation prompt (the model of tests/agentflow), saved as a Hugging Face
directory, so the tool agent really calls its tool. Three sources: a black-box program through the
``command`` agent, the ``tool_agent`` with a Python tool, and a single-turn source whose second
reward raises for every second sample (those trajectories fail, the ``status`` filter drops them,
and they are recorded as filtered).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "data" / "tokenizer"

REWARDS = '''
import re
import zlib

from loongsage_hookspecs import Reward, RewardSpec, hookimpl


def varied(trajectory):
    """A score that differs between samples of a group (so advantages are not zero)."""
    value = (zlib.crc32(trajectory.id.encode()) % 4) / 3
    return Reward(score=value, details={"bucket": value}, reason=f"crc bucket {value:.2f}")


def flaky(trajectory):
    """Raises for sample 1 of every group, like a grader that went down."""
    if re.split(r"[:-]", trajectory.id)[-1] == "1":
        raise RuntimeError("the grader is down")
    return Reward(score=0.0, reason="graded")


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="varied", fn=varied, description="crc32 of the trajectory id")
    yield RewardSpec(name="flaky", fn=flaky, description="fails for sample 1")
'''

TOOLS = '''
def add(a: int = 1, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''

JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
modules = ["{rewards}"]

[model]
path = "{model}"
tokenizer = "{tokenizer}"

[train]
lr = 1e-6
total_steps = 2
mini_batch_size = 64
micro_batch_size = 16

[rollout]
prompts_per_step = 3
samples_per_prompt = 3
max_new_tokens = 16
max_context_length = 1024
weight_transport = "inprocess"

[agentflow]
agent_timeout_s = 120
middleware = ["tool_call_parser"]
middleware_args = {{ tool_call_parser = {{ format = "hermes" }} }}

[algorithm]
filters = ["status"]          # drops the failed trajectories: recorded as filtered

[run]
checkpoint_every = 1

[[data]]
name = "blackbox"
generator = "arithmetic"
generator_args = {{ num_samples = 20, digits = 1, num_operands = 2, ops = "+" }}
agent = "command"
agent_args = {{ command = ["{python}", "{blackbox}", "--turns", "2", "--max-tokens", "16"] }}
reward = ["numeric_match", "varied"]

[[data]]
name = "tools"
generator = "arithmetic"
generator_args = {{ num_samples = 20, digits = 1, num_operands = 2, ops = "+" }}
agent = "tool_agent"
sandbox = "local"
agent_args = {{ tools = ["{tools}:add"], max_turns = 2 }}
reward = ["varied"]

[[data]]
name = "flaky"
generator = "arithmetic"
generator_args = {{ num_samples = 20, digits = 1, num_operands = 2, ops = "+" }}
reward = ["varied", "flaky"]

[[loggers]]
name = "jsonl"
"""


def _tool_call_model() -> Any:
    """``tool_call_model`` of tests/agentflow/conftest.py (loaded by path: conftest modules are not
    importable under pytest's importlib mode)."""
    spec = importlib.util.spec_from_file_location("_agentflow_conftest", REPO / "tests" / "agentflow" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from transformers import AutoTokenizer

    return module.tool_call_model(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))


def write_job(root: Path) -> Path:
    """The job above, its tool-call model, reward module and tool file, under ``root``."""
    model_dir = root / "model"
    if not model_dir.exists():
        _tool_call_model().save_pretrained(str(model_dir))
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, model_dir / f.name)
    (root / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    (root / "my_tools.py").write_text(textwrap.dedent(TOOLS))
    job = root / "job.toml"
    job.write_text(JOB.format(rewards=root / "my_rewards.py", model=model_dir, tokenizer=TOKENIZER_DIR,
                              python=sys.executable, blackbox=REPO / "examples" / "blackbox_agent.py",
                              tools=root / "my_tools.py"))
    return job


@pytest.fixture(scope="session")
def recorded_run(ray_cluster, tmp_path_factory) -> dict[str, Any]:
    """Run the job once, keeping each step's trained batch as the controller held it.

    Returns ``{"dir": run directory, "job": job file, "batches": {step: Batch}, "history": metrics}``.
    """
    import copy

    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.controller.runtime import Run
    from loongsage_core.resolve import resolve_job

    root = tmp_path_factory.mktemp("recorded")
    job = write_job(root)
    batches: dict[int, Any] = {}
    original = Run.record

    def keep_batch(self: Run, step: int, groups: Any, batch: Any, sampled: Any = ()) -> None:
        batches[step] = copy.deepcopy(batch)
        original(self, step, groups, batch, sampled)

    Run.record = keep_batch  # type: ignore[method-assign]
    try:
        history = run_job(resolve_job(load_job(job)), output_dir=str(root / "run"))
    finally:
        Run.record = original  # type: ignore[method-assign]
    return {"dir": root / "run", "job": job, "batches": batches, "history": history}


TREE_JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers"]
modules = ["{harness}"]

[model]
tokenizer = "{tokenizer}"

[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 1024
tie_word_embeddings = true

[train]
lr = 1e-3
total_steps = 1
mini_batch_size = 8
micro_batch_size = 8

[rollout]
prompts_per_step = 1
samples_per_prompt = 2
max_new_tokens = 8
max_context_length = 1024
weight_transport = "inprocess"

[agentflow]
agent_timeout_s = 120

[[data]]
name = "tree"
generator = "arithmetic"
generator_args = {{ num_samples = 4 }}
agent = "compacting_harness"
reward = ["first_sample"]

[[loggers]]
name = "jsonl"
"""
"""One step of a random tiny policy on the scripted harness of tests/agentflow/tree_harness.py
(a compaction and a sub-agent: three segments per trajectory), two samples of one prompt."""


@pytest.fixture(scope="session")
def tree_run(ray_cluster, tmp_path_factory) -> dict[str, Any]:
    """Run :data:`TREE_JOB` once, keeping the step's trained batch as the controller held it.

    Returns ``{"dir": run directory, "batch": Batch, "history": metrics}``.
    """
    import copy

    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.controller.runtime import Run
    from loongsage_core.resolve import resolve_job

    root = tmp_path_factory.mktemp("tree")
    job = root / "job.toml"
    job.write_text(TREE_JOB.format(harness=REPO / "tests" / "agentflow" / "tree_harness.py", tokenizer=TOKENIZER_DIR))
    batches: dict[int, Any] = {}
    original = Run.record

    def keep_batch(self: Run, step: int, groups: Any, batch: Any, sampled: Any = ()) -> None:
        batches[step] = copy.deepcopy(batch)
        original(self, step, groups, batch, sampled)

    Run.record = keep_batch  # type: ignore[method-assign]
    try:
        history = run_job(resolve_job(load_job(job)), output_dir=str(root / "run"))
    finally:
        Run.record = original  # type: ignore[method-assign]
    return {"dir": root / "run", "batch": batches[0], "history": history}
