"""Settings under which a run would start, spend its hours and learn nothing (or learn badly):
refused, or warned of in one line, by ``loongsage validate`` and before ``loongsage run`` starts.

Refused (a :class:`~loongsage_core.config.ConfigError` naming the key):

* ``train.total_steps = 0``: the run would start every actor and train no step;
* a group-relative advantage estimator (its spec's ``group_relative``: GRPO, Dr. GRPO, RLOO,
  REINFORCE++ with a baseline) with ``rollout.samples_per_prompt = 1``: each group holds one
  sample, whose advantage over its group is 0 (or undefined), so every loss is 0.

Warned of (one line each on the ``loongsage`` logger; the run goes on):

* such an estimator with greedy sampling (``temperature = 0``, for the rollout or a source):
  the samples of a group are the same answer and their advantages 0, unless the agent's
  environment makes them differ;
* ``train.mini_batch_size`` (or ``[critic] mini_batch_size``) larger than a step's
  ``prompts_per_step * samples_per_prompt`` trajectories (each step is one smaller mini-batch),
  or not dividing them (the last mini-batch of every step is a small, noisy one). Agents whose
  trajectories split into several rows make the row count larger, which is why these warn.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import ConfigError, JobConfig

log = logging.getLogger("loongsage")


def check_training_signal(job: JobConfig, host: Any) -> list[str]:
    """Refuse the zero-signal settings above; log and return the warnings."""
    where = job.source_path or "<job>"
    rollout = job.rollout
    if job.train.total_steps == 0:
        raise ConfigError(f"{where}: train.total_steps = 0: the run would train no step; set it >= 1")
    warnings: list[str] = []
    advantage = job.algorithm.advantage
    if host.get("advantage", advantage).group_relative:
        if rollout.samples_per_prompt == 1:
            raise ConfigError(f"{where}: rollout.samples_per_prompt = 1 with algorithm.advantage = '{advantage}', "
                              "which compares the samples of a prompt with each other: a group of one sample has "
                              "advantage 0 and nothing is learned; set samples_per_prompt >= 2")
        greedy = list(dict.fromkeys(
            f"data[{i}].sampling.temperature" if "temperature" in src.sampling else "rollout.temperature"
            for i, src in enumerate(job.data) if src.sampling.get("temperature", rollout.temperature) == 0))
        if greedy:
            warnings.append(f"{where}: {', '.join(greedy)} = 0 (greedy) with algorithm.advantage = '{advantage}': "
                            "the samples of a group will be the same answer, with advantage 0, unless the "
                            "agent's environment makes them differ")
    rows = rollout.prompts_per_step * rollout.samples_per_prompt
    for key, size in (("train.mini_batch_size", job.train.mini_batch_size),
                      ("critic.mini_batch_size", job.critic.mini_batch_size)):
        if size is None:
            continue
        if size > rows:
            warnings.append(f"{where}: {key} = {size} is more than the {rows} trajectories of a step "
                            f"(rollout.prompts_per_step x samples_per_prompt): each step trains one mini-batch "
                            "of what it has")
        elif rows % size:
            warnings.append(f"{where}: {key} = {size} does not divide the {rows} trajectories of a step "
                            f"(rollout.prompts_per_step x samples_per_prompt): the last mini-batch of each step "
                            f"holds {rows % size}")
    for line in warnings:
        log.warning("warning: %s", line)
    return warnings
