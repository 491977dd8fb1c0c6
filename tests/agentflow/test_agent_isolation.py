"""A hostile black-box agent, run by the real ``command`` agent through the real runner and router:
it gets its own endpoint and key, and nothing it tries beyond them works.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import httpx
import pytest

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_hookspecs import Trajectory, TrajectoryStatus

HOSTILE = textwrap.dedent('''
    """Uses its endpoint, then tries everything else it can think of; prints what each attempt got."""
    import json, os, sys
    import httpx

    base, key, engine = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], sys.argv[1]
    root = base.split("/", 3)[0] + "//" + base.split("/", 3)[2]
    own = {"Authorization": "Bearer " + key}
    victim = root + "/victim/0/v1"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = {
        "own_chat": httpx.post(base + "/chat/completions", json=chat, headers=own, timeout=60).status_code,
        "victim_chat": httpx.post(victim + "/chat/completions", json=chat, headers=own, timeout=60).status_code,
        "victim_models_anthropic_header": httpx.get(victim + "/models", headers={"x-api-key": key}).status_code,
        "admin_stats": httpx.get(root + "/admin/stats", headers=own).status_code,
        "admin_delete_victim": httpx.delete(root + "/admin/trajectories/victim", headers=own).status_code,
        "admin_engines": httpx.post(root + "/admin/engines", json={"urls": ["http://127.0.0.1:1"]},
                                    headers=own).status_code,
        "engine_pause": httpx.post(engine + "/pause_generation", json={"mode": "abort"}, headers=own).status_code,
        "engine_weights": httpx.post(engine + "/update_weights_from_tensor", json={"serialized_named_tensors": ""},
                                     headers=own).status_code,
        "env": dict(os.environ),
    }
    print(json.dumps(out))
''')


@pytest.mark.slow
def test_a_hostile_command_agent_reaches_its_own_endpoint_only(secure_engine_url, run_secret, router_factory,
                                                               tmp_path):
    from loongsage_plugin_agents.command_agent import CommandAgent

    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    router = router_factory([secure_engine_url], secret=run_secret)
    router.blocking.register("victim", sampling={"max_new_tokens": 2})
    agent = CommandAgent(command=[sys.executable, str(script), secure_engine_url], stdin=False)
    traj = Trajectory(id="attacker", prompt_id="p", group_id="g", prompt="hi")
    traj = asyncio.run(run_agent_trajectory(router, agent, trajectory=traj, sampling={"max_new_tokens": 2},
                                            timeout_s=120))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    seen = json.loads(traj.response_text)
    env = seen.pop("env")
    assert seen == {"own_chat": 200, "victim_chat": 401, "victim_models_anthropic_header": 401, "admin_stats": 403,
                    "admin_delete_victim": 403, "admin_engines": 403, "engine_pause": 401, "engine_weights": 401}
    assert env["OPENAI_API_KEY"] == router.trajectory_key("attacker") != run_secret
    assert not any(run_secret in value for value in env.values())
    assert len(traj.segments) == 1 and sum(traj.segments[0].loss_mask) >= 1  # its own turn was recorded
    assert router.blocking.get("victim").status == TrajectoryStatus.PENDING
    info = httpx.get(secure_engine_url + "/get_server_info", headers={"Authorization": f"Bearer {run_secret}"})
    assert info.json()["internal_states"][0]["paused"] is False
