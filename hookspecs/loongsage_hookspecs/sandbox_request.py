"""What a data row asks of its trajectory's sandbox, read the same way by every provider.

A row names its sandbox in a ``sandbox`` field (a top-level field of a JSONL row lands in the
row's ``metadata``, so both places are read)::

    {"prompt": "...", "sandbox": {
        "snapshot": "repos/calc",          # a directory, a tarball (.tar, .tar.gz, .tgz, .tar.bz2,
                                           # .tar.xz) or a git bundle (.bundle)
        "commit": "3f2a1c0",               # for a git bundle or a git directory: checked out
        "setup": ["pip install -e ."],     # shell commands run in the sandbox before the agent
        "env": {"PYTHONPATH": "src"},      # environment of every command in the sandbox
        "setup_timeout_s": 300}}

A plain string is the snapshot alone (``"sandbox": "repos/calc"``). A relative snapshot path is
resolved by the provider (the local one: against its ``base_dir``, else the working directory).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

SNAPSHOT_KEYS = ("snapshot", "commit", "setup", "env", "setup_timeout_s")


@attrs.define(frozen=True)
class SandboxRequest:
    """A row's sandbox: the repository snapshot to copy in, setup commands and environment."""

    snapshot: str | None = None
    commit: str | None = None
    setup: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    setup_timeout_s: float | None = None

    @property
    def empty(self) -> bool:
        return self.snapshot is None and not self.setup and not self.env


def sandbox_request(row: Mapping[str, Any] | None, where: str = "row") -> SandboxRequest:
    """The :class:`SandboxRequest` of a data row (``{"prompt", "label", "metadata"}`` or a raw row).

    ``row["sandbox"]`` wins over ``row["metadata"]["sandbox"]``; no such field is an empty
    request (an empty directory). A malformed field raises ``ValueError`` naming ``where`` and the key.
    """
    if not row:
        return SandboxRequest()
    value = row.get("sandbox")
    if value is None and isinstance(row.get("metadata"), Mapping):
        value = row["metadata"].get("sandbox")
    if value is None:
        return SandboxRequest()
    if isinstance(value, str):
        value = {"snapshot": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: 'sandbox' must be a path or an object with {', '.join(SNAPSHOT_KEYS)}; "
                         f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(SNAPSHOT_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} in 'sandbox'; "
                         f"known: {', '.join(SNAPSHOT_KEYS)}")
    snapshot, commit = value.get("snapshot"), value.get("commit")
    for key, item in (("snapshot", snapshot), ("commit", commit)):
        if item is not None and (not isinstance(item, str) or not item):
            raise ValueError(f"{where}: sandbox.{key} must be a non-empty string")
    if commit is not None and snapshot is None:
        raise ValueError(f"{where}: sandbox.commit is set but sandbox.snapshot (the repository) is not")
    setup = value.get("setup") or ()
    if isinstance(setup, str):
        setup = (setup,)
    if not isinstance(setup, (list, tuple)) or not all(isinstance(c, str) for c in setup):
        raise ValueError(f"{where}: sandbox.setup must be a command string or a list of them")
    env = value.get("env") or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                               for k, v in env.items()):
        raise ValueError(f"{where}: sandbox.env must be an object of string values")
    timeout = value.get("setup_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"{where}: sandbox.setup_timeout_s must be a positive number")
    return SandboxRequest(snapshot=snapshot, commit=commit, setup=tuple(setup),
                          env={str(k): str(v) for k, v in env.items()},
                          setup_timeout_s=None if timeout is None else float(timeout))
