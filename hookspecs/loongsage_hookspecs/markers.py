"""The pluggy markers of the LoongSage contract.

``hookspec`` marks the hook functions the host declares; ``hookimpl`` is what plugin authors
decorate their provider functions with. Both carry the project name ``loongsage``, which is also
the entry-point group plugins register under.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "loongsage"
"""Pluggy project name and the entry-point group that plugin distributions register under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
