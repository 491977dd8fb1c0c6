"""The ``view`` / ``edit`` file tools in a real ``local`` sandbox, and the schemas the model sees."""

from __future__ import annotations

import asyncio

import pytest
from loongsage_plugin_agents.file_tools import edit, view
from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider
from loongsage_plugin_agents.python_tools import function_schema


@pytest.fixture
def box(slow_fixture):
    provider = LocalSandboxProvider(default_timeout_s=30)
    sandbox = asyncio.run(provider.create("files-1"))
    yield sandbox
    asyncio.run(provider.close())


def run(coro):
    return asyncio.run(coro)


def test_view_numbers_lines_and_lists_directories(box):
    box.run("mkdir -p pkg && printf 'a = 1\\nb = 2\\nc = 3\\n' > pkg/m.py")
    assert run(view("pkg/m.py", sandbox=box)) == "     1\ta = 1\n     2\tb = 2\n     3\tc = 3"
    assert run(view("pkg/m.py", start_line=2, end_line=2, sandbox=box)) == "     2\tb = 2\n[... 1 more lines]"
    assert "pkg/m.py" in run(view(".", sandbox=box))
    assert run(view("nope.py", sandbox=box)) == "Error: nope.py does not exist"
    assert "inside the working directory" in run(view("../etc/passwd", sandbox=box))
    assert "inside the working directory" in run(view("/etc/passwd", sandbox=box))


def test_edit_replaces_unique_text_creates_files_and_explains_mistakes(box):
    box.run("printf 'x = 1\\ny = 1\\n' > m.py")
    assert run(edit("m.py", "y = 1", "y = 2", sandbox=box)) == "Edited m.py at line 2"
    assert box.run("cat m.py").stdout == "x = 1\ny = 2\n"
    assert "occurs 0 times" in run(edit("m.py", "z = 1", "z = 2", sandbox=box))
    box.run("printf 'v\\nv\\n' > twice.txt")
    assert "occurs 2 times" in run(edit("twice.txt", "v", "w", sandbox=box))
    assert run(edit("new/dir/f.py", "", "print('hi')\n", sandbox=box)) == "Created new/dir/f.py (1 lines)"
    assert box.run("python3 new/dir/f.py").stdout == "hi\n"
    assert "exists" in run(edit("m.py", "", "clobber", sandbox=box))
    assert "does not exist" in run(edit("missing.py", "a", "b", sandbox=box))


def test_edit_writes_files_larger_than_one_command_line(box):
    big = "".join(f"line {i} " + "x" * 60 + "\n" for i in range(4000))  # ~270 KB: five chunks
    assert run(edit("big.txt", "", big, sandbox=box)).startswith("Created big.txt")
    assert run(edit("big.txt", "line 3999 ", "last ", sandbox=box)) == "Edited big.txt at line 4000"
    assert box.run("wc -c < big.txt && tail -c 70 big.txt").stdout.split("\n")[0] == str(len(big) - 5)


def test_schemas_hide_the_sandbox_and_describe_the_arguments():
    v, e = function_schema(view)["function"], function_schema(edit)["function"]
    assert v["name"] == "view" and set(v["parameters"]["properties"]) == {"path", "start_line", "end_line"}
    assert v["parameters"]["required"] == ["path"]
    assert e["name"] == "edit" and e["parameters"]["required"] == ["path", "old_text", "new_text"]
    assert "exactly once" in e["description"]
