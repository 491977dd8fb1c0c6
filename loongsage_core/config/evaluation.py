"""The job file's ``[eval]`` table: held-out evaluation during a run, and for ``loongsage eval``.

An evaluation runs the ``[[eval.data]]`` sources (tables shaped like ``[[data]]``: a path or a
generator, an agent, rewards, sampling) through the same agents, router, engines and rewards as
training, with the policy's current weights, and trains on nothing. :class:`EvalConfig` says when
(``every`` N steps, before the first step and after the last one) and how (``samples`` per prompt,
greedy or sampled); :mod:`loongsage_core.controller.evaluation` runs it.
"""

from __future__ import annotations

import attrs

from .fields import at_least_one, in_range
from .rollout import DataConfig


@attrs.define
class EvalConfig:
    """Held-out evaluation: the ``[[eval.data]]`` sources, scored with the current weights.

    ``every``: evaluate before every ``every``-th step (0: never during the run);
    ``at_start``: before the first step (step 0, the starting weights); ``at_end``: after the last
    step, logged as step ``train.total_steps``. ``samples`` answers per prompt: ``pass@1`` is the
    mean success over every answer, ``pass@k`` (every ``k`` in 1, 2, 4, ... up to ``samples``) the
    unbiased estimate that one of ``k`` answers succeeds; an answer succeeds when its reward is at
    least ``success_threshold``. ``greedy``: temperature 0 (one answer per prompt is then enough).
    ``max_prompts``: the first N prompts of each source (0: all; a source's order is its file's,
    so every evaluation sees the same prompts)."""

    data: list[DataConfig] = attrs.field(factory=list)
    """The held-out sources, one ``[[eval.data]]`` table each, shaped like ``[[data]]`` (no ``teacher``)."""
    every: int = attrs.field(default=0, validator=in_range(ge=0))
    """Evaluate before every ``every``-th step (0: not during the run)."""
    at_start: bool = True
    """Evaluate the starting weights, before step 0."""
    at_end: bool = True
    """Evaluate after the last step (logged as step ``train.total_steps``)."""
    samples: int = attrs.field(default=1, validator=at_least_one)
    """Answers per prompt; ``pass@k`` is reported for k = 1, 2, 4, ... up to it."""
    greedy: bool = False
    """Sample at temperature 0."""
    max_prompts: int = attrs.field(default=0, validator=in_range(ge=0))
    """The first N prompts of each source (0: all)."""
    success_threshold: float = attrs.field(default=1.0, validator=in_range())
    """The reward at or above which an answer counts as a success for ``pass@k``."""

    @property
    def enabled(self) -> bool:
        """Whether the job evaluates at all (it names at least one source)."""
        return bool(self.data)

    def due(self, step: int, total_steps: int) -> bool:
        """Whether an evaluation runs before step ``step`` (``step == total_steps``: after the last)."""
        if not self.enabled:
            return False
        if step == 0 and self.at_start:
            return True
        if step >= total_steps:
            return self.at_end
        return self.every > 0 and step > 0 and step % self.every == 0
