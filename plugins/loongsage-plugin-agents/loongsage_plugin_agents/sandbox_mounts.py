"""Which host paths a program needs inside a sandbox, wherever they live.

Under bubblewrap the sandbox sees the host read-only but with a private ``/tmp``: a checkout, a
virtual environment or an npm install under ``/tmp`` would be missing there, and the program
would fail to start (exit status 127). Agents name the paths their program needs and the sandbox
mounts them read-only where they are (``read_only=`` of ``run_program`` / ``arun_program``):

* :func:`tool_paths`: an npm-installed CLI (its whole install: the ``node_modules`` tree holds
  its JavaScript and its platform binaries) and the ``node`` that runs it;
* :func:`program_paths`: a program (with its virtual environment, for an interpreter in one),
  the files its command line names by absolute path (a script run by an interpreter) and the
  directories of its ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _install_root(path: str) -> str:
    """The directory that holds ``path``'s ``node_modules`` tree (its npm prefix), else its directory."""
    for parent in Path(path).parents:
        if parent.name == "node_modules":
            return str(parent.parent)
    return str(Path(path).parent)


def tool_paths(executable: str, search_path: str | None = None) -> list[str]:
    """The host paths an npm CLI at ``executable`` needs: its install (the link and where it points)
    and the ``node`` found on ``search_path`` (default: this process's ``PATH``)."""
    paths = [_install_root(executable), _install_root(os.path.realpath(executable))]
    node = shutil.which("node", path=search_path)
    if node:
        paths += [os.path.dirname(node), os.path.dirname(os.path.realpath(node))]
    return [p for p in dict.fromkeys(paths) if os.path.exists(p)]


def program_paths(argv: list[str], search_path: str | None = None, python_path: str | None = None) -> list[str]:
    """The host paths of a command line: its program (found on ``search_path``, and where it
    points; a virtual environment's interpreter brings the environment, whose packages it
    imports), every argument that is the absolute path of an existing file, and the existing
    absolute directories of ``python_path`` (the program's ``PYTHONPATH``: a Python program
    imports from them)."""
    paths: list[str] = []
    program = shutil.which(argv[0], path=search_path) if argv else None
    if program:
        paths += [program, os.path.realpath(program)]
        venv = Path(program).parent.parent
        if (venv / "pyvenv.cfg").is_file():
            paths.append(str(venv))
    paths += [a for a in argv[1:] if os.path.isabs(a) and os.path.isfile(a)]
    paths += [d for d in (python_path or "").split(os.pathsep) if os.path.isabs(d) and os.path.isdir(d)]
    return list(dict.fromkeys(paths))
