"""mini-swe-agent, an off-the-shelf coding agent, run unchanged against the router.

Protocol level: the tiny random model will not solve anything, but every call the agent makes
(through litellm's OpenAI client) must be served and recorded as trajectory turns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONTEXT = 8192  # mini-swe-agent's system prompt alone is a few thousand tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def long_context_engine_url(slow_fixture):
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    from .conftest import TOKENIZER_DIR

    job = structure_job({"model": {"config": {**TINY_QWEN3, "max_position_embeddings": CONTEXT},
                                   "tokenizer": str(TOKENIZER_DIR)},
                         "rollout": {"max_context_length": CONTEXT}, "run": {"seed": 0}})
    engine = EmbeddedEngine(EngineContext(job=job, components=None))
    try:
        yield engine.start()
    finally:
        engine.shutdown()


def test_mini_swe_agent_calls_are_served_and_recorded(router_factory, long_context_engine_url, tmp_path):
    router = router_factory([long_context_engine_url])
    url = router.blocking.register("mini", max_response_tokens=200, sampling={"max_new_tokens": 12, "locked": True})
    mini = shutil.which("mini", path=str(Path(sys.executable).parent)) or shutil.which("mini")
    assert mini, "mini-swe-agent is a test dependency (pip install -e '.[test]')"
    env = dict(os.environ, OPENAI_API_KEY="loongsage", MSWEA_COST_TRACKING="ignore_errors",
               MSWEA_CONFIGURED="true", MSWEA_GLOBAL_CONFIG_DIR=str(tmp_path / "cfg"),
               LITELLM_LOCAL_MODEL_COST_MAP="True")  # no network: litellm's bundled price table
    cmd = [mini, "-m", "openai/policy", "-t", "Print hello world", "-y", "--exit-immediately",
           "-c", "mini_textbased.yaml", "-c", "agent.step_limit=3", "-c", f"model.model_kwargs.api_base={url}",
           "-o", str(tmp_path / "trajectory.json")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
                         cwd=tmp_path)
    assert (tmp_path / "trajectory.json").exists(), out.stdout[-2000:] + out.stderr[-2000:]
    record = router.blocking.get("mini")
    assert len(record.turns) >= 2  # the agent kept talking after format errors
    assert all(t.completion_tokens > 0 for t in record.turns)
    generated = sum(sum(seg.loss_mask) for seg in record.segments)
    assert generated == sum(t.completion_tokens for t in record.turns)
    assert record.error is None
