"""Settings every test directory shares (this file sits at the repository root, above them all).

Property tests run with no per-example deadline: on a loaded machine (CI, a flake hunt under CPU
load) one example may take longer than Hypothesis's 200 ms default without anything being wrong.
Their order is pytest-randomly's (a seed per run, printed in the header); Hypothesis's own
randomness follows that seed, so a failing run replays with ``--randomly-seed=SEED``.
"""

from __future__ import annotations

try:
    from hypothesis import settings
except ImportError:  # an environment without property tests (tox's hookspecs env) has nothing to set
    settings = None

if settings is not None:
    settings.register_profile("loongsage", deadline=None)
    settings.load_profile("loongsage")
