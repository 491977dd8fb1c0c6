"""The plugin module provides the four strategies through the contract's hook, each described,
documented in the README and building a ``Scheduler``; listing them imports nothing heavy."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pluggy
from loongsage_plugin_schedulers import plugin

from loongsage_hookspecs import KINDS, PROJECT_NAME, Scheduler, SchedulerContext, SchedulerSpec, hookspecs


def make(factory, *, batch_size, stale_steps=1, quota=None, **args):
    """``factory(ctx, **args)`` as the host builds a scheduler: its context carries ``batch_size``,
    ``stale_steps`` and ``quota``; the rest are the job's ``scheduler_args``."""
    return factory(SchedulerContext(batch_size=batch_size, stale_steps=stale_steps, quota=quota), **args)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
NAMES = {"sync", "no_window", "window_gated", "windowed_fifo"}


def provided() -> dict[str, SchedulerSpec]:
    """Scheduler specs collected the way a host does: a pluggy manager with the contract's hookspecs."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    pm.check_pending()  # every hookimpl in plugin.py names a real hook
    specs = [s for batch in getattr(pm.hook, KINDS["scheduler"].hook)() for s in batch]
    assert len(specs) == len({s.name for s in specs}), "duplicate scheduler names"
    return {s.name: s for s in specs}


def test_provides_all_four_described_and_documented():
    specs = provided()
    assert set(specs) == NAMES
    readme = README.read_text()
    for name, spec in specs.items():
        assert isinstance(spec, SchedulerSpec)
        assert len(spec.description) > 40, name
        assert f"`{name}`" in readme, f"{name} missing from the README"


def test_factories_build_schedulers_from_job_file_arguments():
    for name, spec in provided().items():
        sched = make(spec.factory, batch_size=4, stale_steps=2, oversample=0.5, staleness="newest")
        assert isinstance(sched, Scheduler), name
        assert sched.batch_size == 4 and sched.per_step == 6
        assert sched.can_dispatch(0, 0, 0)


def test_listing_components_does_not_import_heavy_modules():
    code = ("import sys, loongsage_plugin_schedulers.plugin as p; list(p.loongsage_schedulers()); "
            "heavy = [m for m in ('torch', 'transformers', 'ray', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
