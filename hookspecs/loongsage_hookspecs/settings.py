"""The job settings a backend may read from its context (``TrainWorkerContext.job``,
``EngineContext.job``), as read-only Protocols.

The host passes its resolved job (``loongsage_core``'s ``JobConfig``, which satisfies these
structurally); a backend relies on the fields listed here and on nothing else of the host's
schema, so the schema can change behind them. The loss itself is the host's
(``loongsage_core.backend_api.LossPipeline``, built from ``[algorithm]``); a backend reads of
``[algorithm]`` only what :class:`AlgorithmSettings` lists.
"""

from __future__ import annotations

from typing import Any, Protocol


class ModelSettings(Protocol):
    """``[model]``: the checkpoint (a Hugging Face directory) or an inline config, and its dtype."""

    @property
    def path(self) -> str | None: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def fp32_lm_head(self) -> bool: ...
    @property
    def seed(self) -> int: ...


class LoraSettings(Protocol):
    """``[train] lora``: the LoRA adapter trained instead of every weight.

    ``target_modules`` is a list of module names, or ``["all-linear"]`` for every linear layer
    except the output layer; the adapter's update is ``alpha / rank * B @ A``."""

    @property
    def rank(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def dropout(self) -> float: ...
    @property
    def target_modules(self) -> list[str]: ...


class TrainSettings(Protocol):
    """``[train]``: optimizer, schedule, batch sizes and the backend's own ``backend_args``."""

    @property
    def num_workers(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def lr_warmup_steps(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def betas(self) -> list[float]: ...
    @property
    def eps(self) -> float: ...
    @property
    def grad_clip(self) -> float: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def backend_args(self) -> dict[str, Any]: ...
    @property
    def lora(self) -> LoraSettings | None: ...


class CriticSettings(Protocol):
    """``[critic]``: the value model's checkpoint and the settings that override ``[train]``'s."""

    @property
    def path(self) -> str | None: ...
    @property
    def lr(self) -> float | None: ...
    @property
    def value_clip(self) -> float: ...
    @property
    def loss_coef(self) -> float: ...
    @property
    def micro_batch_size(self) -> int | None: ...


class RunSettings(Protocol):
    """``[run]``: the seed every rank derives its own from."""

    @property
    def seed(self) -> int: ...


class RolloutSettings(Protocol):
    """``[rollout]``: what an engine needs: the context length and its own ``engine_args``."""

    @property
    def max_context_length(self) -> int: ...
    @property
    def engine_args(self) -> dict[str, Any]: ...


class PlacementSettings(Protocol):
    """``[placement]``: whether trainer and engines share devices, and the GPUs a trainer rank
    reserves (a rank that reserves none sees no CUDA device)."""

    @property
    def colocate(self) -> bool: ...
    @property
    def trainer_gpus(self) -> float: ...


class AlgorithmSettings(Protocol):
    """``[algorithm]`` as a backend reads it: the loss aggregation (a critic aggregates its value
    loss like the policy loss) and Router Replay for mixture-of-experts policies
    (``router_replay``: every policy forward replays the engine's expert choices;
    ``router_replay_compare``: the old-log-prob pass also scores without replay, for the
    agreement metrics)."""

    @property
    def loss_agg(self) -> str: ...
    @property
    def loss_agg_args(self) -> dict[str, Any]: ...
    @property
    def router_replay(self) -> bool: ...
    @property
    def router_replay_compare(self) -> bool: ...


class JobSettings(Protocol):
    """The job as a backend sees it; relative paths resolve against the job file's folder."""

    @property
    def model(self) -> ModelSettings: ...
    @property
    def train(self) -> TrainSettings: ...
    @property
    def critic(self) -> CriticSettings: ...
    @property
    def run(self) -> RunSettings: ...
    @property
    def rollout(self) -> RolloutSettings: ...
    @property
    def placement(self) -> PlacementSettings: ...
    @property
    def algorithm(self) -> AlgorithmSettings: ...
    @property
    def source_path(self) -> str | None: ...

    def resolve_path(self, value: str) -> str: ...
