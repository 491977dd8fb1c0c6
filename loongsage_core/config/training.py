"""The job file's training tables: what is trained and how.

``[model]`` (the policy), ``[train]`` with its ``lora`` table (the trainer and its optimizer),
``[algorithm]`` (the loss pipeline), ``[critic]`` (the value model), ``[[teachers]]``
(distillation teachers) and ``[sft]`` (supervised fine-tuning). Each table is an attrs class whose
fields carry the validators of :mod:`.fields`; :class:`~.job.JobConfig` gathers them into a job.
"""

from __future__ import annotations

from typing import Any

import attrs

from loongsage_hookspecs import LORA_ALL_LINEAR

from .fields import (
    Args,
    RangeError,
    at_least_one,
    component,
    in_range,
    non_negative,
    optional_at_least_one,
    positive,
    two_betas,
    unit_interval,
    valid_seed,
)

INFRA_FAILURE_MODES = ("exclude", "zero_reward")
"""What ``[algorithm] infra_failures`` may say to do with trajectories that infrastructure failed."""


@attrs.define
class ModelConfig:
    """The policy model: a local Hugging Face directory (``path``) or, for tests and tiny models,
    a ``config`` table (a transformers config dict with ``model_type``) plus a ``tokenizer``
    directory or tokenizer.json file."""

    path: str | None = None
    config: Args = attrs.field(factory=dict)
    tokenizer: str | None = None
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "bfloat16", "float16")))
    fp32_lm_head: bool = False
    seed: int = attrs.field(default=0, validator=valid_seed)


def _target_modules(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An attrs validator: ``"all-linear"`` alone, or a non-empty list of module names."""
    if not value or not all(isinstance(v, str) and v for v in value):
        raise RangeError(f"must be \"{LORA_ALL_LINEAR}\" or a non-empty list of module names, got {value!r}",
                         attribute.name)
    if LORA_ALL_LINEAR in value and len(value) > 1:
        raise RangeError(f"\"{LORA_ALL_LINEAR}\" stands alone (it already names every linear layer), got {value!r}",
                         attribute.name)


@attrs.define
class LoraConfig:
    """``[train] lora``: train a low-rank adapter instead of the whole model (LoRA).

    ``rank`` is the adapter's rank r, ``alpha`` its scale (the update is ``alpha / rank * B @ A``),
    ``dropout`` the dropout on the adapter's input while training, ``target_modules`` the linear
    layers that get an adapter: module names (``["q_proj", "v_proj"]``) or ``"all-linear"`` (every
    linear layer but the output layer). Only the adapter's weights train, are checkpointed and are
    sent to the engines; the KL reference is the base model with the adapter disabled."""

    rank: int = attrs.field(default=8, validator=at_least_one)
    alpha: float = attrs.field(default=16.0, validator=positive)
    dropout: float = attrs.field(default=0.0, validator=in_range(ge=0, lt=1))
    target_modules: list[str] = attrs.field(factory=lambda: [LORA_ALL_LINEAR], validator=_target_modules)

    @property
    def all_linear(self) -> bool:
        """Whether ``target_modules`` is ``"all-linear"``."""
        return self.target_modules == [LORA_ALL_LINEAR]


@attrs.define
class TrainConfig:
    """Trainer settings. ``mini_batch_size`` rows per optimizer step, split into micro-batches of
    ``micro_batch_size`` rows; the loss denominator is global to the mini-batch.

    ``max_bad_steps``: a step whose loss, gradient norm or weights are not finite is skipped, and so
    is one that trains no row; this many such steps in a row end the run with an error naming
    the cause.

    ``max_tokens_per_micro_batch``: padding-free micro-batches packed up to this many tokens
    (instead of ``micro_batch_size`` rows), for training and the scoring passes; data-parallel
    ranks then get near-equal token counts (backends without packing ignore it).

    ``peak_tflops``: one trainer device's peak the ``perf/mfu_*`` metrics divide by (default: a
    table of accelerators, or a matmul probe on a CPU; :mod:`loongsage_core.flops`).

    ``lora`` (a :class:`LoraConfig` table, unset by default): train a LoRA adapter instead of
    every weight."""

    backend: str = component("train_backend", default="torch")
    num_workers: int = attrs.field(default=1, validator=at_least_one)
    lr: float = attrs.field(default=1e-5, validator=positive)
    lr_schedule: str = attrs.field(default="constant", validator=attrs.validators.in_(("constant", "linear", "cosine")))
    lr_warmup_steps: int = attrs.field(default=0, validator=in_range(ge=0))
    min_lr_ratio: float = attrs.field(default=0.0, validator=unit_interval)
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999], validator=two_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    grad_clip: float = attrs.field(default=1.0, validator=non_negative)
    total_steps: int = attrs.field(default=50, validator=in_range(ge=0))
    mini_batch_size: int = attrs.field(default=16, validator=at_least_one)
    micro_batch_size: int = attrs.field(default=4, validator=at_least_one)
    max_tokens_per_micro_batch: int | None = attrs.field(default=None,
                                                         validator=attrs.validators.optional(at_least_one))
    ppo_epochs: int = attrs.field(default=1, validator=at_least_one)
    max_bad_steps: int = attrs.field(default=3, validator=at_least_one)
    gradient_checkpointing: bool = False
    peak_tflops: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    backend_args: Args = attrs.field(factory=dict)
    lora: LoraConfig | None = None


@attrs.define
class AlgorithmConfig:
    """Loss pipeline choices (DESIGN.md section 6). Each ``*_args`` table is passed as keyword
    arguments to the named component.

    Distillation (rows of sources with a ``teacher``): with ``distill_kl`` unset the teachers
    stand in for the reference model and feed ``kl`` / ``kl_coef`` / ``kl_in_reward``; with
    ``distill_kl`` set (a ``kl`` component, e.g. ``opd_topk_kl``) it is a term of its own,
    ``distill_coef * aggregate(term)`` in the loss (or subtracted from the token rewards with
    ``distill_in_reward``), next to an ordinary reference KL. ``distill_topk`` is how many
    teacher top-k entries per token are computed when the term ``requires = "topk"``.

    Router Replay (R3, mixture-of-experts policies): ``router_replay`` asks the engines for the
    experts they routed each token to and makes every policy forward (old log-probs, training, a
    LoRA run's reference) use them, gating weights still from the current router. With
    ``router_replay_compare`` (default) the old-log-prob pass (then always run) also scores the
    rows without replay, for ``train/router_agreement[_no_replay]`` and
    ``train/is_approx_k3_kl_no_replay``.

    Failed trajectories (``Trajectory.failure``): the policy's own failures (``agent``: over the
    context, an agent raising ``AgentFailure``) are trained on with reward 0, like a wrong answer.
    Infrastructure failures (a sandbox, a CLI crash or timeout, an engine, a reward that broke)
    say nothing about the policy: ``infra_failures = "exclude"`` (default) leaves them out of
    their group's statistics and of the loss, ``"zero_reward"`` trains them with reward 0. A
    group-relative estimator's group left with fewer than two samples is not trained."""

    advantage: str = component("advantage", args="advantage_args", default="grpo")
    advantage_args: Args = attrs.field(factory=dict)
    policy_loss: str = component("policy_loss", args="policy_loss_args", default="ppo_clip")
    policy_loss_args: Args = attrs.field(factory=dict)
    loss_agg: str = component("loss_aggregation", args="loss_agg_args", default="token_mean")
    loss_agg_args: Args = attrs.field(factory=dict)
    kl: str | None = component("kl", args="kl_args", default=None)
    kl_args: Args = attrs.field(factory=dict)
    kl_coef: float = attrs.field(default=0.0, validator=non_negative)
    kl_in_reward: bool = False
    ref_update_every: int = attrs.field(default=0, validator=in_range(ge=0))
    entropy_coef: float = attrs.field(default=0.0, validator=in_range())
    recompute_old_logprobs: bool = True
    force_old_logprob_pass: bool = False
    corrections: list[str] = component("correction", args="correction_args", factory=list)
    correction_args: dict[str, Args] = attrs.field(factory=dict)
    filters: list[str] = component("filter", args="filter_args", factory=list)
    filter_args: dict[str, Args] = attrs.field(factory=dict)
    max_filter_retries: int = attrs.field(default=0, validator=in_range(ge=0))
    distill_kl: str | None = component("kl", args="distill_kl_args", default=None)
    distill_kl_args: Args = attrs.field(factory=dict)
    distill_coef: float = attrs.field(default=1.0, validator=non_negative)
    distill_in_reward: bool = False
    distill_topk: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    router_replay: bool = False
    router_replay_compare: bool = True
    infra_failures: str = attrs.field(default="exclude", validator=attrs.validators.in_(INFRA_FAILURE_MODES))


@attrs.define
class CriticConfig:
    """The value model (critic) that advantage estimators with ``needs_critic`` (``gae``) use.

    It is the policy's transformer backbone plus a scalar value head, in Ray actors of its own,
    trained after the policy on each step's rows with a clipped value loss aggregated like the
    policy loss (``[algorithm] loss_agg``); it is checkpointed with the run. Unset values fall back
    to the policy's: ``path`` to ``[model] path`` (or the inline ``[model] config``), ``lr`` to
    ``[train] lr``, ``mini_batch_size`` / ``micro_batch_size`` / ``ppo_epochs`` to ``[train]``'s.
    ``value_clip`` bounds how far a value may move from its rollout-time value before the clipped
    term takes over (``0`` disables clipping); ``loss_coef`` scales the value loss. ``num_workers``
    data-parallel critic ranks reserve ``cpus`` / ``gpus`` each. Jobs whose advantage needs no
    critic ignore this table."""

    path: str | None = None
    lr: float | None = attrs.field(default=None, validator=in_range(gt=0, optional=True))
    value_clip: float = attrs.field(default=0.2, validator=non_negative)
    loss_coef: float = attrs.field(default=1.0, validator=positive)
    mini_batch_size: int | None = attrs.field(default=None, validator=optional_at_least_one)
    micro_batch_size: int | None = attrs.field(default=None, validator=optional_at_least_one)
    ppo_epochs: int | None = attrs.field(default=None, validator=optional_at_least_one)
    num_workers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    cpus: float = attrs.field(default=1.0, validator=non_negative)
    gpus: float = attrs.field(default=0.0, validator=non_negative)


@attrs.define
class TeacherConfig:
    """A distillation teacher: a name data sources refer to, a model and a teacher backend."""

    name: str
    path: str | None = None
    backend: str = component("teacher", args="args", default="torch")
    args: Args = attrs.field(factory=dict)


@attrs.define
class SftConfig:
    """Supervised fine-tuning (``loongsage sft``): how the ``[[data]]`` conversations become steps.

    Each row's ``messages_key`` column holds a chat (a list of ``{"role", "content"}`` messages,
    optionally with ``tool_calls``; ``tools_key`` may name a column of tool schemas). It is rendered
    with the model's chat template by the AgentFlow router's own code, and the loss is on the
    assistant turns only (``loss_on = "assistant"``) or on every token after the first (``"all"``).
    A step trains ``[train] mini_batch_size`` conversations; ``packing`` lays a step's
    conversations into rows of at most ``max_seq_len`` tokens, each attending only to itself with
    restarting position ids, which gives the same loss as one row per conversation. Conversations
    longer than ``max_seq_len`` are cut to it. ``eval_rows`` (a count) or ``eval_fraction`` of the
    rows are held back and their loss is reported as ``sft/eval_loss`` every ``eval_every`` steps
    (0: at the end only). The run trains ``epochs`` passes over the rest (``max_steps`` > 0 stops
    earlier); ``[train] total_steps`` is not used."""

    epochs: int = attrs.field(default=1, validator=at_least_one)
    max_steps: int = attrs.field(default=0, validator=in_range(ge=0))
    packing: bool = True
    max_seq_len: int = attrs.field(default=2048, validator=in_range(ge=2))
    loss_on: str = attrs.field(default="assistant", validator=attrs.validators.in_(("assistant", "all")))
    messages_key: str = "messages"
    tools_key: str | None = None
    eval_rows: int = attrs.field(default=0, validator=in_range(ge=0))
    eval_fraction: float = attrs.field(default=0.0, validator=in_range(ge=0, lt=1))
    eval_every: int = attrs.field(default=0, validator=in_range(ge=0))
    shuffle: bool = True
