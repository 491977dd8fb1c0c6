"""The error every local-sandbox operation raises when it is refused or fails.

Its own module so that the sandbox object (:mod:`.sandbox_box`), the isolation probing
(:mod:`.sandbox_isolation`) and the provider (:mod:`.local_sandbox`) all raise it without
importing each other.
"""

from __future__ import annotations


class SandboxError(RuntimeError):
    """A sandbox operation was refused or failed (a path outside the sandbox, a destroyed
    sandbox, a snapshot or setup command that failed, ...)."""
