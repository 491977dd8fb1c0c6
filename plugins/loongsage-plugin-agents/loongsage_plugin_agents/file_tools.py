"""File tools for code agents: ``view`` and ``edit`` files in the trajectory's sandbox.

Give them to the ``tool_agent`` by import path, beside its ``bash`` tool::

    agent_args = { tools = ["loongsage_plugin_agents.file_tools:view",
                            "loongsage_plugin_agents.file_tools:edit"] }

Both act on paths relative to the sandbox directory (absolute paths and ``..`` that leave it are
refused) and work with any sandbox: they read and write with commands run in it (as its user, inside its
isolation), never from the host side, so a symlink the agent planted leads nowhere it could not
already go. Mistakes
(a missing file, an ``old_text`` that is not there or not unique) come back as text the model
reads, never as exceptions: they are part of the episode.
"""

from __future__ import annotations

import base64
import shlex
from typing import Any

MAX_VIEW_LINES = 400
CHUNK_BYTES = 64 * 1024


def _inside(path: str) -> str | None:
    parts = path.replace("\\", "/").split("/")
    if not path or path.startswith("/") or ".." in parts:
        return f"Error: {path!r} must be a relative path inside the working directory"
    return None


async def _read(sandbox: Any, path: str) -> str | None:
    """The file's text, or None when it is not a regular file (read by a command in the sandbox)."""
    res = await sandbox.exec(f"test -f {shlex.quote(path)} && cat -- {shlex.quote(path)}")
    if getattr(res, "truncated", False):
        raise OSError(f"{path} is larger than the sandbox's output cap; view it in parts with bash (sed -n)")
    return res.stdout if res.exit_code == 0 else None


async def _write(sandbox: Any, path: str, text: str) -> None:
    """Write by commands in the sandbox (as its user, inside its isolation), in argument-sized chunks."""
    for command in write_commands(path, text):
        res = await sandbox.exec(command)
        if res.exit_code != 0:
            raise OSError(res.stderr.strip() or f"writing {path} failed")


def write_commands(path: str, text: str, chunk: int = CHUNK_BYTES) -> list[str]:
    """Shell commands that write ``text`` to ``path``: the first truncates, the rest append (each
    command line stays far below the kernel's 128 KiB limit on one argument)."""
    data = text.encode()
    quoted = shlex.quote(path)
    out = [f"mkdir -p \"$(dirname {quoted})\" && : > {quoted}"]
    for i in range(0, len(data), chunk):
        out.append(f"printf %s {base64.b64encode(data[i:i + chunk]).decode()} | base64 -d >> {quoted}")
    return out


def format_view(path: str, text: str, start_line: int = 1, end_line: int = 0) -> str:
    """What :func:`view` shows of a file whose content is ``text``: numbered lines (a pure function,
    so warm-start transcripts can hold the tool's exact output without a sandbox)."""
    lines = text.splitlines()
    first = max(1, int(start_line))
    last = len(lines) if int(end_line) <= 0 else min(len(lines), int(end_line))
    last = min(last, first + MAX_VIEW_LINES - 1)
    shown = [f"{n:6d}\t{lines[n - 1]}" for n in range(first, last + 1)]
    more = f"\n[... {len(lines) - last} more lines]" if last < len(lines) else ""
    return ("\n".join(shown) + more) if shown else f"{path}: no lines in {first}..{last} ({len(lines)} lines)"


def apply_edit(path: str, text: str, old_text: str, new_text: str) -> tuple[str | None, str]:
    """What :func:`edit` does to an existing file's ``text``: ``(new content or None, the reply)``."""
    count = text.count(old_text)
    if count != 1:
        return None, (f"Error: old_text occurs {count} times in {path}; it must occur exactly once "
                      "(copy it exactly, or include more surrounding lines)")
    line = text[: text.index(old_text)].count("\n") + 1
    return text.replace(old_text, new_text), f"Edited {path} at line {line}"


async def view(path: str, start_line: int = 1, end_line: int = 0, sandbox: Any = None) -> str:
    """Show a file with line numbers, or list a directory.

    Args:
        path: file or directory, relative to the working directory ("." for the top)
        start_line: first line to show (1-based)
        end_line: last line to show (0: to the end, at most 400 lines)
    """
    problem = _inside(path) if path != "." else None
    if problem or sandbox is None:
        return problem or "Error: no sandbox to read from"
    text = await _read(sandbox, path)
    if text is None:
        res = await sandbox.exec(f"test -d {shlex.quote(path)} && find {shlex.quote(path)} -maxdepth 2 "
                                 "-not -path '*/.*' | sort | head -200")
        if res.exit_code == 0 and res.stdout.strip():
            return res.stdout.rstrip()
        return f"Error: {path} does not exist"
    return format_view(path, text, start_line, end_line)


async def edit(path: str, old_text: str, new_text: str, sandbox: Any = None) -> str:
    """Replace text in a file: old_text must occur exactly once. An empty old_text creates a new file.

    Args:
        path: the file, relative to the working directory
        old_text: the exact text to replace (with its indentation); empty to create the file
        new_text: the text to put instead
    """
    problem = _inside(path)
    if problem or sandbox is None:
        return problem or "Error: no sandbox to edit in"
    text = await _read(sandbox, path)
    if not old_text:
        if text is not None:
            return f"Error: {path} exists; give the old_text to replace"
        await _write(sandbox, path, new_text)
        return f"Created {path} ({len(new_text.splitlines())} lines)"
    if text is None:
        return f"Error: {path} does not exist"
    new, reply = apply_edit(path, text, old_text, new_text)
    if new is not None:
        await _write(sandbox, path, new)
    return reply
