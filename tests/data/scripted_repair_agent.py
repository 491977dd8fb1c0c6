#!/usr/bin/env python3
"""A scripted code-repair agent: an ordinary OpenAI-SDK program whose decisions are fixed in advance.

Run by the ``command`` agent in a trajectory's sandbox directory (its working directory). Each
step asks the model for its next move through the trajectory's endpoint (``OPENAI_BASE_URL``),
then, whatever the model said, makes the scripted move: a ``bash`` or ``edit`` tool call, which it
runs itself in the working directory and appends to the conversation (assistant ``tool_calls`` +
``tool`` result), as a real agent does. So the router records a genuine multi-turn tool
conversation, and the files the program leaves are exactly those its script writes.

``--mode``:
  ``fix``        look at the file, apply the task's reference fix with ``edit`` tool calls, run the tests;
                 (the test fixture engine has a 1,024-token context: the conversations stay short)
  ``none``       look around with ``bash`` and change nothing;
  ``fix_break``  the fix, plus an edit that breaks the first passing test's function (``--break-file``,
                 ``--break-old``, ``--break-new``).

The fix comes from the row (``LOONGSAGE_PROMPT_FILE`` -> ``metadata.patch``, a unified diff): each
hunk's removed lines are the ``old_text`` of one ``edit``, its added lines the ``new_text``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "shell",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "edit", "description": "replace",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "old_text": {"type": "string"},
                                               "new_text": {"type": "string"}}}}}]
SHOWN = 100  # characters of a tool result put back into the (small) conversation


def edits_of(patch: str) -> list[dict[str, str]]:
    """One ``edit`` per hunk of a unified diff: the hunk's old lines -> its new lines."""
    out, path, old, new = [], None, [], []

    def flush() -> None:
        if path and (old or new):
            out.append({"path": path, "old_text": "".join(old), "new_text": "".join(new)})

    for line in patch.splitlines(True):
        if line.startswith("+++ "):
            path = re.sub(r"^b/", "", line[4:].strip())
        elif line.startswith("@@"):
            flush()
            old, new = [], []
        elif line.startswith(("---", "diff ")):
            continue
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        elif line.startswith(" "):
            old.append(line[1:])
            new.append(line[1:])
    flush()
    return out


def trimmed(edit: dict[str, str]) -> dict[str, str]:
    """The edit without the hunk's unchanged leading/trailing lines, as long as ``old_text`` stays
    unique in the file (a short tool call, as an agent would write it)."""
    with open(edit["path"]) as f:
        text = f.read()
    old, new = edit["old_text"].splitlines(True), edit["new_text"].splitlines(True)
    while len(old) > 1 and len(new) > 1 and old[0] == new[0] and text.count("".join(old[1:])) == 1:
        old, new = old[1:], new[1:]
    while len(old) > 1 and len(new) > 1 and old[-1] == new[-1] and text.count("".join(old[:-1])) == 1:
        old, new = old[:-1], new[:-1]
    return {**edit, "old_text": "".join(old), "new_text": "".join(new)}


def run_tool(name: str, args: dict[str, str]) -> str:
    if name == "bash":
        proc = subprocess.run(args["command"], shell=True, capture_output=True, text=True, timeout=60)
        return f"exit code {proc.returncode}\n{proc.stdout}{proc.stderr}"
    with open(args["path"]) as f:
        text = f.read()
    if text.count(args["old_text"]) != 1:
        return f"Error: old_text occurs {text.count(args['old_text'])} times in {args['path']}"
    with open(args["path"], "w") as f:
        f.write(text.replace(args["old_text"], args["new_text"]))
    return f"Edited {args['path']}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fix", "none", "fix_break"), required=True)
    ap.add_argument("--break-file", default="")
    ap.add_argument("--break-old", default="")
    ap.add_argument("--break-new", default="")
    args = ap.parse_args()
    with open(os.environ["LOONGSAGE_PROMPT_FILE"]) as f:
        task = json.load(f)
    edits = edits_of(task["metadata"]["patch"])
    plan: list[tuple[str, dict[str, str]]] = [("bash", {"command": f"ls {edits[0]['path']}"})]
    if args.mode in ("fix", "fix_break"):
        plan += [("edit", e) for e in edits]
    if args.mode == "fix_break":
        plan.append(("edit", {"path": args.break_file, "old_text": args.break_old, "new_text": args.break_new}))
    if args.mode == "fix":
        plan.append(("bash", {"command": "python3 -m unittest -q 2>&1 | tail -1"}))

    client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    for i, (name, tool_args) in enumerate(plan):
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
        if name == "edit":
            tool_args = trimmed(tool_args)
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(tool_args)}}]})
        result = run_tool(name, tool_args)
        print(f"{name} {json.dumps(tool_args)[:80]} -> {result.strip()[:80]}", file=sys.stderr)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result[:SHOWN]})
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    print(f"Done ({len(plan)} tool calls). The model's last word: {reply.choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
