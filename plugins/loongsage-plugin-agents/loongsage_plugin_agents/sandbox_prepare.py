"""Filling a ``local`` sandbox's directory from its row: a directory, a tarball or a git bundle.

A git checkout (a bundle, or a directory with ``commit``) is cloned, the commit checked out and
the ``origin`` remote removed, so the agent cannot fetch the repository's later history (the fix)
from where the snapshot came from. A tarball whose members all sit under one top-level directory
is unpacked without it. The files end up owned by the sandbox's user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile

from loongsage_hookspecs import SandboxRequest

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


class SnapshotError(RuntimeError):
    """The row's snapshot could not be copied into the sandbox (the message names it)."""


def resolve_snapshot(snapshot: str, base_dir: str | None) -> str:
    path = os.path.expanduser(snapshot)
    if not os.path.isabs(path):
        path = os.path.join(base_dir or os.getcwd(), path)
    if not os.path.exists(path):
        raise SnapshotError(f"sandbox.snapshot {snapshot!r}: {path} does not exist"
                            + ("" if base_dir else " (relative paths are resolved against the working directory; "
                               "set sandbox_args.base_dir)"))
    return path


def _git(*args: str, cwd: str | None = None) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir(), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0", "LANG": "C"}
    res = subprocess.run(["git", "-c", "safe.directory=*", "-c", "advice.detachedHead=false", *args], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SnapshotError(f"git {' '.join(args[:2])} failed: {(res.stderr or res.stdout).strip()[-500:]}")


def _clone(source: str, commit: str | None, dest: str) -> None:
    if shutil.which("git") is None:
        raise SnapshotError("a git snapshot needs git on this machine (apt-get install -y git)")
    _git("clone", "--quiet", "--no-hardlinks", source, dest)
    if commit:
        try:
            _git("checkout", "--quiet", "--detach", commit, cwd=dest)
        except SnapshotError as exc:
            raise SnapshotError(f"commit {commit!r} of {source}: {exc}") from None
    _git("remote", "remove", "origin", cwd=dest)


def _untar(archive: str, dest: str) -> None:
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            tops = {m.name.split("/", 1)[0] for m in members if m.name not in ("", ".")}
            strip = len(tops) == 1 and all(m.name != next(iter(tops)) or m.isdir() for m in members)
            unpack = dest if not strip else tempfile.mkdtemp(dir=os.path.dirname(dest))
            tar.extractall(unpack, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise SnapshotError(f"cannot unpack {archive}: {exc}") from None
    if strip:
        top = os.path.join(unpack, next(iter(tops)))
        for name in os.listdir(top):
            os.rename(os.path.join(top, name), os.path.join(dest, name))
        shutil.rmtree(unpack, ignore_errors=True)


def materialize(request: SandboxRequest, dest: str, base_dir: str | None) -> None:
    """Copy ``request.snapshot`` (checked out at ``request.commit``) into the empty directory ``dest``."""
    if request.snapshot is None:
        return
    source = resolve_snapshot(request.snapshot, base_dir)
    if source.endswith(".bundle"):
        _clone(source, request.commit, dest)
    elif os.path.isdir(source):
        if request.commit:
            if not os.path.exists(os.path.join(source, ".git")):
                raise SnapshotError(f"sandbox.commit {request.commit!r} given but {source} is not a git checkout")
            _clone(source, request.commit, dest)
        else:
            shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
    elif source.endswith(TAR_SUFFIXES):
        if request.commit:
            raise SnapshotError(f"sandbox.commit is set but {source} is a tarball; name a git bundle or checkout")
        _untar(source, dest)
    else:
        raise SnapshotError(f"sandbox.snapshot {source}: not a directory, a tarball ({', '.join(TAR_SUFFIXES)}) "
                            "or a git bundle (.bundle)")


def chown_tree(root: str, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)
