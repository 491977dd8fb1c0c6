"""Python tools for the tool agent: loading by import path, schemas from signatures, calling."""

from __future__ import annotations

import asyncio
import textwrap
from typing import Literal

import pytest
from loongsage_plugin_agents.python_tools import ToolError, call_tool, function_schema, load_function
from loongsage_plugin_agents.tool_agent import ToolAgent


def search(query: str, limit: int = 3, tags: list[str] | None = None, mode: Literal["fast", "exact"] = "fast",
           ratio: float | None = None, sandbox=None) -> dict:
    """Search the notes.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for
        limit (int): how many results
    """
    return {"query": query, "limit": limit, "sandbox": sandbox}


def test_schema_from_signature_and_docstring():
    schema = function_schema(search)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for"}
    assert props["limit"] == {"type": "integer", "description": "how many results"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"enum": ["fast", "exact"]}
    assert props["ratio"] == {"type": "number"}
    assert "sandbox" not in props  # injected, not shown to the model
    assert fn["parameters"]["required"] == ["query"]


def test_call_injects_sandbox_and_serialises_results():
    out = asyncio.run(call_tool(search, {"query": "q"}, sandbox="BOX", ctx="CTX"))
    assert out == '{"query": "q", "limit": 3, "sandbox": "BOX"}'

    async def shout(text: str) -> str:
        return text.upper()

    assert asyncio.run(call_tool(shout, {"text": "hi"})) == "HI"


def test_load_function_by_module_and_file(tmp_path):
    assert load_function("json:dumps") is __import__("json").dumps
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent('''
        def double(x: int) -> int:
            """Double a number."""
            return 2 * x
    '''))
    assert load_function(f"{path}:double")(4) == 8
    for bad, msg in (("nocolon", "expected 'module:function'"), ("no_such_module_xyz:f", "cannot import"),
                     ("json:nope", "has no function 'nope'"), (f"{tmp_path}/missing.py:f", "does not exist")):
        with pytest.raises(ToolError, match=msg):
            load_function(bad)


def test_tool_agent_rejects_bad_configuration(tmp_path):
    with pytest.raises(ValueError, match="max_turns"):
        ToolAgent(max_turns=0)
    with pytest.raises(ValueError, match="two tools are named 'dumps'"):
        ToolAgent(tools=["json:dumps", "json:dumps"])
